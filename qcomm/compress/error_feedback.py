"""Error-feedback residuals kept per key: :class:`ErrorFeedback`."""

from __future__ import annotations

import torch

from qcomm.kernels.wire_format import INPUT_DTYPES, QuantSpec, check_spec
from qcomm.validation import check_instance

from .arguments import check_float_tensor, check_out, resolve_seed
from .encode import quantize_checked
from .packed import Packed

__all__ = ["ErrorFeedback"]


class ErrorFeedback:
    """Error-feedback residuals, one per key (a parameter name, a bucket index, a shard).

    Buffers are created lazily on first use with the tensor's numel and device. Each key holds a
    current residual and a spare of the same size: :meth:`quantize` reads the current one and
    writes the new residual into the spare (one pass over memory, no scratch copy), then swaps
    them, so a :class:`NonFiniteError` leaves the residual exactly as it was.
    """

    def __init__(self) -> None:
        self._residuals: dict[str | int, torch.Tensor] = {}
        self._spares: dict[str | int, torch.Tensor] = {}
        self._pending: set[str | int] = set()  # keys whose new residual awaits commit()
        self._deferred: dict[str | int, Packed] = {}  # pending keys of non_blocking calls

    def __contains__(self, key: str | int) -> bool:
        return key in self._residuals

    def keys(self) -> list[str | int]:
        return list(self._residuals)

    def residual(self, key: str | int) -> torch.Tensor | None:
        """The current float32 residual for ``key`` (flat), or None before first use."""
        return self._residuals.get(key)

    def quantize(self, key: str | int, x: torch.Tensor, spec: QuantSpec, *,
                 seed: int | None = None, out: torch.Tensor | None = None,
                 commit: bool = True, non_blocking: bool = False) -> Packed:
        """Quantize ``x`` with the residual stored under ``key`` and update it.

        Same arguments and errors as :func:`quantize`. Raises ValueError if ``key`` already
        holds a residual of another numel or device.

        ``commit=False`` computes the new residual but keeps the current one until
        :meth:`commit` (a collective that may still fail after this message was sent then
        changes no residual if it fails: the caller commits only once every stage succeeded);
        the next ``quantize`` of ``key`` drops an uncommitted residual.

        ``non_blocking=True`` (with ``commit=False``: a residual cannot move before its check
        is read) leaves the finiteness check on the device, no host sync here: :meth:`commit`
        reads it and raises the :class:`NonFiniteError` that the blocking call would have
        (the residual then stays as it was); :meth:`Packed.wait` reads it too.
        """
        if not isinstance(key, (str, int)) or isinstance(key, bool):
            raise TypeError(f"key must be a str or int, got {key!r}")
        check_instance("non_blocking", non_blocking, bool, what="True or False")
        if non_blocking and check_instance("commit", commit, bool, what="True or False"):
            raise ValueError("non_blocking=True needs commit=False: the residual moves at "
                             "commit(key), which reads the deferred check first")
        x = check_float_tensor(x, "x", INPUT_DTYPES)
        res = self._residuals.get(key)
        if res is None:
            res = torch.zeros(x.numel(), dtype=torch.float32, device=x.device)
        elif res.numel() != x.numel() or res.device != x.device:
            raise ValueError(
                f"key {key!r} holds a residual of {res.numel()} elements on {res.device}; "
                f"x has {x.numel()} on {x.device} (use another key or reset({key!r}))"
            )
        spare = self._spares.get(key)
        if spare is None:
            spare = torch.empty_like(res)
        # The residual and the spare are this object's own (float32, x's numel and device,
        # contiguous, apart): quantize's checks of x, error and error_out would re-prove them.
        spec = check_spec(spec)
        out = check_out(out, x, spec)
        packed = quantize_checked(x, spec, res, spare, resolve_seed(seed, spec), out,
                                   non_blocking)
        self._deferred.pop(key, None)
        if commit:
            self._residuals[key], self._spares[key] = spare, res
            self._pending.discard(key)
        else:  # the new residual waits in the spare
            self._residuals[key], self._spares[key] = res, spare
            self._pending.add(key)
            if non_blocking:
                self._deferred[key] = packed
        return packed

    def commit(self, key: str | int) -> None:
        """Make the residual computed by ``quantize(key, ..., commit=False)`` the current one
        (nothing when none is pending).

        Raises:
            NonFiniteError: the pending residual came from a ``non_blocking`` call whose input
                held NaN or Inf (read here, one host read); it is dropped, the residual stays.
        """
        if key in self._pending:
            deferred = self._deferred.pop(key, None)
            self._pending.discard(key)
            if deferred is not None:
                deferred.wait()
            self._residuals[key], self._spares[key] = self._spares[key], self._residuals[key]

    def reset(self, key: str | int | None = None) -> None:
        """Forget the residual of ``key`` (all keys when None)."""
        if key is None:
            self._residuals.clear()
            self._spares.clear()
            self._pending.clear()
            self._deferred.clear()
        else:
            self._residuals.pop(key, None)
            self._spares.pop(key, None)
            self._pending.discard(key)
            self._deferred.pop(key, None)

    def state_dict(self) -> dict[str, dict[str | int, torch.Tensor]]:
        """``{"residuals": {key: float32 tensor}}`` (references, like torch's state_dicts)."""
        return {"residuals": dict(self._residuals)}

    def load_state_dict(self, state: dict) -> None:
        """Load residuals saved by :meth:`state_dict` (copied; devices kept as saved)."""
        if not isinstance(state, dict) or not isinstance(state.get("residuals"), dict):
            raise ValueError("state must be a dict {'residuals': {key: tensor}} from state_dict()")
        loaded: dict[str | int, torch.Tensor] = {}
        for key, t in state["residuals"].items():
            if not isinstance(t, torch.Tensor) or t.dtype != torch.float32 or t.dim() != 1:
                raise ValueError(f"residual {key!r} must be a 1-D float32 tensor")
            loaded[key] = t.detach().clone()
        self._residuals = loaded
        self._spares = {}
        self._pending = set()
        self._deferred = {}
