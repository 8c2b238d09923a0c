"""What qcomm is for: the same training with qcomm and with synchronous fp32 averaging, and what
each would cost on a slow link between the nodes. MNIST-1D, 2 emulated nodes x 2 processes.

    python examples/train_mnist1d.py [--epochs 60] [--hidden 1024] [--bits 4] [--lr 0.2]
                                     [--optimizers sgd,adamw] [--emulated-link 100mbit]

Starts 4 local processes over Gloo (ranks 0-1 are node 0, ranks 2-3 node 1), generates MNIST-1D
locally (``mnist1d.data.make_dataset``; nothing is downloaded), and trains one 1-D CNN (with a
``--hidden``-unit layer in its head, 143,224 parameters at the default) once per method, from
the same seed, with the same data order, epochs and hyperparameters; the methods take turns,
an epoch each, so that other work on the machine slows them alike:

* ASSGD: gradients averaged inside each node in fp32, local SGD step, then asynchronous CHOCO
  gossip of ``--bits``-bit parameter differences between the nodes (sharded over the two local
  ranks, so each "NIC" carries half);
* synchronous fp32 SGD: ``HierarchicalAllreduce`` of the gradients at full precision
  (intra-node reduce-scatter, rail allreduce of each local rank's shard between nodes,
  intra-node all-gather), then ``torch.optim.SGD``;
* the same pair with AdamW: ``HierarchicalOptimizer(torch.optim.AdamW(...))`` (the same
  communication as ASSGD around AdamW's own update) against synchronous fp32 AdamW.

Prints, per method, the final test accuracy (qcomm: of the exact global average of the nodes'
parameters, and of node 0's own parameters) and the bytes that crossed between nodes; then, per
training step, the bytes the busiest node sent to the other node and the step time measured
here. Here the "nodes" are joined by loopback, which costs no link time, so qcomm's saving
cannot show in these times: a PROJECTION (labelled so: computed, not measured) adds what the
link would, ``bytes / rate``, at 100 Mbit/s and 1 Gbit/s, and a closing verdict says, from
these numbers, which method would finish first at which rate and why.

``--emulated-link RATE`` (e.g. ``100mbit``; root only, with ``ip netns`` and ``tc``) measures
instead of projecting: the same training runs in the emulated cluster of ``bench/cluster``
(``netns.sh``: one network namespace per node, the link between them rate-limited with tc),
and the verdict is drawn from the times measured there.
"""

from __future__ import annotations

import argparse
import datetime
import math
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
# The repository root last (bench.progress), so an installed qcomm is not shadowed.
sys.path.append(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from mnist1d_model import ConvNet, accuracy, make_mnist1d

import qcomm
from bench.progress import progress
from qcomm.collectives.hierarchical import HierarchicalAllreduce
from qcomm.collectives.stats import CommStats
from qcomm.collectives.topology import Topology
from qcomm.sgd import ASSGD, HierarchicalOptimizer
from qcomm.testing.multiprocess import run_world
from qcomm.validation import did_you_mean

REPO = Path(__file__).resolve().parents[1]
NETNS = REPO / "bench" / "cluster" / "netns.sh"
# The link rates the projection is drawn for: a slow link between sites (100 Mbit/s) and a
# common datacenter Ethernet port (1 Gbit/s).
PROJECTED_RATES = (100e6, 1e9)
LABELS = {"assgd": "ASSGD", "sgd": "synchronous fp32 SGD",
          "adamw-qcomm": "qcomm AdamW", "adamw": "synchronous fp32 AdamW"}


@dataclass(frozen=True)
class Config:
    nodes: int = 2
    procs_per_node: int = 2
    epochs: int = 60
    batch_size: int = 32          # per rank
    hidden: int = 1024            # units of the head's hidden layer (0: linear head)
    lr: float = 0.2
    momentum: float = 0.9
    weight_decay: float = 0.0
    bits: int = 4
    staleness: int = 1
    seed: int = 0
    num_samples: int = 5000
    optimizers: str = "sgd,adamw"   # which pairs to run
    adamw_lr: float = 0.003
    adamw_weight_decay: float = 0.01

    def pairs(self) -> list[tuple[str, str]]:
        """(qcomm method, synchronous baseline) per optimizer asked for."""
        table = {"sgd": ("assgd", "sgd"), "adamw": ("adamw-qcomm", "adamw")}
        names = [n.strip() for n in self.optimizers.split(",") if n.strip()]
        unknown = [n for n in names if n not in table]
        if unknown or not names:
            hint = did_you_mean(unknown[0], table) if unknown else ""
            raise ValueError(f"optimizers must be a comma list of {sorted(table)}, "
                             f"got {self.optimizers!r}{hint}")
        return [table[n] for n in names]


# ---------------------------------------------------------------------------------------------
# training (one rank)


def _batches(n: int, epoch: int, cfg: Config, rank: int, world: int) -> list[torch.Tensor]:
    """This rank's mini-batches of one epoch: a seeded permutation dealt round-robin."""
    perm = torch.randperm(n, generator=torch.Generator().manual_seed(cfg.seed * 1000 + epoch))
    mine = perm[rank::world]
    steps = len(mine) // cfg.batch_size
    return [mine[i * cfg.batch_size:(i + 1) * cfg.batch_size] for i in range(steps)]


class _Method:
    """One method on this rank: its model, optimizer and communication, trained an epoch at a
    time so that the methods can take turns (see :func:`_worker`)."""

    def __init__(self, method: str, rank: int, world: int, cfg: Config, data: dict) -> None:
        self.name, self.rank, self.world, self.cfg, self.data = method, rank, world, cfg, data
        torch.manual_seed(cfg.seed)
        self.model = model = ConvNet(hidden=cfg.hidden)
        comm = dict(bits=cfg.bits, staleness=cfg.staleness, procs_per_node=cfg.procs_per_node,
                    seed=cfg.seed)
        self.stats = CommStats()
        self.averager = None
        self.qcomm = method in ("assgd", "adamw-qcomm")
        opt: torch.optim.Optimizer
        if method.startswith("adamw"):
            max_lr = cfg.adamw_lr
            opt = torch.optim.AdamW(model.parameters(), lr=max_lr,
                                    weight_decay=cfg.adamw_weight_decay)
            if self.qcomm:
                opt = HierarchicalOptimizer(opt, **comm)
        else:
            max_lr = cfg.lr
            hp = dict(lr=cfg.lr, momentum=cfg.momentum, weight_decay=cfg.weight_decay)
            opt = (ASSGD(model.parameters(), **hp, **comm) if self.qcomm
                   else torch.optim.SGD(model.parameters(), **hp))
        self.opt = opt
        if self.qcomm:
            opt.attach(model)   # buffers (none in this CNN) agree as the parameters do
        else:
            self.averager = HierarchicalAllreduce(Topology(cfg.procs_per_node), spec=None,
                                                  stats=self.stats)
        self.steps_per_epoch = len(_batches(len(data["y"]), 0, cfg, rank, world))
        self.sched = torch.optim.lr_scheduler.OneCycleLR(
            opt, max_lr=max_lr, total_steps=cfg.epochs * self.steps_per_epoch, pct_start=0.15)
        self.steps = 0
        self.seconds = 0.0

    def train_epoch(self, epoch: int, bar) -> None:
        """One epoch, timed from a barrier (every rank starts it together) to its last step's
        communication done: qcomm's gossip round in flight is completed, so none of it runs
        during the next method's turn."""
        data, model, opt = self.data, self.model, self.opt
        dist.barrier()
        start = time.perf_counter()
        for idx in _batches(len(data["y"]), epoch, self.cfg, self.rank, self.world):
            loss = torch.nn.functional.cross_entropy(model(data["x"][idx]), data["y"][idx])
            opt.zero_grad()
            loss.backward()
            if self.averager is not None:
                self.averager.mean_([p.grad for p in model.parameters()])
            opt.step()
            self.sched.step()
            self.steps += 1
            if bar is not None:
                bar.update(1)
                if bar.n % 20 == 0:
                    bar.set_postfix(method=self.name, epoch=epoch + 1, loss=f"{loss.item():.3f}")
        if self.qcomm:
            opt.flush()
        self.seconds += time.perf_counter() - start

    def finish(self) -> dict:
        """The results; ``seconds`` also counts making the final model (for qcomm the exact
        average of the nodes), not the evaluation and diagnostics."""
        data, model, opt = self.data, self.model, self.opt
        result: dict = {"steps": self.steps, "qcomm_file": qcomm.__file__}
        if self.qcomm:
            st = opt.stats(consensus=True)
            result["own_acc"] = accuracy(model, data["x_test"], data["y_test"])
            result["consensus_distance"] = st["consensus_distance"]
            result["bytes"] = st["bytes_sent"]  # training only: the average below is not counted
            t = time.perf_counter()
            opt.average_parameters()
            self.seconds += time.perf_counter() - t
            opt.close()
        else:
            result["bytes"] = self.stats.snapshot()["bytes_sent"]
        result["seconds"] = self.seconds
        result["acc"] = accuracy(model, data["x_test"], data["y_test"])
        return result


def _worker(rank: int, world: int, cfg: Config, data: dict) -> dict:
    """Every method on this rank, taking turns an epoch each: the machine's load (other work on
    it) changes over seconds, and in turns it weighs on every method alike, where one method
    after the other would each meet a different load."""
    methods = [_Method(m, rank, world, cfg, data) for pair in cfg.pairs() for m in pair]
    bar = None
    if rank == 0:  # a bar on a terminal, a line now and then in a redirected log
        bar = progress(sum(cfg.epochs * m.steps_per_epoch for m in methods), "training",
                       unit="step", dynamic_ncols=True, mininterval=0.5)
    for epoch in range(cfg.epochs):
        for m in methods:
            m.train_epoch(epoch, bar)
    results = {m.name: m.finish() for m in methods}
    dist.barrier()
    if bar is not None:
        bar.close()
    return results


def _cluster_rank(cfg: Config, workdir: Path, timeout_s: float) -> None:
    """One rank under torchrun in the emulated cluster (``--emulated-link``): reads the data the
    parent wrote, trains, and rank 0 writes every rank's results back for the parent."""
    torch.set_num_threads(1)  # 4 processes on few cores, as run_world sets for the local run
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=timeout_s))
    rank, world = dist.get_rank(), dist.get_world_size()
    data = torch.load(workdir / "data.pt", weights_only=True)
    out = _worker(rank, world, cfg, data)
    gathered: list | None = [None] * world if rank == 0 else None
    dist.gather_object(out, gathered, dst=0)
    if rank == 0:
        torch.save(gathered, workdir / "results.pt")
    dist.destroy_process_group()


# ---------------------------------------------------------------------------------------------
# the report: pure functions of the measured numbers (tests/examples/test_train_mnist1d.py)


@dataclass(frozen=True)
class Run:
    """One method's measured numbers, over all ranks of one run."""

    label: str
    acc: float          # test accuracy, percent
    steps: int          # training steps (every rank takes the same number)
    seconds: float      # the slowest rank's training time
    node_bytes: int     # inter-node bytes sent by the node that sent most (its link's load)

    @property
    def step_s(self) -> float:
        """Mean seconds per step, so that ``step_s * steps`` is the run's time."""
        return self.seconds / self.steps

    @property
    def step_bytes(self) -> float:
        return self.node_bytes / self.steps


def make_run(label: str, per_rank: list[dict], procs_per_node: int) -> Run:
    """A :class:`Run` from each rank's result dict (rank order). A node's link carries what its
    ranks send to other nodes; links are full duplex, so the busiest node's sending decides."""
    nodes: dict[int, int] = {}
    for rank, r in enumerate(per_rank):
        node = rank // procs_per_node
        nodes[node] = nodes.get(node, 0) + int(r["bytes"]["inter"])
    steps = {r["steps"] for r in per_rank}
    if len(steps) != 1:
        raise ValueError(f"ranks took different numbers of steps: {sorted(steps)}")
    return Run(label, per_rank[0]["acc"], steps.pop(), max(r["seconds"] for r in per_rank),
               max(nodes.values()))


def link_seconds(nbytes: float, rate_bps: float) -> float:
    """Seconds ``nbytes`` take on a link of ``rate_bps`` bits per second (payload at line rate:
    no latency, no TCP/IP headers)."""
    return 8.0 * nbytes / rate_bps


@dataclass(frozen=True)
class Projection:
    """A run's time had its nodes been joined by a link of ``rate_bps``: the time measured
    here plus the link time of the bytes, as if nothing overlapped them (qcomm's gossip round
    can overlap the next step; a synchronous allreduce cannot overlap this demo's step)."""

    rate_bps: float
    link_step_s: float   # what the link adds per step: step bytes / rate
    step_s: float        # measured step + link_step_s
    run_s: float         # measured run + node bytes / rate


def project(run: Run, rate_bps: float) -> Projection:
    link_step = link_seconds(run.step_bytes, rate_bps)
    return Projection(rate_bps, link_step, run.step_s + link_step,
                      run.seconds + link_seconds(run.node_bytes, rate_bps))


def crossover_bps(ours: Run, base: Run) -> float | None:
    """The link rate at which both projected run times are equal; None when they never are
    (the same method is first at every rate). Below it, the method with fewer bytes is first."""
    dbytes = base.node_bytes - ours.node_bytes
    dsec = ours.seconds - base.seconds
    if dbytes == 0 or dsec == 0 or (dbytes > 0) != (dsec > 0):
        return None
    return 8.0 * dbytes / dsec


def format_rate(bps: float) -> str:
    if bps >= 1e9:
        return f"{bps / 1e9:.3g} Gbit/s"
    if bps >= 1e6:
        return f"{bps / 1e6:.3g} Mbit/s"
    return f"{bps / 1e3:.3g} kbit/s"


def parse_rate(rate: str) -> float:
    """tc's rate syntax (``100mbit``, ``1gbit``) -> bits per second."""
    m = re.fullmatch(r"([0-9]+)(bit|kbit|mbit|gbit)", rate)
    if not m:
        raise ValueError(f"a link rate looks like 100mbit or 1gbit (tc's syntax), got {rate!r}")
    return int(m.group(1)) * {"bit": 1, "kbit": 1e3, "mbit": 1e6, "gbit": 1e9}[m.group(2)]


def per_step_table(runs: list[Run], where: str) -> list[str]:
    lines = [f"{'per step':<26} {'bytes to the other node':>24} {'step time ' + where:>22}"]
    for r in runs:
        lines.append(f"{r.label:<26} {r.step_bytes:>24,.0f} {1e3 * r.step_s:>19.1f} ms")
    return lines


def projection_table(pairs: list[tuple[Run, Run]], rates: tuple[float, ...]) -> list[str]:
    lines = [f"{'link':<12} {'method':<26} {'link adds/step':>15} {'step':>10} {'run':>9}"]
    for rate in rates:
        first = True
        for pair in pairs:
            for r in pair:
                p = project(r, rate)
                lines.append(f"{format_rate(rate) if first else '':<12} {r.label:<26} "
                             f"{1e3 * p.link_step_s:>12.1f} ms {1e3 * p.step_s:>7.1f} ms "
                             f"{p.run_s:>7.1f} s")
                first = False
    return lines


def _sentence(text: str) -> str:
    return text[0].upper() + text[1:]


def verdict(ours: Run, base: Run, rates: tuple[float, ...], *, measured_at: float | None = None
            ) -> list[str]:
    """Plain-language lines: which of the pair finishes first at each rate, and why, from the
    numbers alone. ``measured_at``: the runs were measured on a link of that rate (the times
    already hold the link), so no projection is made."""
    acc = (f"test accuracy after the same {ours.steps} steps: {ours.label} {ours.acc:.1f}%, "
           f"{base.label} {base.acc:.1f}%.")
    ratio = base.node_bytes / max(1, ours.node_bytes)
    if measured_at is not None:
        win, lose = (ours, base) if ours.seconds <= base.seconds else (base, ours)
        return [f"On the emulated {format_rate(measured_at)} link (measured), {win.label} "
                f"finished first, {win.seconds:.1f} s against {lose.seconds:.1f} s"
                f"{_closeness(win.seconds, lose.seconds)}. Per step, {base.label} put "
                f"{base.step_bytes:,.0f} bytes on each node's link, {ours.label} "
                f"{ours.step_bytes:,.0f} ({ratio:.1f}x fewer); {acc}"]
    extra = ours.step_s - base.step_s  # what qcomm costs more per step with a free link
    fewer = ours.node_bytes < base.node_bytes
    if extra > 0:
        lines = [f"Loopback costs no link time, so here {ours.label}'s step is "
                 f"{1e3 * extra:.1f} ms slower than {base.label}'s (its codec and gossip work "
                 f"on these CPUs) and its {ratio:.1f}x fewer bytes save nothing."]
    else:
        lines = [f"Even on loopback, which costs no link time, {ours.label}'s step is "
                 f"{1e3 * -extra:.1f} ms faster than {base.label}'s."]
    for rate in rates:
        po, pb = project(ours, rate), project(base, rate)
        ours_first = po.run_s <= pb.run_s
        win, pw, pl = (ours, po, pb) if ours_first else (base, pb, po)
        saved = pb.link_step_s - po.link_step_s  # link time per step qcomm's bytes save
        if ours_first and extra > 0:
            why = (f"the {1e3 * saved:.1f} ms a step it saves on the link outweigh the "
                   f"{1e3 * extra:.1f} ms it costs in computation")
        elif not ours_first and extra > 0 and fewer:
            why = (f"the link adds only {1e3 * pb.link_step_s:.1f} ms a step to it and "
                   f"{1e3 * po.link_step_s:.1f} ms to {ours.label}, whose {1e3 * saved:.1f} ms "
                   f"saved are less than the {1e3 * extra:.1f} ms it costs in computation")
        else:
            why = (f"it is no slower without a link and sends "
                   f"{'fewer' if (win is ours) == fewer else 'no more'} bytes")
        lines.append(f"At {format_rate(rate)}, {win.label} would finish first, "
                     f"{pw.run_s:.1f} s against {pl.run_s:.1f} s"
                     f"{_closeness(pw.run_s, pl.run_s)}: {why}.")
    cross = crossover_bps(ours, base)
    if cross is not None and fewer:
        lines.append(f"From these numbers, {ours.label} finishes first on links slower than "
                     f"{format_rate(cross)}; {acc}")
    else:
        lines.append(_sentence(acc))
    return lines


# Two times closer than this are reported as a near tie: a few percent is well within what other
# work on the machine changes between runs (two runs of the default demo on a loaded 2-core
# machine: ASSGD 38.8 s and 49.6 s, synchronous fp32 SGD 30.0 s and 29.3 s).
NEAR_TIE = 0.05


def _closeness(first_s: float, second_s: float) -> str:
    gap = (second_s - first_s) / second_s
    return f" (only {100 * gap:.1f}% sooner: a near tie)" if gap < NEAR_TIE else ""


# ---------------------------------------------------------------------------------------------
# the emulated cluster (--emulated-link)


def emulation_problems() -> list[str]:
    """Why ``--emulated-link`` cannot run on this machine (empty: it can, as far as can be told
    without trying; a container without network-admin rights fails only when it tries)."""
    problems = []
    if not hasattr(os, "geteuid") or os.geteuid() != 0:
        problems.append("it needs root (network namespaces, veth pairs, tc qdiscs)")
    problems += [f"no `{tool}` command" for tool in ("ip", "tc") if shutil.which(tool) is None]
    if not NETNS.exists():
        problems.append(f"{NETNS.relative_to(REPO)} is missing (run from a checkout)")
    if _torchrun() is None:
        problems.append("no torchrun next to this Python")
    return problems


def _check_emulation() -> None:
    problems = emulation_problems()
    if problems:
        raise SystemExit("--emulated-link cannot run here: " + "; ".join(problems) +
                         ". Without it, the demo projects the link's cost instead.")


def _emulated_command() -> str:
    """The command line that measures what the default run projects, as this user would type
    it (the SGD pair only: each pair takes minutes on a 100 Mbit/s link)."""
    def short(path: str) -> str:
        rel = os.path.relpath(path)
        return path if rel.startswith("..") else rel

    sudo = "" if hasattr(os, "geteuid") and os.geteuid() == 0 else "sudo "
    return (f"{sudo}{short(sys.executable)} {short(str(Path(__file__).resolve()))} "
            "--emulated-link 100mbit --optimizers sgd")


def _torchrun() -> str | None:
    beside = Path(sys.executable).with_name("torchrun")
    return str(beside) if beside.exists() else shutil.which("torchrun")


def _config_args(cfg: Config) -> list[str]:
    return [a for k, v in asdict(cfg).items() for a in ("--" + k.replace("_", "-"), str(v))]


def run_emulated(cfg: Config, rate: str, data: dict, timeout_s: float) -> list[dict]:
    """The same training, one torchrun per node in bench/cluster's emulated cluster, the link
    between the nodes limited to ``rate``; returns every rank's results, as run_world does."""
    _check_emulation()
    with tempfile.TemporaryDirectory(prefix="qcomm-demo-") as tmp:
        workdir = Path(tmp)
        torch.save(data, workdir / "data.pt")
        # The ranks import the qcomm this process imported (a checkout's, not another install).
        path = str(Path(qcomm.__file__).resolve().parents[1])
        env = dict(os.environ, TORCHRUN=_torchrun() or "",
                   PYTHONPATH=os.pathsep.join(filter(None, [path, os.environ.get("PYTHONPATH")])))
        cmd = ["bash", str(NETNS), "run", "--nodes", str(cfg.nodes), "--procs",
               str(cfg.procs_per_node), "--rate", rate, "--timeout", str(math.ceil(timeout_s)),
               "--", str(Path(__file__).resolve()), "--cluster-rank-dir", str(workdir),
               "--timeout-s", str(timeout_s), *_config_args(cfg)]
        rc = subprocess.run(cmd, env=env, check=False).returncode
        if rc != 0 or not (workdir / "results.pt").exists():
            raise SystemExit(f"the emulated cluster run failed (exit status {rc}; "
                             "bench/cluster/README.md describes the cluster)")
        return torch.load(workdir / "results.pt", weights_only=True)


# ---------------------------------------------------------------------------------------------


def _load() -> float | None:
    """The 1-minute load average (None where the system does not tell)."""
    try:
        return os.getloadavg()[0]
    except (AttributeError, OSError):
        return None


def _busy(load0: float | None, load1: float | None) -> str:
    """How busy the machine was while the times were taken: they depend on what else runs."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    text = f"{cores} CPU cores"
    if load0 is not None and load1 is not None:
        text += f", load average {load0:.1f} at the start, {load1:.1f} at the end"
        if max(load0, load1) > (cores or 1):
            text += "; more runnable processes than cores, so times are noisy"
    return text


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    defaults = Config()
    for field, value in asdict(defaults).items():
        ap.add_argument("--" + field.replace("_", "-"), type=type(value), default=value)
    ap.add_argument("--timeout-s", type=float, default=900.0,
                    help="kill the 4 processes past this many seconds")
    ap.add_argument("--emulated-link", metavar="RATE", default=None,
                    help="root only: train across an emulated link of this rate (tc syntax, "
                         "e.g. 100mbit) in bench/cluster's namespaces, and measure instead of "
                         "projecting")
    ap.add_argument("--cluster-rank-dir", type=Path, default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    cfg = Config(**{k: getattr(args, k) for k in asdict(defaults)})
    cfg.pairs()  # a bad --optimizers fails here, before any process starts
    if args.cluster_rank_dir is not None:
        _cluster_rank(cfg, args.cluster_rank_dir, args.timeout_s)
        return 0
    emulated = None
    if args.emulated_link is not None:
        try:
            emulated = parse_rate(args.emulated_link)
        except ValueError as e:
            ap.error(str(e))
        _check_emulation()  # before minutes of set-up, not after
    world = cfg.nodes * cfg.procs_per_node
    t0 = time.perf_counter()
    load0 = _load()
    data = make_mnist1d(cfg.num_samples, seed=42)
    params = sum(p.numel() for p in ConvNet(hidden=cfg.hidden).parameters())
    where = f"an emulated {format_rate(emulated)} link" if emulated else "loopback"
    print(f"MNIST-1D: {len(data['y'])} train / {len(data['y_test'])} test samples; 1-D CNN of "
          f"{params:,} parameters ({4 * params:,} bytes in fp32); {cfg.nodes} nodes x "
          f"{cfg.procs_per_node} processes (Gloo), the nodes joined by {where}; {cfg}",
          flush=True)
    if emulated:
        results = run_emulated(cfg, args.emulated_link, data, args.timeout_s)
    else:
        results = run_world(_worker, world, args=(cfg, data), timeout_s=args.timeout_s,
                            pg_timeout_s=args.timeout_s)
    wall = time.perf_counter() - t0
    load1 = _load()
    others = {r[m]["qcomm_file"] for r in results for m in r} - {qcomm.__file__}
    if others:
        print(f"warning: ranks imported qcomm from {sorted(others)}, this process from "
              f"{qcomm.__file__}", flush=True)

    runs = {m: make_run(LABELS[m], [r[m] for r in results], cfg.procs_per_node)
            for pair in cfg.pairs() for m in pair}
    pairs = [(runs[ours], runs[base]) for ours, base in cfg.pairs()]
    print(f"\n{'method':<40} {'test acc':>9} {'inter-node bytes':>17} {'train s':>8}")
    ok = True
    total = lambda m: sum(r[m]["bytes"]["inter"] for r in results)
    for ours, base in cfg.pairs():
        a, s = results[0][ours], results[0][base]
        print(f"{LABELS[ours] + f' {cfg.bits}-bit gossip (global average)':<40} "
              f"{runs[ours].acc:>8.1f}% {total(ours):>17,} {runs[ours].seconds:>8.1f}")
        print(f"{'  node 0 own parameters':<40} {a['own_acc']:>8.1f}%")
        print(f"{LABELS[base]:<40} {s['acc']:>8.1f}% {total(base):>17,} "
              f"{runs[base].seconds:>8.1f}")
        # Consensus distance: how far the nodes' parameters are from their mean
        # (sqrt(mean over nodes of ||x_node - mean||^2)); 0 means every node holds the mean.
        print(f"  accuracy gap ({LABELS[base]} - {LABELS[ours]}): {s['acc'] - a['acc']:+.1f} "
              f"points; inter-node bytes {total(base) / max(1, total(ours)):.1f}x fewer; "
              f"consensus distance at the end {a['consensus_distance']:.2e}\n")
        ok = ok and math.isfinite(a["acc"])

    noisy = _busy(load0, load1)
    print(f"Measured, {cfg.nodes} nodes joined by {where} ({noisy}); bytes: what the busier "
          "node sent to the other per step, which its link must carry:")
    print("\n".join(per_step_table([r for p in pairs for r in p],
                                   "on the link" if emulated else "here")))
    if not emulated:
        print("\nPROJECTION, computed, not measured: the same runs with the nodes joined by a "
              "link of the given rate. The link adds bytes / rate per step to the step time "
              "measured here (no overlap of transfers and computation, no latency, no TCP/IP "
              "headers; qcomm's final exact average, once per run, left out):")
        print("\n".join(projection_table(pairs, PROJECTED_RATES)))
        problems = emulation_problems()
        print("\nTo measure this on a rate-limited link instead of projecting it (root, "
              "`ip netns` and `tc`; this machine: "
              f"{'; '.join(problems) if problems else 'ready'}):\n    {_emulated_command()}")
    print(f"\nwall time {wall:.0f} s ({noisy})\n")
    print("Verdict, from the numbers above:")
    for ours, base in pairs:
        for line in verdict(ours, base, PROJECTED_RATES, measured_at=emulated):
            print(f"  {line}")
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
