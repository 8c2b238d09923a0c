"""Codec backends. ``reference`` (pure torch, CPU path and oracle) and ``triton_codec`` (fused
Triton kernels for CUDA) implement the same three functions bit for bit:
``quantize_into``, ``dequantize_into``, ``dequant_accumulate_into``."""
