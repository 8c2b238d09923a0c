"""qcomm: communication compression for data-parallel training over slow networks.

The package in layers, top to bottom; each imports only its own layer and the layers below it
(``tests/test_layers.py`` checks every import of every module):

    qcomm.testing      hypothesis strategies, codec property checks and multi-process
                       runners; may import every layer, and no layer imports it
    qcomm.integrations training frameworks: Lightning's QcommStrategy (an optional extra)
    qcomm.hooks        DDP comm hooks                                  (siblings: neither
    qcomm.sgd          ASSGD and HierarchicalOptimizer, torch.optim     imports the other)
    qcomm.checkpoint   per-rank and sharded (DCP) checkpoints of an optimizer on the engine
    qcomm.engine       one model's communication: AveragingEngine, CommOptions
    qcomm.collectives  topology, intra-node allreduce, hierarchical allreduce, compressed gossip
    qcomm.compress     the codec: QuantSpec, quantize / dequantize / dequant_accumulate
    qcomm.kernels      the Triton kernels and the pure-torch reference  (siblings: neither
    qcomm.rendezvous   the job's rendezvous, one torchrun per node       imports the other)
    qcomm.wire         frames, the job token's admission, encryption of a connection
    qcomm.seeds        the seed derivation tree (every random stream comes from it)
    qcomm.validation   the argument checks every layer shares

``import qcomm`` itself imports none of them. docs/design.md explains the layers and the data
flow of a step.
"""

__version__ = "0.1.0"
