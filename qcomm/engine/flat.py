"""The communicated parameters as one flat float32 buffer, sharded across a node's local ranks.

Gossip works on one contiguous float32 vector per rank. The parameters (in param-group order,
each once, frozen ones left out) are laid end to end in ``flat`` (float32 ``[padded_numel]``),
whose tail is zero padding so that it splits into ``num_shards`` equal shards of
``shard_numel`` elements, a multiple of the codec's block size (every shard's blocks are full,
so the wire size is ``packed_nbytes(shard_numel, spec)`` for every rank).

When every parameter is float32, contiguous and on one device, the parameters *live* in
``flat``: each one's data becomes a view of its range (as DDP's ``gradient_as_bucket_view``
does for gradients and FSDP's flat parameter for parameters), the parameter objects stay the
same (the optimizer's state, hooks and references keep working), and the gossip reads and
writes them in place: no copy in, no copy out. Otherwise (bf16 parameters, several devices, a
non-contiguous one) ``flat`` is a float32 copy, filled and written back around each round.

A complex parameter is laid out as its real view (``torch.view_as_real``: each value's real
and imaginary parts, two floats), so it takes twice its number of values in ``flat``, and the
gossip, the codec and the averages see exactly those floats. Complex parameters are always
copied (a complex view of ``flat`` would need every range to start at an even offset).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from qcomm.engine.gradients import real_view


def _values(p: torch.Tensor) -> torch.Tensor:
    """``p``'s values as one flat real tensor (a complex one as its two floats per value); a
    view of ``p`` when it is contiguous, else a copy."""
    return real_view(p.detach()).reshape(-1)


def _real_numel(p: torch.Tensor) -> int:
    """How many elements ``p`` takes in the flat buffer: 2 per value when complex."""
    return p.numel() * (2 if p.is_complex() else 1)


class FlatParams:
    """The parameters' flat float32 buffer: their storage (aliased) or a copy.

    Args:
        params: the parameters, any floating or complex dtype. They may live on several
            devices; the flat buffer lives on the first parameter's device (copies cross
            devices).
        num_shards: the node's number of local ranks (>= 1).
        align: shard length granularity (the codec block size times the fragments).
        alias: make the parameters views of ``flat`` when they allow it (see the module
            docstring); False keeps them where they are and copies.

    Attributes:
        aliased: whether the parameters are views of ``flat`` now.
    """

    def __init__(self, params: Sequence[torch.Tensor], num_shards: int, align: int, *,
                 alias: bool = True) -> None:
        if not params:
            raise ValueError("params must not be empty")
        device = params[0].device
        self.params = list(params)
        self.numel = sum(_real_numel(p) for p in self.params)
        per = -(-self.numel // num_shards)
        self.shard_numel = max(align, -(-per // align) * align)
        self.num_shards = num_shards
        self.padded_numel = self.shard_numel * num_shards
        self.flat = torch.zeros(self.padded_numel, dtype=torch.float32, device=device)
        sizes = [_real_numel(p) for p in self.params]
        # Views of ``flat``, one per parameter, in order (the padding is not covered).
        self._views = list(torch.split(self.flat[: self.numel], sizes))
        same = all(p.dtype == torch.float32 and p.device == device for p in self.params)
        # One torch.cat when every parameter is float32 on the buffer's device.
        self._catable = same
        # Ranges can be copied element-wise only into contiguous parameters.
        self.ranges_ok = all(p.is_contiguous() for p in self.params)
        # Where each parameter starts in ``flat``.
        self._starts = [0]
        for n in sizes:
            self._starts.append(self._starts[-1] + n)
        self.aliased = False
        # Two parameters sharing storage (tied by hand, not by object) would come apart.
        storages = {p.untyped_storage().data_ptr() for p in self.params if p.numel()}
        shared = len(storages) < sum(1 for p in self.params if p.numel())
        if alias and same and self.ranges_ok and not shared \
                and not any(p.is_meta for p in self.params):
            self._alias()

    def _alias(self) -> None:
        """Move every parameter's values into ``flat`` and make its data a view there (one that
        is a view there already stays as it is)."""
        with torch.no_grad():
            for p, v in zip(self.params, self._views, strict=True):
                if p.data_ptr() != v.data_ptr():
                    v.copy_(p.detach().reshape(-1))
                    p.data = v.view_as(p)
        self.aliased = True

    def check_aliased(self) -> None:
        """Re-alias when something replaced a parameter's data since (``model.to()``,
        ``p.data = ...``, ``load_state_dict(assign=True)``): the values it holds now are
        taken into ``flat`` first."""
        if self.aliased and any(p.data_ptr() != v.data_ptr() or p.dtype != torch.float32
                                or p.device != self.flat.device
                                for p, v in zip(self.params, self._views, strict=True)):
            self.aliased = False
            if all(p.dtype == torch.float32 and p.device == self.flat.device
                   and p.is_contiguous() for p in self.params):
                self._alias()

    def shard(self, index: int) -> torch.Tensor:
        """float32 ``[shard_numel]`` view of shard ``index`` of ``flat``."""
        return self.flat[index * self.shard_numel: (index + 1) * self.shard_numel]

    def load_from_params(self) -> torch.Tensor:
        """flat <- parameters (cast to float32); nothing to do when aliased. Returns ``flat``."""
        if self.aliased:
            return self.flat
        with torch.no_grad():
            if self._catable:
                torch.cat([p.detach().reshape(-1) for p in self.params],
                          out=self.flat[: self.numel])
            else:
                for v, p in zip(self._views, self.params, strict=True):
                    v.copy_(_values(p))
        return self.flat

    def _pieces(self, start: int, stop: int):
        """(parameter index, offset in it, offset in flat, length) of the parameters' elements
        inside ``flat[start:stop]``."""
        for i in range(len(self.params)):
            a, b = max(start, self._starts[i]), min(stop, self._starts[i + 1])
            if a < b:
                yield i, a - self._starts[i], a, b - a

    def load_range(self, start: int, stop: int) -> None:
        """``flat[start:stop]`` <- the parameters' elements there (a gossip round reads only the
        fragments it sends and mixes, so only they are copied)."""
        if self.aliased:
            return
        with torch.no_grad():
            for i, off, at, n in self._pieces(start, stop):
                self.flat[at:at + n].copy_(_values(self.params[i])[off:off + n])

    def store_range(self, start: int, stop: int, keep: Sequence[bool] | None = None) -> None:
        """The parameters' elements in ``flat[start:stop]`` <- flat (``keep`` as in
        :meth:`store_to_params`); nothing to do when aliased."""
        if self.aliased:
            return
        with torch.no_grad():
            for i, off, at, n in self._pieces(start, stop):
                if keep is None or not keep[i]:
                    # A view of the parameter: ranges are stored only into contiguous ones.
                    _values(self.params[i])[off:off + n].copy_(self.flat[at:at + n])

    def store_to_params(self, keep: Sequence[bool] | None = None) -> None:
        """parameters <- flat (cast to each parameter's dtype and device); nothing to do when
        aliased.

        Args:
            keep: one flag per parameter; True leaves that parameter as it is (the optimizer
                did not update it this step, so the communication must not either). None
                stores every parameter.
        """
        if self.aliased:
            return
        with torch.no_grad():
            for i, (v, p) in enumerate(zip(self._views, self.params, strict=True)):
                if keep is None or not keep[i]:
                    target = real_view(p.detach())  # shares p's storage
                    target.copy_(v.view(target.shape))

    def snapshot(self, keep: Sequence[bool]) -> list[tuple[int, torch.Tensor]]:
        """Copies of the parameters flagged in ``keep`` (aliased: a round writes them in place,
        so :meth:`restore` puts them back after it)."""
        if not self.aliased or not any(keep):
            return []
        return [(i, self._views[i].clone()) for i, k in enumerate(keep) if k]

    def restore(self, saved: list[tuple[int, torch.Tensor]]) -> None:
        """Undo a round's writes to the parameters :meth:`snapshot` saved."""
        with torch.no_grad():
            for i, values in saved:
                self._views[i].copy_(values)
