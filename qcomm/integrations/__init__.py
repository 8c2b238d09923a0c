"""qcomm inside the training frameworks people already use.

* :mod:`qcomm.integrations.lightning`: ``QcommStrategy``, a Lightning strategy (the
  ``lightning`` extra: ``pip install 'qcomm[lightning]'``); imported on demand, so that
  ``import qcomm`` never needs Lightning.
* :mod:`qcomm.sgd.lightning_guard`: the check that refuses a qcomm optimizer stepped by another
  Lightning strategy (no framework import).

The Hugging Face Accelerate recipe needs no module of its own: docs/guide.md, "Hugging Face
Accelerate".
"""

from qcomm.sgd.lightning_guard import WrongStrategyError

__all__ = ["WrongStrategyError"]
