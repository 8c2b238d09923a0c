"""DCP's load planner with a safe unpickler: :func:`~qcomm.checkpoint.load_sharded_checkpoint`
reads every item of a DCP checkpoint that is not a tensor (an optimizer's param groups, its
step counts) through torch's weights-only unpickler, where DCP's own planner would unpickle it
with ``weights_only=False`` and run whatever code the file names.

Imported at the first sharded load, not with :mod:`qcomm.checkpoint`: DCP imports DTensor.
"""

from __future__ import annotations

import io
import pickle
from pathlib import Path

import torch
from torch.distributed.checkpoint._nested_dict import set_element
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.planner import ReadItem

from qcomm.checkpoint.checkpoint_file import UnsafeCheckpointError

__all__ = ["WeightsOnlyPlanner"]


class WeightsOnlyPlanner(DefaultLoadPlanner):
    """DCP's load planner, but what is not a tensor is unpickled by torch's weights-only
    unpickler: plain data loads, an object whose unpickling would run code is refused."""

    def __init__(self, directory: Path) -> None:
        super().__init__()
        self.directory = directory

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        fqn = read_item.dest_index.fqn
        try:
            obj = torch.load(value, weights_only=True)
        except pickle.UnpicklingError as e:
            raise UnsafeCheckpointError(
                f"{self.directory}: item {fqn!r} holds objects torch's weights-only unpickler "
                f"refuses ({e}); loading them could run code from the file, so it is not "
                "loaded", self.directory, []) from e
        if self.flatten_state_dict:
            set_element(self.original_state_dict, self.mappings[fqn], obj)
        else:
            self.state_dict[fqn] = obj
