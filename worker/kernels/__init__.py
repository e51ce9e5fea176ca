"""Kernels: plain-PyTorch references (`reference`), GPU kernels (`triton/`), and the registry
(`ops`) through which the models call them."""
