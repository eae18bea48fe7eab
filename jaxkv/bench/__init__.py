"""Benchmarks: ``python -m jaxkv.bench NAME``."""
