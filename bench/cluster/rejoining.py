"""A lost node that comes back (``workload.py --join-at``): what differs from a one-world run.

The launch (``netns.sh launch --linked``): every node runs its own torchrun, whose world is the
node, and the nodes find each other through qcomm's rendezvous (``python -m qcomm.rendezvous``
in node 0's namespace); node K's torchrun may restart its ranks once. Each rank joins with
:func:`init_linked` (``qcomm.rendezvous.init_node``, the node's seat from ``QCB_NODE``).

Node K's ranks are killed at ``--kill-at`` (not its torchrun agent); the agent starts them
again, and the new ranks (:func:`restarted`) wait until ``--join-at`` of the timed window,
whose opening rank 0 publishes as wall-clock time (in :func:`window_file`), then build the
method, whose first step joins from the neighbours' state. Every rank records the wall-clock
end of each step; :func:`join_summary` turns those into what the join cost the running nodes
and how soon the joiner took part.

Pure Python and torch.distributed; imported by workload.py.
"""

from __future__ import annotations

import json
import os
import statistics
import time
from pathlib import Path
from typing import Any

if __package__ in (None, ""):
    import sys

    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from bench.cluster import methods as M

# The rate windows of join_summary, seconds: the running nodes' rate before an event is taken
# over this long, and the join's window lasts until this long after the joiner's first step.
RATE_WINDOW_S = 2.0
AFTER_FIRST_STEP_S = 1.0


def join_problem(method: str, kill_at: float | None, join_at: float,
                 seconds: bool) -> str | None:
    """What is wrong with ``--join-at`` for this run (the message names the flags), or None."""
    if kill_at is None:
        return "--join-at needs --kill-node and --kill-at: the lost node is the one that comes back"
    if not kill_at < join_at < 1:
        return (f"--join-at must be above --kill-at ({kill_at:g}) and below 1, "
                f"got {join_at:g}")
    if not (M.continues_after_loss(method) or M.recovers_by_itself(method)):
        return (f"--join-at: {method} has no way back for a lost node here; the wait-free "
                f"methods whose names end in -cont take it back live, ddp and localsgd restart "
                f"every worker from a checkpoint (torchrun's elastic restart), torchft's "
                f"(streaming) DiLoCo heals it from a live group (recovery.py)")
    if not seconds:
        return ("--join-at needs --time-budget in seconds: the node comes back at a time of "
                "the window")
    return None


def restarted() -> bool:
    """Whether this process is a rank its torchrun agent started again (the node came back)."""
    return int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")) > 0


def init_linked(timeout_s: float) -> tuple[Any, int]:
    """Join the job through the rendezvous (``QCOMM_RENDEZVOUS``) at the seat ``QCB_NODE``:
    torch.distributed's default group becomes this node's ranks. Returns (the
    ``qcomm.rendezvous.LinkedSeat``, the job's nodes from ``QCB_NODES``).

    Raises:
        ValueError: the launch did not set ``QCB_NODE`` / ``QCB_NODES`` (not ``--linked``).
    """
    from qcomm import rendezvous

    missing = [v for v in ("QCB_NODE", "QCB_NODES", rendezvous.ENV_VAR) if v not in os.environ]
    if missing:
        raise ValueError(f"--join-at and --links need the linked launch (netns.sh launch "
                         f"--linked), which sets {', '.join(missing)}; they are not set")
    seat = rendezvous.init_node(node_id=int(os.environ["QCB_NODE"]), timeout_s=timeout_s)
    return seat, int(os.environ["QCB_NODES"])


def open_window_together(timeout_s: float) -> None:
    """Healthy linked nodes (``--links gloo|sockets``): every rank of the job waits here for
    every other, through the rendezvous's store, as one torchrun world's barrier before the
    timed window would make them; without it each node opens its window when its own warm-up
    ends, and the first nodes train alone for the others' start.

    Raises:
        TimeoutError: a rank did not arrive within ``timeout_s``.
    """
    from qcomm import rendezvous

    seat = rendezvous.linked_seat()
    if seat is None:
        raise ValueError("open_window_together needs a seat taken by init_node (init_linked)")
    store, key = seat.store(), "qcb/window/arrived"
    store.add(key, 1)
    deadline = time.monotonic() + timeout_s
    while store.add(key, 0) < seat.world_size:
        if time.monotonic() > deadline:
            raise TimeoutError(f"the job's {seat.world_size} ranks did not all reach the timed "
                               f"window within {timeout_s:g} s")
        time.sleep(0.005)


def window_file(out: str) -> Path:
    """Where rank 0 writes ``{"time": <wall-clock opening of the timed window>}``."""
    return Path(f"{out}.window")


def recovery_files(out: str) -> dict[str, Path]:
    """What the lives of a peer's own recovery (recovery.py) share, beside ``out`` (the JSON):
    the folder of checkpoints, snapshots and life records (``dir``), the window's opening
    (:func:`window_file`), the time netns.sh starts the lost node's torchrun again
    (``rejoin``), the loss's marker (``killed``). compare.py removes them before a run: a
    window left by another run would make every life a later one."""
    d = Path(f"{out}.elastic")
    return {"dir": d, "ckpt": d / "checkpoint.pt", "snapshots": d / "snapshots",
            "lives": d / "lives", "lighthouse": d / "lighthouse.json", "window": window_file(out),
            "rejoin": Path(f"{out}.rejoin"), "killed": Path(f"{out}.killed")}


def wait_for_window(out: str, timeout_s: float) -> float:
    """The wall-clock time the timed window opened (published by rank 0), waited for.

    Raises:
        TimeoutError: nothing published within ``timeout_s``.
    """
    path = window_file(out)
    deadline = time.monotonic() + timeout_s
    while not path.exists():
        if time.monotonic() > deadline:
            raise TimeoutError(f"no window opening published in {path} within {timeout_s:g} s")
        time.sleep(0.05)
    return float(json.loads(path.read_text())["time"])


def perf_origin(wall: float) -> float:
    """The ``time.perf_counter()`` reading that corresponds to wall-clock time ``wall``: the
    returning ranks measure the window from the first ranks' opening."""
    return time.perf_counter() - (time.time() - wall)


def _rate(ends: list[float], lo: float, hi: float) -> float | None:
    if hi <= lo:
        return None
    return sum(lo <= t < hi for t in ends) / (hi - lo)


def join_summary(ranks: list[dict[str, Any]], kill_time: float | None,
                 join_node: int) -> dict[str, Any] | None:
    """What the join cost and when the joiner took part, from the ranks' records.

    The joiner's timeline (wall-clock, from its ranks' ``timeline``): its process started
    again, it took its seat, it began to build the method (whose setup announces the join to
    the running nodes, takes the state and links: the join), its first step started and ended.
    The running ranks' step rate in the join's window (from the build's start until
    :data:`AFTER_FIRST_STEP_S` after the first step's end) over their rate in the
    :data:`RATE_WINDOW_S` before the window (after the ring closed around the lost node) and
    before the kill. None when the joiner never took a step.
    """
    joiner = [r for r in ranks if r["node"] == join_node and r.get("timeline")]
    firsts = [r["timeline"].get("first_step_end") for r in joiner]
    if not joiner or any(t is None for t in firsts):
        return None
    start = min(r["timeline"]["process_start"] for r in joiner)
    seat = max(r["timeline"]["seat_taken"] for r in joiner)
    announced = min(r["timeline"]["build_start"] for r in joiner)
    first = max(firsts)
    lo, hi = announced, first + AFTER_FIRST_STEP_S
    during, vs_before, vs_kill = [], [], []
    for r in ranks:
        if r["node"] == join_node or not r.get("step_ends"):
            continue
        ends = r["step_ends"]
        rate = _rate(ends, lo, hi)
        before = _rate(ends, lo - RATE_WINDOW_S, lo)
        during.append(rate)
        if rate is not None and before:
            vs_before.append(rate / before)
        if kill_time is not None:
            pre_kill = _rate(ends, kill_time - RATE_WINDOW_S, kill_time)
            if rate is not None and pre_kill:
                vs_kill.append(rate / pre_kill)
    return {
        "restart_to_first_step_s": first - start,
        "restart_to_seat_s": seat - start,
        "seat_to_first_step_s": first - seat,
        "join_s": first - announced,
        "kill_to_first_step_s": None if kill_time is None else first - kill_time,
        "running_rate_during_join": during,
        "running_rate_vs_before_join": vs_before,
        "running_rate_vs_before_kill": vs_kill,
        "running_rate_vs_before_join_min": min(vs_before) if vs_before else None,
        "running_rate_vs_before_join_median":
            statistics.median(vs_before) if vs_before else None,
        # Where the running nodes stopped before the join (an elastic restart after the loss
        # has no rate before the join), against their rate before the loss.
        "running_rate_vs_before_kill_min": min(vs_kill) if vs_kill else None,
        "running_rate_vs_before_kill_median": statistics.median(vs_kill) if vs_kill else None,
        "join_window_s": hi - lo,
    }


if __name__ == "__main__":  # a library: say so rather than exit silently
    print("bench/cluster/rejoining.py is a library of the cluster benchmark (a lost node that "
          "comes back: workload.py --join-at), imported by workload.py and compare.py; it runs "
          "nothing. See bench/cluster/README.md.")
