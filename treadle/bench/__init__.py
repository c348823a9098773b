"""Benchmarks behind `treadle bench`."""
