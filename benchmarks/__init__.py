"""Runnable benchmarks of horovod_sparse (see README: Benchmarks)."""
