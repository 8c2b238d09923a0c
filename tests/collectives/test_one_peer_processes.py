"""Sixteen wait-free gossip members on the one-peer graph as processes on localhost, one
SIGKILLed and started again as a new process that joins the running ones
(:func:`qcomm.testing.one_peer_world.run`, what ``bench/one_peer_processes.py`` runs on more
steps): every process ends, every live member ends with one model, the joiner took the running
members' state, and each member sends one peer's message per step."""

from __future__ import annotations

from pathlib import Path

from qcomm.collectives.gossip.one_peer_links import message_nbytes
from qcomm.collectives.gossip.schedules import one_peer_peers
from qcomm.compress import QuantSpec, packed_nbytes
from qcomm.testing.one_peer_world import OnePeerRun, run

MEMBERS, KILL = 16, 5


def test_sixteen_processes_one_killed_and_one_joining_end_with_one_model(
        tmp_path: Path) -> None:
    """Members forked from one process that imported torch, each a process of its own (as 16
    fresh interpreters a like run of 600 steps took 3.4 minutes on 2 loaded cores, and the
    restarted member came after the others had ended). Every wait is bounded: a member that stalls
    fails the run within ``timeout_s`` and every process is killed. What holds:

    * every process, the restarted one included, exits 0;
    * the survivors' sum (the exact average's numerator) counts all 16 and is the same bits
      on every member: the one model they end with;
    * the members' own vectors agree to within 1e-2 of their start's spread (mixing works
      across the join; the sum alone would hold if nobody mixed);
    * the restarted member is incarnation 2 and started from a running member's state (at
      that member's step: kill_at or more); only the killed member's peers (its one-peer
      schedule's 4) may have seen a loss, and nobody counts anyone lost at the end;
    * every member's links carried its peer's messages, the joiner's peers' new links too;
    * each member sends at most one message per step (one peer; the static exponential
      graph's 16 members send 4)."""
    # 600 steps: the members start up to a few hundred steps apart on loaded cores (a fast one
    # runs on while a slow one makes its links), and the joiner needs a few hundred with all
    # of them to mix in (seen: 4e-8 of the start's spread with 480 left, 0.12 with 50); the
    # sleep leaves the cores to the slow ones
    config = OnePeerRun(members=MEMBERS, steps=600, step_s=0.01, numel=256, kill=KILL,
                        kill_at=30, rejoin_at=60, timeout_s=240.0, silence_s=20.0,
                        start="fork")
    out = run(config, tmp_path)   # raises, naming the members, if any exits non-zero or hangs
    rows = out["per_member"]
    assert out["survivors_sum_same_bits"]
    assert out["live_counted"] == [MEMBERS] * MEMBERS
    assert out["end_spread_over_start"] < 1e-2, out["end_spread_over_start"]

    peers_of_killed = set(one_peer_peers(KILL, MEMBERS))
    assert len(peers_of_killed) == 4
    assert [r["incarnation"] for r in rows] == [2 if i == KILL else 1 for i in range(MEMBERS)]
    first = out["joiner"]["first_step"]
    # the state of a member that had taken kill_at steps or more (every one had at the kill;
    # a member that starts afresh starts at 0), and the rest of the run from there
    assert config.kill_at <= first < config.steps, first
    assert rows[KILL]["steps_taken"] == config.steps - first
    # a peer that admitted the joiner before it noticed the death drops the old link unseen:
    # no loss; nobody else ever sees one
    assert all(r["losses"] <= (i in peers_of_killed) for i, r in enumerate(rows)), rows
    assert all(r["lost"] == [] for r in rows), [r["lost"] for r in rows]
    for i, r in enumerate(rows):
        assert set(r["links"]) == set(one_peer_peers(i, MEMBERS)), (i, r["links"])
        assert all(n > 0 for n in r["links"].values()), (i, r["links"])

    one_message = message_nbytes(packed_nbytes(config.numel // 2, QuantSpec(4, 128,
                                                                             "stochastic")))
    for r in rows:
        assert 0.5 * one_message < r["bytes_per_step"] <= one_message, (r, one_message)
