"""Runnable benchmarks of horovod_sparse (see docs/benchmarks.md)."""
