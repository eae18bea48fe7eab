"""Benchmarks: ``python -m jaxkv.bench NAME``. Each module has a ``main(args)``;
none is imported by the library."""

__all__: list = []  # run by name through ``python -m jaxkv.bench``
