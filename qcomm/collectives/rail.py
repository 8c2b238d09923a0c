"""The slow step of the hierarchical allreduce: one shard averaged over the nodes of a rail,
through the codec, in one of two forms.

Every node k holds ``v_k`` (its node mean of the shard, ``s`` float32 elements); the rail must
end with the same approximation of ``(1/N) sum_k v_k`` on every node. ``P`` is the payload of
the whole shard, ``packed_nbytes(s, spec)``.

* **all-gather** (one stage): node k quantizes ``v_k + e_k`` (error feedback, residual ``e_k``),
  the N payloads are all-gathered and every node decodes their mean. A node sends
  ``(N - 1) P`` bytes: it grows with N.
* **reduce-scatter + all-gather** (two stages): the shard is cut into N block-aligned chunks
  (a chunk's payload is a slice of the shard's). Node k quantizes ``v_k + e_k`` once and sends
  chunk j's payload to node j (an all-to-all); node j, the chunk's owner, decodes the N payloads
  into their mean ``m_j``, quantizes ``m_j + f_j`` with its own residual ``f_j`` and all-gathers
  that payload; every node decodes the N chunk payloads. A node sends ``2 (N - 1) / N * P``
  bytes, at most ``2 P`` whatever N; at N = 2 the all-gather stays (same bytes, one round trip
  and one rounding fewer).

Error feedback at both stages: the running sum of results tracks the running sum of exact means
within ``(1/N) sum_k |e_k| + |f_j|``. Non-finite input fails every node of the rail the same
way and changes no residual: each stage quantizes with ``commit=False`` and the caller commits
the residuals only after the whole operation succeeded.

In full (each stage, the accuracy of the two-stage form, how a NaN travels): docs/design.md,
section "The rail's two forms".
"""

from __future__ import annotations

from collections.abc import Generator
from typing import Any

import torch

from qcomm.collectives.group import CommGroup
from qcomm.collectives.handles import Last
from qcomm.collectives.primitives import (
    all_to_all_single,
    decode_mean,
    quantize_or_poison,
    start_all_gather,
)
from qcomm.collectives.stats import CommStats
from qcomm.compress import ErrorFeedback, NonFiniteError, QuantSpec, packed_nbytes
from qcomm.kernels.wire_format import codes_nbytes, num_blocks
from qcomm.seeds import derive
from qcomm.validation import check_choice

__all__ = ["RAIL_COLLECTIVES", "check_rail_collective", "chunk_payloads", "join_payloads",
           "rail_form", "rail_mean"]

RAIL_COLLECTIVES = ("auto", "all_gather", "reduce_scatter")

# The smallest node count at which "auto" takes the two-stage form: from 3 nodes on it sends
# fewer bytes (2 (N-1)/N < N-1); at 2 it sends the same bytes in two round trips.
REDUCE_SCATTER_FROM_NODES = 3

# Stage-2 payloads get their own stochastic-rounding stream (stage 1 uses the message seed).
_OWNER_STREAM = 0x0A3E


def check_rail_collective(rail_collective: object) -> str:
    """``rail_collective`` if it is one of :data:`RAIL_COLLECTIVES`, else ValueError."""
    return check_choice("rail_collective", rail_collective, RAIL_COLLECTIVES)  # type: ignore


def rail_form(rail_collective: str, num_nodes: int) -> str:
    """The form a rail of ``num_nodes`` nodes runs: ``"all_gather"`` or ``"reduce_scatter"``
    (``"auto"``: the reduce-scatter from :data:`REDUCE_SCATTER_FROM_NODES` nodes on)."""
    if rail_collective == "auto":
        return "reduce_scatter" if num_nodes >= REDUCE_SCATTER_FROM_NODES else "all_gather"
    return rail_collective


def _chunk_layout(numel: int, parts: int, spec: QuantSpec) -> tuple[int, int]:
    """(code bytes, scales) of one of ``parts`` chunks of a ``numel``-element shard; the chunks
    must be whole blocks (then their codes are whole 4-byte words: a block holds 32 or more
    elements of at least one bit)."""
    c = numel // parts
    if c * parts != numel or c % spec.block_size:
        raise ValueError(f"a shard of {numel} elements does not split into {parts} chunks of "
                         f"whole {spec.block_size}-element blocks")
    return codes_nbytes(c, spec), num_blocks(c, spec)


def chunk_payloads(payload: torch.Tensor, numel: int, parts: int, spec: QuantSpec,
                   out: torch.Tensor) -> torch.Tensor:
    """Cut the payload of a ``numel``-element shard into the payloads of its ``parts`` chunks.

    Args:
        payload: uint8 ``[packed_nbytes(numel, spec)]``.
        numel: a multiple of ``parts * spec.block_size``.
        out: uint8 ``[parts, packed_nbytes(numel // parts, spec)]``, written.

    Returns:
        ``out``: row j is exactly what quantizing chunk j alone would give (blocks are
        independent), apart from the stochastic-rounding stream.
    """
    cb, nb = _chunk_layout(numel, parts, spec)
    codes_end = parts * cb
    out[:, :cb].copy_(payload[:codes_end].view(parts, cb))
    out[:, cb:].copy_(payload[codes_end:].view(parts, 4 * nb))
    return out


def join_payloads(rows: torch.Tensor, numel: int, spec: QuantSpec,
                  out: torch.Tensor) -> torch.Tensor:
    """The inverse of :func:`chunk_payloads`: ``parts`` chunk payloads (uint8 ``[parts,
    packed_nbytes(numel // parts, spec)]``) joined into the shard's payload ``out`` (uint8
    ``[packed_nbytes(numel, spec)]``)."""
    parts = rows.shape[0]
    cb, nb = _chunk_layout(numel, parts, spec)
    codes_end = parts * cb
    out[:codes_end].view(parts, cb).copy_(rows[:, :cb])
    out[codes_end:].view(parts, 4 * nb).copy_(rows[:, cb:])
    return out


RailStep = Generator[Any, None, tuple[torch.Tensor, NonFiniteError | None, list[str]]]


def rail_mean(form: str, shard: torch.Tensor, ef: ErrorFeedback, key: str, spec: QuantSpec,
              seed: int, rail: CommGroup, num_nodes: int, stats: CommStats, last: bool
              ) -> RailStep:
    """A pipeline segment: average ``shard`` over the rail in ``form``.

    Args:
        form: ``"all_gather"`` or ``"reduce_scatter"`` (see :func:`rail_form`).
        shard: float32 ``[s]``, this node's mean of the shard; ``s`` a multiple of
            ``spec.block_size`` (all-gather) or of ``num_nodes * spec.block_size``
            (reduce-scatter).
        ef: where the residuals live: ``key`` (``s`` elements, both forms) and, for the
            reduce-scatter, ``key + "/owner"`` (``s / num_nodes`` elements, the chunk this node
            owns).
        seed: the message seed of this shard (stage 2 derives its own from it).
        rail: the rail's group (resolved); ``stats`` counts ``"inter"``.
        last: whether this is the pipeline's last communication (its final work is then
            yielded as :class:`Last`).

    Yields the works to wait for; returns (float32 ``[s]`` mean, the first NonFiniteError met
    or None: the mean is then NaN where it could not be decoded, the residual keys to
    ``ef.commit`` once the caller knows the whole operation succeeded: until then every
    residual is as before the call).
    """
    s, device = shard.numel(), shard.device
    nbytes = packed_nbytes(s, spec)
    payload = torch.empty(nbytes, dtype=torch.uint8, device=device)
    # Residuals change only once the whole mean succeeded (the caller commits them): every
    # member of the rail decodes the same payloads, so all of them commit or none does.
    quantize_or_poison(ef, key, shard, spec, seed, payload)
    N = num_nodes
    if form == "all_gather":
        gathered = torch.empty(N, nbytes, dtype=torch.uint8, device=device)
        work = start_all_gather(gathered.view(-1), payload, rail, N, stats, "inter")
        yield Last(work) if last else work
        mean = torch.zeros(s, dtype=torch.float32, device=device)
        return mean, decode_mean(gathered, mean, spec), [key]

    c = s // N
    cn = packed_nbytes(c, spec)
    # Stage 1: chunk j of every node's payload to node j.
    send = chunk_payloads(payload, s, N, spec,
                          torch.empty(N, cn, dtype=torch.uint8, device=device))
    received = torch.empty_like(send)
    stats.record("inter", (N - 1) * cn, N - 1)
    yield all_to_all_single(received.view(-1), send.view(-1), rail, async_op=True, link="inter",
                            operation="inter-node reduce-scatter")
    owned = torch.zeros(c, dtype=torch.float32, device=device)
    error = decode_mean(received, owned, spec)
    # Stage 2: the owner's mean, re-quantized with its own residual, to every node.
    mine = torch.empty(cn, dtype=torch.uint8, device=device)
    quantize_or_poison(ef, f"{key}/owner", owned, spec, derive(seed, _OWNER_STREAM), mine)
    chunks = torch.empty(N, cn, dtype=torch.uint8, device=device)
    work = start_all_gather(chunks.view(-1), mine, rail, N, stats, "inter")
    yield Last(work) if last else work
    joined = join_payloads(chunks, s, spec, payload)  # the stage-1 buffer is free again
    mean = torch.zeros(s, dtype=torch.float32, device=device)
    return (mean, decode_mean(joined.view(1, nbytes), mean, spec) or error,
            [key, f"{key}/owner"])
