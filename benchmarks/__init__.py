"""Benchmarks, outside the installed packages: `make bench` runs `python -m benchmarks.run`."""
