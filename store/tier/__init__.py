"""Tiered storage: sealed segments and their indexes moved to object storage through fsspec (docs/store.md)."""
