"""Triton kernels of the quant methods (imported only on CUDA, or under TRITON_INTERPRET=1)."""
