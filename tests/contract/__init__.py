"""The contract suite of the gateway's storage facades, run against both implementations."""
