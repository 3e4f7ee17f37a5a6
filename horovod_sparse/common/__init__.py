"""Framework-free logic shared by the PyTorch and TensorFlow front ends.

Nothing in this package imports torch, tensorflow or horovod: it is plain Python and NumPy so
that the decisions every method makes (how many coordinates, which partition, which threshold,
which grouping) are written once and unit-tested in one process.
"""
