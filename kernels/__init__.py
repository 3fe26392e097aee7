"""Triton kernels and their host launchers, installed as remat.kernels."""
