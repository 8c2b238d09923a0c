"""qcomm: communication compression for data-parallel training over slow networks.

Subpackages (each imports only the ones listed after it):
    qcomm.sgd          ASSGD, the drop-in hierarchical asynchronous optimizer
    qcomm.hooks        DDP comm hooks
    qcomm.collectives  topology, intra-node allreduce, hierarchical allreduce, compressed gossip
    qcomm.compress     the codec: QuantSpec, quantize / dequantize / dequant_accumulate
    qcomm.kernels      Triton kernels and the pure-torch reference
    qcomm.testing      hypothesis strategies and property checks
"""

__version__ = "0.1.0"
