"""Packaging for horovod_sparse: gradient sparsification for Horovod (PyTorch and TensorFlow)."""
from setuptools import find_packages, setup

setup(
    name="horovod_sparse",
    version="0.1.0",
    description="Sparse gradient communication (MiCRO, ExDyna, gTop-k, LAGS, MergeComp, Top-k, DGC) for Horovod",
    long_description=open("README.md", encoding="utf-8").read() if __import__("os").path.exists("README.md") else "",
    long_description_content_type="text/markdown",
    packages=find_packages(include=["horovod_sparse", "horovod_sparse.*"]),
    python_requires=">=3.9",
    # Horovod, torch and tensorflow are deliberately not install_requires: Horovod must be built
    # against the framework versions already installed (scripts/install.sh does that), and a bare
    # `torch` requirement would pull a CUDA build.
    install_requires=["numpy"],
    extras_require={"test": ["pytest", "hypothesis", "scikit-learn"]},
    license="Apache-2.0",
)
