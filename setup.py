"""Builds the optional C accelerator `store._append` (the CommitLog's per-record encoding loop).

Everything else is in pyproject.toml. `optional=True`: without a C compiler the install still
succeeds and the store runs its pure-Python encoder (same bytes, slower; docs/store.md).
"""
from setuptools import Extension, setup

setup(ext_modules=[Extension("store._append", ["store/_append.c"], optional=True,
                             extra_compile_args=["-O2"])])
