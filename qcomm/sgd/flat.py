"""Flat float32 view of an optimizer's parameters, sharded across a node's local ranks.

Gossip works on one contiguous float32 vector per rank. The parameters (in param-group order,
each once) are concatenated into ``flat`` (float32 ``[padded_numel]``), whose tail is zero
padding so that it splits into ``num_shards`` equal shards of ``shard_numel`` elements, a
multiple of the codec's block size (every shard's blocks are full, so the wire size is
``packed_nbytes(shard_numel, spec)`` for every rank).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


class FlatParams:
    """Copies parameters into a padded flat float32 buffer and back.

    Args:
        params: the parameters, any float dtype, all on one device.
        num_shards: the node's number of local ranks (>= 1).
        align: shard length granularity (the codec block size).
    """

    def __init__(self, params: Sequence[torch.Tensor], num_shards: int, align: int) -> None:
        if not params:
            raise ValueError("params must not be empty")
        devices = {p.device for p in params}
        if len(devices) != 1:
            raise ValueError(f"all parameters must be on one device for gossip, got {devices}")
        self.params = list(params)
        self.numel = sum(p.numel() for p in self.params)
        per = -(-self.numel // num_shards)
        self.shard_numel = max(align, -(-per // align) * align)
        self.num_shards = num_shards
        self.padded_numel = self.shard_numel * num_shards
        self.flat = torch.zeros(self.padded_numel, dtype=torch.float32, device=devices.pop())
        sizes = [p.numel() for p in self.params]
        # Views of ``flat``, one per parameter, in order (the padding is not covered).
        self._views = list(torch.split(self.flat[: self.numel], sizes))
        self._all_fp32 = all(p.dtype == torch.float32 for p in self.params)

    def shard(self, index: int) -> torch.Tensor:
        """float32 ``[shard_numel]`` view of shard ``index`` of ``flat``."""
        return self.flat[index * self.shard_numel: (index + 1) * self.shard_numel]

    def load_from_params(self) -> torch.Tensor:
        """flat <- parameters (cast to float32). Returns ``flat``."""
        with torch.no_grad():
            if self._all_fp32:
                torch.cat([p.detach().reshape(-1) for p in self.params],
                          out=self.flat[: self.numel])
            else:
                for v, p in zip(self._views, self.params, strict=True):
                    v.copy_(p.detach().reshape(-1))
        return self.flat

    def store_to_params(self) -> None:
        """parameters <- flat (cast to each parameter's dtype)."""
        with torch.no_grad():
            for v, p in zip(self._views, self.params, strict=True):
                p.copy_(v.view_as(p))
