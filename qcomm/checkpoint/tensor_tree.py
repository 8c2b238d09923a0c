"""A state of nested containers as tensors only, and back: what a DCP checkpoint can hold without
pickles.

``torch.distributed.checkpoint`` stores anything that is not a tensor as a pickle and unpickles
it with ``weights_only=False`` on load, so a file could run code. qcomm's own per-rank state
(counters, configs, gossip rounds: ints, floats, strings, tuples, dicts and tensors) goes
through :func:`to_tensors` instead: its structure becomes one JSON document in a uint8 tensor,
its tensors stay tensors, and :func:`from_tensors` rebuilds the very same object (tuples stay
tuples, int keys stay ints, NaN stays NaN).
"""

from __future__ import annotations

import json
import math
from typing import Any

import torch

__all__ = ["STRUCTURE", "from_tensors", "to_tensors"]

STRUCTURE = "structure"  # the key of the JSON document; the tensors are "t0", "t1", ...


def to_tensors(obj: Any) -> dict[str, torch.Tensor]:
    """``obj`` (None, bool, int, float, str, tuple, list, dict and tensors, nested) as a flat
    dict of tensors: ``"structure"`` (uint8, the JSON document) and ``"t0"``, ``"t1"``, ...
    (its tensors, as they are: references).

    Raises:
        TypeError: an object of another type, naming where it is in ``obj``.
    """
    tensors: dict[str, torch.Tensor] = {}

    def enc(x: Any, where: str) -> Any:
        if x is None or isinstance(x, (bool, int, str)):
            return x
        if isinstance(x, float):
            return x if math.isfinite(x) else {"__f": repr(x)}
        if isinstance(x, torch.Tensor):
            key = f"t{len(tensors)}"
            tensors[key] = x
            return {"__x": key}
        if isinstance(x, tuple):
            return {"__t": [enc(v, f"{where}[{i}]") for i, v in enumerate(x)]}
        if isinstance(x, list):
            return [enc(v, f"{where}[{i}]") for i, v in enumerate(x)]
        if isinstance(x, dict):
            return {"__d": [[enc(k, f"{where} key"), enc(v, f"{where}[{k!r}]")]
                            for k, v in x.items()]}
        raise TypeError(f"{where} is a {type(x).__name__}: a checkpoint's qcomm state holds "
                        "only None, bool, int, float, str, tuples, lists, dicts and tensors")

    doc = json.dumps(enc(obj, "state")).encode()
    return {STRUCTURE: torch.frombuffer(bytearray(doc), dtype=torch.uint8), **tensors}


def from_tensors(flat: dict[str, torch.Tensor]) -> Any:
    """The object :func:`to_tensors` made ``flat`` from.

    Raises:
        ValueError: ``flat`` is not such a dict (no structure, a tensor it names missing).
    """
    doc = flat.get(STRUCTURE)
    if not isinstance(doc, torch.Tensor) or doc.dtype != torch.uint8 or doc.dim() != 1:
        raise ValueError(f"a qcomm state needs {STRUCTURE!r}: a 1-D uint8 tensor")
    try:
        tree = json.loads(bytes(doc.cpu().numpy().tobytes()).decode())
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"the qcomm state's structure is not a JSON document: {e}") from e

    def dec(x: Any) -> Any:
        if isinstance(x, list):
            return [dec(v) for v in x]
        if not isinstance(x, dict):
            return x
        (tag, v), = x.items()
        if tag == "__f":
            return float(v)
        if tag == "__x":
            if v not in flat:
                raise ValueError(f"the qcomm state names tensor {v!r}, which it does not hold")
            return flat[v]
        if tag == "__t":
            return tuple(dec(e) for e in v)
        return {dec(k): dec(e) for k, e in v}

    return dec(tree)
