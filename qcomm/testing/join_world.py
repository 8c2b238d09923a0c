"""One process of a wait-free gossip whose members come and go, for the join tests
(``tests/collectives/test_join_processes.py``) and the join benchmark (``bench/join_rate.py``): a
member over a :class:`~qcomm.collectives.gloo.pair_group.PairGroup` of the rendezvous at ``--port``
(``--transport sockets``: a :class:`~qcomm.collectives.sockets.SocketGroup` on a port of its own),
mixing a random vector (no local update; ``--step-s`` of sleep stands for the compute).

``--mode member``: ``--steps`` steps, then drain, settle and sum over the live members; with
``--join``
it joins the running job from a neighbour's state; with ``--cut-after-admit M`` its link to
member M breaks once M admitted a joiner between them, before this one does (M, run with
``--admit-after`` this member, holds its admit until this one saw the joiner). ``--mode host`` /
``visitor``: member 0 stays while member 1 comes and goes ``--cycles`` times in one process.
Each writes what it ends with to ``--out`` (a ``torch.save`` file).

    python -m qcomm.testing.join_world --member 1 --size 3 --port P --steps 600 \
        --out /tmp/m1.pt [--join]
"""

from __future__ import annotations

import argparse
import datetime
import io
import logging
import os
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

from qcomm.collectives.gloo.pair_group import PairGroup
from qcomm.collectives.gossip import WaitFreeGossip
from qcomm.collectives.gossip.joining import admit, join_state, offers_state, start_joined
from qcomm.collectives.gossip.one_peer_wait_free import OnePeerWaitFree
from qcomm.collectives.sockets import SocketGroup
from qcomm.compress import QuantSpec
from qcomm.rendezvous.joins import JoinWatcher, announce, await_state, offer_state
from qcomm.rendezvous.seat import claim_incarnation

NUMEL = 4096


def _state_bytes(x: torch.Tensor, g: WaitFreeGossip) -> bytes:
    buf = io.BytesIO()
    torch.save({"x": x, "gossip": join_state(g)}, buf)
    return buf.getvalue()


def _token() -> bytes | None:
    """The job token (QCOMM_TOKEN) a joiner's state is sealed with, or None."""
    token = os.environ.get("QCOMM_TOKEN")
    return token.encode() if token else None


def _gossip(args: argparse.Namespace, store: dist.Store) -> tuple[WaitFreeGossip, int]:
    incarnation = claim_incarnation(store, args.member)
    if args.transport == "sockets":   # one port of its own, the token from QCOMM_TOKEN
        # (QCOMM_LISTEN="": no port, behind a NAT, as a relay test's members)
        group: PairGroup = SocketGroup(f"127.0.0.1:{args.port}", args.member, args.size,
                                       timeout_s=20,
                                       listen=os.environ.get("QCOMM_LISTEN", "127.0.0.1:0"))
    else:
        # (a link is made within the silence bound: many processes on few cores are slow)
        group = PairGroup(f"127.0.0.1:{args.port}", args.member, args.size,
                          timeout_s=max(20.0, args.timeout_s))
    if args.graph == "one-peer-exp":   # the one-peer graph's own default gamma
        return OnePeerWaitFree(list(range(args.size)), group, args.numel, graph=args.graph,
                               spec=QuantSpec(4, 128, "stochastic"), fragments=2,
                               on_peer_loss="continue", timeout_s=args.timeout_s), incarnation
    g = WaitFreeGossip(list(range(args.size)), group, args.numel,
                       spec=QuantSpec(4, 128, "stochastic"), gamma=0.3, fragments=2,
                       on_peer_loss="continue", timeout_s=10)
    return g, incarnation


def _join(g: WaitFreeGossip, store: dist.Store, member: int, incarnation: int,
          events: dict[str, float] | None = None) -> tuple[torch.Tensor, int]:
    """Announce the join, take the state a running member offers, start from it (the wall
    times of both in ``events``)."""
    seq = announce(store, member, incarnation)
    if events is not None:
        events["announced"] = time.time()
    state = torch.load(io.BytesIO(await_state(store, seq, 30, token=_token())),
                       weights_only=True)
    start_joined(g, state["gossip"])
    if events is not None:
        events["started"] = time.time()
    logging.info("joined (join %d)", seq)
    return state["x"].clone(), seq


def _break_link_to(g: WaitFreeGossip, peer: int) -> None:
    """Break the connection of ``g``'s live link to member ``peer`` as a failure would (its
    group of two aborted, both ends running): the streams find it on their own."""
    k = g.membership.link_to(peer)
    g._streams._links[k].channel.close()   # the transport's own abort, reached from a test


def _step(g: WaitFreeGossip, x: torch.Tensor, watcher: JoinWatcher, store: dist.Store,
          member: int, step_s: float, cut: int | None = None,
          admit_after: int | None = None) -> None:
    """One step: admit the members that join (the one just below a joiner hands it its
    state), then a round. ``cut``: once member ``cut`` has admitted a joiner (and retired
    its link to this member), break that link and admit the joiner here at once (this
    member's retire never leaves: a failure before the retire exchange ends).
    ``admit_after``: admit a joiner only once member ``admit_after`` has seen it (that
    member, cutting, then takes no step until the cut: the retire sent to it stays unread)."""
    for seq, joiner, _ in watcher.new():
        if joiner == member:
            continue
        store.set(f"seen/{seq}/{member}", "1")
        if admit_after is not None:
            store.wait([f"seen/{seq}/{admit_after}"], datetime.timedelta(seconds=20))
        if cut is not None:
            store.wait([f"admitted/{seq}/{cut}"], datetime.timedelta(seconds=20))
            _break_link_to(g, cut)
        admit(g, joiner)
        store.set(f"admitted/{seq}/{member}", "1")
        if offers_state(g, joiner):   # the ring: its nearest live member below; one-peer:
            # each of its peers (the first offer is taken)
            offer_state(store, seq, _state_bytes(x, g), token=_token())
    g.prepare()
    g.end_step(x)
    time.sleep(step_s)


def member_args(member: int, size: int, port: int, steps: int, out: Path | str,
                *extra: str) -> list[str]:
    """:func:`main`'s options for member ``member`` of a join world of ``size`` members, its
    final tensor written to ``out``; ``extra``: more options (``--graph``, ``--step-s``, ...)."""
    return ["--member", str(member), "--size", str(size), "--port", str(port),
            "--steps", str(steps), "--out", str(out), *extra]


def member_command(member: int, size: int, port: int, steps: int, out: Path | str,
                   *extra: str) -> list[str]:
    """The command line that runs member ``member`` of a join world of ``size`` members as its
    own process (this module as a script), its final tensor written to ``out``; ``extra``: more
    of :func:`main`'s options (``--graph``, ``--transport``, ``--step-s``, ...)."""
    return [sys.executable, "-m", "qcomm.testing.join_world",
            *member_args(member, size, port, steps, out, *extra)]


def wait_progress(store: dist.Store, key: str, at_least: int, timeout_s: float = 120.0
                  ) -> None:
    """Wait until the count a member writes under ``key`` (its steps, every ten) reaches
    ``at_least``.

    Raises:
        TimeoutError: not within ``timeout_s``.
    """
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if store.check([key]) and int(store.get(key)) >= at_least:
            return
        time.sleep(0.02)
    raise TimeoutError(f"{key} did not reach {at_least} within {timeout_s:g} s")


def _resources() -> tuple[int, int]:
    """This process's OS threads and open file descriptors."""
    return len(os.listdir("/proc/self/task")), len(os.listdir("/proc/self/fd"))


def _settled_resources(first: tuple[int, int] | None) -> tuple[int, int]:
    """:func:`_resources` once a closed link's threads have left: after 0.5 s for the first
    visit (the count the others are held to); for a later one, as soon as the count is back
    to the first's, else what it is after 2 s (a thread or descriptor left behind)."""
    if first is None:
        time.sleep(0.5)
        return _resources()
    deadline = time.monotonic() + 2.0
    while (now := _resources()) != first and time.monotonic() < deadline:
        time.sleep(0.02)
    return now


def run_member(args: argparse.Namespace, store: dist.Store) -> None:
    """Mix for ``--steps`` steps (joining first with ``--join``), then drain, settle, sum."""
    events: dict[str, float] = {}
    g, incarnation = _gossip(args, store)
    x = torch.randn(args.numel, generator=torch.Generator().manual_seed(args.member))
    seen = 0
    if args.join:
        x, seen = _join(g, store, args.member, incarnation, events)
    elif args.start_together:   # every member's links made before anyone steps (and dies)
        g.wait_linked(300)
        store.add("started", 1)
        deadline = time.monotonic() + 300
        while int(store.add("started", 0)) < args.size and time.monotonic() < deadline:
            time.sleep(0.05)
    watcher = JoinWatcher("127.0.0.1", args.port, seen=seen, poll_s=0.05)
    times = []   # wall time at the end of each step
    while g.steps < args.steps:
        _step(g, x, watcher, store, args.member, args.step_s, args.cut_after_admit,
              args.admit_after)
        times.append(time.time())
        if g.steps % 10 == 0:
            store.set(f"progress/{args.member}/{incarnation}", str(g.steps))
    stepped_bytes = sum(g.stats.bytes_sent.values())   # the steps' (not the end's sum)
    g.drain()
    g.settle(x)
    total, live = g.survivors_sum(x)
    if g.time_varying:   # per link (its last, to a member that joined again), the peer's
        # messages applied
        peers = {p: link.received for p, link in sorted(g.links.items())}
    else:
        peers = sorted(g.peers[k] for k in g.membership.live_links())
    torch.save({"x": x, "sum": total, "live": live, "lost": sorted(g.lost),
                "losses": len(g.losses), "loss_detail": list(g.losses),
                "incarnation": incarnation, "times": times,
                "events": events, "first_step": g.steps - len(times), "peers": peers,
                "bytes_sent": stepped_bytes}, args.out)
    watcher.close()
    g.close()


def run_host(args: argparse.Namespace, store: dist.Store) -> None:
    """Member 0 of 2, which stays while member 1 comes and goes ``--cycles`` times: its
    threads and file descriptors each time a visit has left."""
    g, _ = _gossip(args, store)
    x = torch.randn(args.numel, generator=torch.Generator().manual_seed(0))
    watcher = JoinWatcher("127.0.0.1", args.port, poll_s=0.05)
    counts: dict[int, tuple[int, int]] = {}
    closed = 0
    deadline = time.monotonic() + 600
    while closed < args.cycles and time.monotonic() < deadline:
        _step(g, x, watcher, store, args.member, args.step_s)
        visits = int(store.add("visits", 0))
        if visits > closed and not g.membership.live_links():   # the visit left, link closed
            closed = visits
            counts[closed] = _settled_resources(counts.get(1))
            store.set(f"closed/{closed}", "1")
    torch.save({"counts": counts, "losses": len(g.losses), "steps": g.steps}, args.out)
    watcher.close()
    g.close()


def run_visitor(args: argparse.Namespace, store: dist.Store) -> None:
    """Member 1 of 2: ``--cycles`` visits in one process, each a new incarnation that joins
    (the first starts with the job), mixes ``--steps`` steps and leaves (``close()``)."""
    for visit in range(1, args.cycles + 1):
        g, incarnation = _gossip(args, store)
        x = torch.zeros(args.numel)
        if visit > 1:
            x, _ = _join(g, store, args.member, incarnation)
        for _ in range(args.steps):
            g.prepare()
            g.end_step(x)
            time.sleep(args.step_s)
        g.close()
        store.add("visits", 1)
        store.wait([f"closed/{visit}"])   # the host closed its link to this visit


def main(argv: list[str] | None = None) -> None:
    """Run one member as :func:`member_command`'s options (``argv``; None: the command line)
    say."""
    ap = argparse.ArgumentParser()
    ap.add_argument("--mode", choices=["member", "host", "visitor"], default="member")
    ap.add_argument("--member", type=int, required=True)
    ap.add_argument("--size", type=int, required=True)
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--steps", type=int, required=True)
    ap.add_argument("--out", default="")
    ap.add_argument("--join", action="store_true")
    ap.add_argument("--cycles", type=int, default=20)
    ap.add_argument("--step-s", type=float, default=0.01)
    ap.add_argument("--numel", type=int, default=NUMEL)
    ap.add_argument("--admit-after", type=int, default=None,
                    help="member that must have seen a joiner before this one admits it (the "
                         "one that cuts its link to this one, --cut-after-admit)")
    ap.add_argument("--cut-after-admit", type=int, default=None,
                    help="member whose link to this one breaks right after both admit a "
                         "joiner between them")
    ap.add_argument("--transport", choices=["pairs", "sockets"], default="pairs")
    ap.add_argument("--graph", choices=["ring", "one-peer-exp"], default="ring",
                    help="the gossip graph (one-peer-exp: OnePeerWaitFree)")
    ap.add_argument("--timeout-s", type=float, default=10.0,
                    help="the one-peer gossip's silence bound (many processes on few cores)")
    ap.add_argument("--start-together", action="store_true",
                    help="wait for every member's start before the first step")
    args = ap.parse_args(argv)
    # torch starts its intra-op pool threads lazily, at the first op that goes parallel: start
    # them now, so that a thread count measures this process, not when torch first needed one
    torch.ones(1 << 22).add_(1).sum()
    logging.basicConfig(level=logging.INFO,
                        format=f"[member {args.member}] %(relativeCreated)d ms %(message)s")
    store = dist.TCPStore("127.0.0.1", args.port, is_master=False,
                          timeout=datetime.timedelta(seconds=30))
    {"member": run_member, "host": run_host, "visitor": run_visitor}[args.mode](args, store)


def run_forked(argv: list[str], log: str) -> None:
    """:func:`main` in a process forked from a warm one (a ``forkserver`` that imported this
    module: no import of torch per member), its output to the file ``log``."""
    fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    main(argv)


if __name__ == "__main__":
    main()
