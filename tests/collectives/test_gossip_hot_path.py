"""The gossip's rounds call the codec without its per-call checks (qcomm/collectives/gossip/
codec.py): what they rely on is checked once (at construction, at load_state_dict), a
non-finite value still never propagates, a round reads one flag per phase, and the unchecked
decode gives the checked one's bits."""

from __future__ import annotations

import sys
from typing import Any

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from qcomm.collectives.errors import CorruptPayloadError
from qcomm.collectives.gossip.codec import GossipCodec
from qcomm.collectives.gossip.integrity import SEAL_NBYTES, seal_
from qcomm.collectives.memory import GossipSimulator, WaitFreeSimulator
from qcomm.compress import NonFiniteError, QuantSpec, dequant_accumulate, quantize
from qcomm.kernels.wire_format import split_payload

NUMEL = 512
SPEC = QuantSpec(4, 128, "stochastic")
BAD = [float("nan"), float("inf"), -float("inf")]


def _xs(n: int, seed: int = 0) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(NUMEL, generator=g) for _ in range(n)]


def _choco_state(sim: GossipSimulator, i: int) -> list:
    """What a round may change of member i (of the rounds in flight, the own message: the
    neighbours' rows fill as they arrive)."""
    m = sim.members[i]
    return [m.rounds_started, m.rounds_applied, m._hat_own.clone(), m._hat_pub.clone(),
            m._mix_acc.clone(), [(r.round, r.payloads[0].clone()) for r in m._in_flight]]


def _same(a: list, b: list) -> bool:
    return repr(a) == repr(b) and all(
        torch.equal(x, y) for x, y in zip(_tensors(a), _tensors(b), strict=True))


def _tensors(v: Any) -> list[torch.Tensor]:
    if isinstance(v, torch.Tensor):
        return [v]
    if isinstance(v, (list, tuple)):
        return [t for x in v for t in _tensors(x)]
    return []


# ---------------------------------------------------------------------------------------------
# a non-finite x: NonFiniteError before anything is sent or changed


@pytest.mark.parametrize("bad", BAD)
def test_compressed_gossip_refuses_a_nonfinite_x_and_the_run_goes_on_as_if_never_tried(
        bad: float) -> None:
    kw = dict(spec=SPEC, staleness=1, seed=5)
    ref, xs = _xs(3), _xs(3)
    clean, tried = GossipSimulator(3, NUMEL, **kw), GossipSimulator(3, NUMEL, **kw)
    for _ in range(3):
        clean.step(ref)
        tried.step(xs)
    m = tried.members[0]
    sent = []
    exchange = m.transport.exchange
    m.transport.exchange = lambda *a: sent.append(a[0]) or exchange(*a)
    before = _choco_state(tried, 0)
    poisoned = xs[0].clone()
    poisoned[200] = bad
    with pytest.raises(NonFiniteError) as info:
        m.step(poisoned)
    assert info.value.argument == "x" and info.value.blocks == [200 // 128]
    assert sent == [] and _same(_choco_state(tried, 0), before)
    # Nothing half-done: the run continues with the very bits of one that never saw it.
    for _ in range(4):
        clean.step(ref)
        tried.step(xs)
    assert all(torch.equal(a, b) for a, b in zip(xs, ref, strict=True))
    assert sent == [3, 4, 5, 6]


@pytest.mark.parametrize("bad", BAD)
def test_wait_free_gossip_refuses_a_nonfinite_x_before_sending(bad: float) -> None:
    sim = WaitFreeSimulator(2, NUMEL, spec=SPEC)
    xs = _xs(2)
    sim.run(xs, 2)
    m = sim.members[0]
    own, owed = m._hat_own.clone(), m._ledger.owed.clone()
    before = (m.steps, m.rounds_started, len(m._ledger.own_sent))
    poisoned = xs[0].clone()
    poisoned[3] = bad
    with pytest.raises(NonFiniteError) as info:
        m.end_step(poisoned)
    assert info.value.argument == "x"
    assert sim.boxes.pending(0, 1) == 0
    assert torch.equal(m._hat_own, own) and torch.equal(m._ledger.owed, owed)
    assert (m.steps, m.rounds_started, len(m._ledger.own_sent)) == before
    sim.run(xs, 2)  # and the next rounds run
    assert m.rounds_started == before[1] + 2


# ---------------------------------------------------------------------------------------------
# a NaN/Inf payload from a peer: refused at verification, nothing applied


def _poison_scale(message: torch.Tensor, value: float, round_: int, sender: int) -> None:
    """Set a scale of a message (uint8 [nbytes + 8]) and reseal it: a sender that computed
    it, not a damaged link (the checksum alone would not catch it)."""
    split_payload(message[:-SEAL_NBYTES], NUMEL, SPEC)[1][1] = value
    seal_(message, round_, sender)


@pytest.mark.parametrize("bad", BAD)
def test_compressed_gossip_refuses_a_resealed_nonfinite_payload(bad: float) -> None:
    sim = GossipSimulator(2, NUMEL, spec=SPEC, staleness=0)
    xs = _xs(2)
    sim.step(xs)
    liar, victim = sim.members[1], sim.members[0]
    exchange = liar.transport.exchange

    def tampered(round_: int, payload: torch.Tensor, recv: torch.Tensor) -> Any:
        payload = payload.clone()
        _poison_scale(payload, bad, round_, liar.member)
        return exchange(round_, payload, recv)

    liar.transport.exchange = tampered
    victim.begin(xs[0])
    liar.begin(xs[1])
    before, x0 = _choco_state(sim, 0), xs[0].clone()
    with pytest.raises(CorruptPayloadError, match="non-finite scale") as info:
        victim.finish(xs[0])
    assert info.value.peers == [1]
    assert _same(_choco_state(sim, 0), before) and torch.equal(xs[0], x0)


@pytest.mark.parametrize("bad", BAD)
def test_wait_free_gossip_refuses_a_resealed_nonfinite_message(bad: float) -> None:
    sim = WaitFreeSimulator(2, NUMEL, spec=SPEC)
    xs = _xs(2)
    sim.run(xs, 3)
    m1 = sim.members[1]
    copies, received = m1._links.copies.clone(), list(m1.received)
    sim.members[0].prepare()
    sim.members[0].end_step(xs[0])
    message = sim.boxes._queue(0, 1)[-1][1]
    _poison_scale(message, bad, sim.members[0].rounds_started - 1, 0)
    sim.now += 1
    with pytest.raises(CorruptPayloadError, match="non-finite scale") as info:
        m1.prepare()
    assert info.value.peers == [0]
    assert torch.equal(m1._links.copies, copies) and m1.received == received


def test_an_own_message_with_a_scale_above_2_64_is_decoded_with_the_checks() -> None:
    """A finite x so large that the neighbours refuse its message ("scale above 2**64"):
    the sender's own copy takes the checking decode, and holds what the message decodes to."""
    from qcomm.compress import Packed, dequantize

    sim = GossipSimulator(2, NUMEL, spec=SPEC, staleness=0)
    xs = [x * 1e25 for x in _xs(2)]
    sent = []
    exchange = sim.members[0].transport.exchange
    sim.members[0].transport.exchange = lambda r, p, recv: sent.append(p.clone()) or \
        exchange(r, p, recv)
    sim.members[0].begin(xs[0])
    own = dequantize(Packed.from_payload(sent[0][:-SEAL_NBYTES], NUMEL, SPEC))
    assert torch.equal(sim.members[0]._hat_own, own)
    assert not sim.members[0]._in_flight[0].own_bounded
    sim.members[1].begin(xs[1])
    with pytest.raises(CorruptPayloadError, match=r"scale above 2\*\*64"):
        sim.members[1].finish(xs[1])


# ---------------------------------------------------------------------------------------------
# the unchecked decode is the checked one, bit for bit


@pytest.mark.parametrize("bits", [1, 2, 4, 8])
def test_the_unchecked_decode_gives_the_checked_bits(bits: int) -> None:
    spec = QuantSpec(bits, 128, "stochastic")
    codec = GossipCodec(spec, NUMEL)
    payloads = torch.stack([quantize(x, spec, seed=k).payload
                            for k, x in enumerate(_xs(3, seed=1))])
    weights = torch.tensor([0.5, 0.25, 0.25])
    base = _xs(1, seed=2)[0]
    want, got = base.clone(), base.clone()
    dequant_accumulate(payloads, want, spec, weights)
    codec.accumulate(payloads, got, weights)
    assert torch.equal(got, want)
    want1, got1 = base.clone(), base.clone()
    dequant_accumulate(payloads[0], want1, spec)
    codec.accumulate(payloads[0], got1)
    assert torch.equal(got1, want1)


def test_encode_reports_a_large_scale_and_raises_on_a_nonfinite_one() -> None:
    codec = GossipCodec(SPEC, NUMEL)
    out = torch.empty(codec.nbytes, dtype=torch.uint8)
    assert codec.encode(_xs(1)[0], out, seed=1)
    assert torch.equal(out, quantize(_xs(1)[0], SPEC, seed=1).payload)
    assert not codec.encode(_xs(1)[0] * 1e25, out, seed=1)
    x = _xs(1)[0]
    x[0] = float("nan")
    with pytest.raises(NonFiniteError):
        codec.encode(x, out, seed=1)


# ---------------------------------------------------------------------------------------------
# bad arguments at setup: refused there, naming the argument


@pytest.mark.parametrize(("args", "error", "match"), [
    (("not a spec", NUMEL), TypeError, "spec"),
    ((SPEC, 0), ValueError, "numel"),
    ((SPEC, 2.5), TypeError, "numel"),
])
def test_a_bad_codec_argument_is_refused_naming_it(args: tuple, error: type,
                                                   match: str) -> None:
    with pytest.raises(error, match=match):
        GossipCodec(*args)


def _choco_saved() -> dict:
    sim = GossipSimulator(2, NUMEL, spec=SPEC, staleness=1)
    xs = _xs(2)
    for _ in range(3):
        sim.step(xs)
    return sim.members[0].state_dict()


@pytest.mark.parametrize(("change", "error", "match"), [
    ({"hat_own": torch.zeros(NUMEL + 1)}, ValueError, r"state\['hat_own'\] must have shape"),
    ({"hat_pub": torch.zeros(NUMEL, dtype=torch.float64)}, TypeError,
     r"state\['hat_pub'\] must have dtype float32"),
    ({"mix_acc": None}, ValueError, r"state\['mix_acc'\] is None"),
    ({"mix_acc": torch.zeros(NUMEL, device="meta")}, ValueError,
     r"state\['mix_acc'\] must be on cpu"),
    ({"hat_own": [0.0] * NUMEL}, TypeError, r"state\['hat_own'\] must be a torch.Tensor"),
    ({"in_flight": [(2, torch.zeros(2, 8, dtype=torch.uint8))]}, ValueError,
     "a saved round holds messages of shape"),
    ({"in_flight": [(2, torch.zeros(2, 8))]}, TypeError, r"state\['in_flight'\]"),
])
def test_a_bad_saved_compressed_gossip_state_is_refused_naming_it_and_nothing_loaded(
        change: dict, error: type, match: str) -> None:
    state = {**_choco_saved(), **change}
    fresh = GossipSimulator(2, NUMEL, spec=SPEC, staleness=1).members[0]
    with pytest.raises(error, match=match):
        fresh.load_state_dict(state)
    assert fresh.rounds_started == 0 and fresh._hat_own is None and not fresh._in_flight


def _wait_free_saved() -> dict:
    sim = WaitFreeSimulator(2, NUMEL, spec=SPEC, staleness=2)
    xs = _xs(2)
    sim.run(xs, 4)
    sim.drain()
    state = sim.members[0].state_dict()
    assert state["owed"] is not None and state["hat_own"] is not None
    return state


@pytest.mark.parametrize(("change", "error", "match"), [
    ({"copies": torch.zeros(2, NUMEL)}, ValueError, r"state\['copies'\] must have shape"),
    ({"owed": torch.zeros(NUMEL, dtype=torch.float16)}, TypeError,
     r"state\['owed'\] must have dtype float32"),
    ({"hat_own": None}, ValueError, r"state\['hat_own'\] is None"),
    ({"owed": torch.zeros(NUMEL + 1)}, ValueError, r"state\['owed'\] must have shape"),
])
def test_a_bad_saved_wait_free_state_is_refused_naming_it_and_nothing_loaded(
        change: dict, error: type, match: str) -> None:
    state = {**_wait_free_saved(), **change}
    sim = WaitFreeSimulator(2, NUMEL, spec=SPEC, staleness=2)
    fresh = sim.members[0]
    with pytest.raises(error, match=match):
        fresh.load_state_dict(state)
    assert fresh.rounds_started == 0 and fresh._hat_own is None and fresh._ledger.owed is None


# ---------------------------------------------------------------------------------------------
# host reads: one flag per phase of a round


class _GossipReads(TorchDispatchMode):
    """Counts host reads (``item``/``bool``/``float``/``int`` of a tensor, and ``tolist``)
    made outside the codec's kernels (the CPU reference reads a flag per chunk of its own;
    the Triton kernels read none)."""

    def __init__(self) -> None:
        super().__init__()
        self.count = 0
        self._tolist = torch.Tensor.tolist

    def _note(self) -> None:
        frame = sys._getframe(2)
        while frame is not None:
            if "qcomm/kernels/" in frame.f_code.co_filename.replace("\\", "/"):
                return
            frame = frame.f_back
        self.count += 1

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (),
                           kwargs: dict | None = None) -> Any:
        if func is torch.ops.aten._local_scalar_dense.default:
            self._note()
        return func(*args, **(kwargs or {}))

    def __enter__(self) -> _GossipReads:
        tolist = self._tolist

        def counted(t: torch.Tensor) -> Any:
            self._note()
            return tolist(t)

        torch.Tensor.tolist = counted  # type: ignore[method-assign]
        return super().__enter__()

    def __exit__(self, *exc: object) -> None:
        super().__exit__(*exc)
        torch.Tensor.tolist = self._tolist  # type: ignore[method-assign]


@pytest.mark.parametrize("fragments", [1, 2])
def test_a_compressed_gossip_round_reads_two_flags(fragments: int) -> None:
    """One when the own message is encoded (finite and bounded), one when the round's
    received messages are verified; the decodes read nothing."""
    sim = GossipSimulator(4, NUMEL, spec=SPEC, staleness=1, fragments=fragments)
    xs = _xs(4)
    for _ in range(3):
        sim.step(xs)
    with _GossipReads() as reads:
        for _ in range(4):
            sim.step(xs)
    assert reads.count == 2 * 4 * 4


def test_a_wait_free_round_reads_two_flags() -> None:
    """One when the own message is encoded, one when every message waiting from every
    neighbour is verified (two neighbours here, one message each)."""
    sim = WaitFreeSimulator(4, NUMEL, spec=SPEC, staleness=1)
    xs = _xs(4)
    sim.run(xs, 3)
    with _GossipReads() as reads:
        sim.run(xs, 4)
    assert reads.count == 2 * 4 * 4
