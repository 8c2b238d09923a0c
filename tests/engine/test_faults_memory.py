"""A peer that lies or disagrees, with ranks as threads: a named error on the ranks that must
stop, and nothing changed by the step that raised (parameters, optimizer and gossip state)."""

from __future__ import annotations

import copy

import pytest
import torch

from qcomm.collectives.errors import CorruptPayloadError, PeerError
from qcomm.collectives.gossip.integrity import SEAL_NBYTES, seal_
from qcomm.collectives.memory import MemoryWorld
from qcomm.collectives.topology import Topology
from qcomm.compress import QuantSpec
from qcomm.kernels.wire_format import split_payload
from qcomm.sgd import HierarchicalOptimizer
from tests.engine.problems import mlp, mlp_loss

SPEC = QuantSpec(4, 128, "stochastic")
LIAR, VICTIM, MATE = 2, 0, 1  # 2 x 2: rank 2 (node 1) sends to rank 0 (node 0) on rail 0


def _tamper(how: str, message: torch.Tensor, round_: int, sender: int, numel: int) -> None:
    """Damage one outgoing message (uint8 [nbytes + 8]) the way a faulty link or sender would."""
    body = message[:-SEAL_NBYTES]
    scales = split_payload(body, numel, SPEC)[1]
    if how == "flipped-byte":
        body[7] ^= 0x10
    elif how == "huge-scale":  # on the wire: the seal no longer matches
        scales[0] = 1e30
    elif how == "huge-scale-resealed":  # a sender that computes it: the size check refuses it
        scales[0] = 1e30
        seal_(message, round_, sender)
    elif how == "nan-scale-resealed":
        scales[0] = float("nan")
        seal_(message, round_, sender)
    elif how == "truncated":  # the tail never arrived: last round's bytes stay behind
        body[body.numel() // 2:] = 0
    else:
        raise ValueError(how)


def _snapshot(model: torch.nn.Module, opt: HierarchicalOptimizer) -> dict:
    """Everything a step may change. The gossip's buffers are read directly: its state_dict()
    would wait for rounds in flight, which a failed peer never sends."""
    runtime = opt.engine._runtime   # None before the first step
    g = None if runtime is None else runtime.gossip
    gossip = None if g is None else {
        "buffers": [g._hat_own, g._hat_pub, g._mix_acc, g._momentum],
        "counters": (g.rounds_started, g.rounds_applied),
        # Own message of each round in flight (the receive rows fill as messages arrive).
        "in_flight": [(r.round, r.payloads[0]) for r in g._in_flight],
    }
    return copy.deepcopy({
        "params": [p.detach() for p in model.parameters()],
        "optimizer": opt.optimizer.state_dict(),
        "gossip": gossip,
        "steps": opt.stats()["steps"],
    })


def _same(a: object, b: object) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.shape == b.shape and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b, strict=True))
    return a == b


BAD_MESSAGES = ["flipped-byte", "huge-scale", "huge-scale-resealed", "nan-scale-resealed",
                "truncated"]
REASONS = {"flipped-byte": "checksum", "huge-scale": "checksum", "truncated": "checksum",
           "huge-scale-resealed": "scale above 2**64", "nan-scale-resealed": "non-finite scale"}


def _run_with_a_bad_message(how: str) -> list[dict]:
    """2 nodes x 2 in memory; rank LIAR tampers with its round-3 message (``how``); every rank
    reports the error it stopped on, at which step, and whether that step changed anything."""
    world = MemoryWorld(4, timeout_s=30)
    bad_round = 3

    def body(rank: int) -> dict:
        model = mlp(0)
        layout = Topology(2, rank=rank, world_size=4, world=world)
        opt = HierarchicalOptimizer(torch.optim.AdamW(model.parameters(), lr=0.01),
                                    layout=layout, procs_per_node=2, timeout_s=2.0)
        for step in range(8):
            opt.zero_grad()
            mlp_loss(model, rank, step).backward()
            if step == 1 and rank == LIAR:
                gossip = opt.engine._runtime.gossip
                send = gossip.transport.exchange

                def tampered(round_, payload, recv, send=send, gossip=gossip):
                    if round_ == bad_round:
                        payload = payload.clone()
                        _tamper(how, payload, round_, gossip.member, gossip.fragment_numel)
                    return send(round_, payload, recv)

                gossip.transport.exchange = tampered
            before = _snapshot(model, opt)
            try:
                opt.step()
            except PeerError as e:
                return {"error": type(e).__name__, "peers": e.peers, "link": e.link,
                        "msg": str(e), "step": step,
                        "unchanged": _same(before, _snapshot(model, opt))}
        return {"error": None}

    return world.run(body)


@pytest.fixture(scope="module", params=BAD_MESSAGES)
def bad_message_run(request) -> tuple[str, list[dict]]:
    return request.param, _run_with_a_bad_message(request.param)


def test_a_bad_message_is_a_corrupt_payload_error_naming_the_sender_and_why(bad_message_run):
    how, res = bad_message_run
    victim = res[VICTIM]
    # Round 3 is started after step 3's update and applied (verified first) at step 4.
    assert victim["error"] == "CorruptPayloadError" and victim["step"] == 4, victim
    assert victim["peers"] == [LIAR] and victim["link"] == "inter"
    assert f"({REASONS[how]})" in victim["msg"]
    assert "nothing of this round was applied" in victim["msg"]


def test_the_victims_node_mate_fails_the_same_step_on_the_node_link(bad_message_run):
    _, res = bad_message_run
    mate = res[MATE]
    assert mate["error"] == "PeerError" and mate["step"] == 4 and mate["peers"] == [VICTIM]
    assert mate["link"] == "intra" and "nothing of this step was applied" in mate["msg"]


def test_a_bad_message_changes_nothing_on_the_node_that_got_it(bad_message_run):
    _, res = bad_message_run
    assert res[VICTIM]["unchanged"] and res[MATE]["unchanged"]


def test_the_other_node_stops_at_its_deadline_naming_the_silent_ranks(bad_message_run):
    _, res = bad_message_run
    # Node 1 never gets node 0's next round.
    for r in res[2:]:
        assert r["error"] == "PeerTimeoutError" and r["link"] == "inter", r
        assert r["peers"] == [0] or r["peers"] == [1]


def test_corrupt_payload_error_is_a_peer_error_and_a_value_error() -> None:
    err = CorruptPayloadError("gossip round 3", [2], "inter", "checksum")
    assert isinstance(err, PeerError) and isinstance(err, ValueError)
    assert "ranks [2] over the inter-node link" in str(err)


# ---------------------------------------------------------------------------------------------
# ranks that disagree: one ValueError on every rank at the first step, naming the field


@pytest.mark.parametrize(("field", "values", "shown"), [
    ("bits", (4, 8), "ranks [0, 1]: 4; ranks [2, 3]: 8"),
    ("block_size", (128, 256), "ranks [0, 1]: 128; ranks [2, 3]: 256"),
    ("staleness", (1, 2), "ranks [0, 1]: 1; ranks [2, 3]: 2"),
    ("gamma", (0.3, 0.45), "ranks [0, 1]: 0.3; ranks [2, 3]: 0.45"),
    ("graph", ("ring", "complete"), "ranks [0, 1]: 'ring'; ranks [2, 3]: 'complete'"),
    ("sync_every", (1, 2), "ranks [0, 1]: 1; ranks [2, 3]: 2"),
    ("intra_bits", (None, 8), "ranks [0, 1]: None; ranks [2, 3]: 8"),
    ("wait_free", (False, True), "ranks [0, 1]: False; ranks [2, 3]: True"),
    ("model", (8, 9), "communicated elements"),
])
def test_disagreeing_ranks_raise_valueerror_everywhere(field: str, values: tuple,
                                                       shown: str) -> None:
    world = MemoryWorld(4, timeout_s=30)

    def body(rank: int) -> str:
        value = values[rank // 2]
        if field == "model":
            model = torch.nn.Sequential(torch.nn.Linear(6, value), torch.nn.Linear(value, 2))
            comm = {}
        else:
            model = mlp(0)
            comm = {field: value}
        layout = Topology(2, rank=rank, world_size=4, world=world)
        opt = HierarchicalOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), layout=layout,
                                    procs_per_node=2, **comm)
        before = [p.detach().clone() for p in model.parameters()]
        model(torch.ones(3, 6)).sum().backward()
        try:
            opt.step()
        except ValueError as e:
            assert all(torch.equal(a, b) for a, b in
                       zip(before, model.parameters(), strict=True))
            return str(e)
        return "no error"

    msgs = world.run(body)
    assert len(set(msgs)) == 1, msgs  # the same error on every rank
    name = "communicated elements" if field == "model" else field
    assert msgs[0].startswith(f"ranks disagree on {name} ("), msgs[0]
    assert shown in msgs[0]
