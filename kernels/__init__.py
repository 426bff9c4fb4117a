"""Weight-only quantized matmuls (W4A16, W8A16): a plain-torch reference, Triton GEMMs and CPU kernels.

The storage format every path shares is described in `kernels.wq_reference`; `kernels.dispatch` picks
the implementation for a tensor's device.
"""
