"""Kernels of sglang-magicdec. Each GPU kernel sits next to a plain torch implementation of the
same signature: the torch one runs on CPU and is the reference the GPU one is tested against."""
