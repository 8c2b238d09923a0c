"""The training worker's flags that other scripts take too, declared once.

workload.py (one rank of a run) takes them; compare.py takes the same flags and passes them on
to every run, and ddp_reference.py takes the model's, which workloads.py's ``load`` reads. Each
script adds the flags it takes with :func:`add_flags` (same name, type, default and help
everywhere), and compare.py builds workload.py's command line from the same table with
:func:`command_line`. The lists two scripts share have names here (:data:`TRAINING`,
:data:`RUN_END`, :data:`METHOD_SETTINGS`). Flags whose meaning differs between the scripts
(compare.py's ``--workload``: a list; ``--time-budget``: seconds, or seconds per layout) stay
with each script; what one run reads and writes (:data:`RUN_FILES`: the method, the workload,
its data, the JSON) is declared here for both workers.

Pure Python, like the registries it reads its help texts from (workloads.py).
"""

from __future__ import annotations

import argparse
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

if __package__ in (None, ""):
    # Run by path: the repository root first on sys.path, so that `bench.cluster` imports.
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from bench.cluster import workloads as W
from bench.cluster.training import LR_SCHEDULES

__all__ = ["FLAGS", "METHOD_SETTINGS", "PASSED_ON", "RUN_END", "RUN_FILES", "TRAINING", "Flag",
           "add_flags", "add_run_files", "command_line", "default_snapshots"]


@dataclass(frozen=True)
class Flag:
    """One flag of the worker.

    Attributes:
        flag (str): its spelling, e.g. ``"--powersgd-rank"``.
        type (Callable[[str], Any] | None): what parses its value; None: a switch (on when
            given).
        default (Any): its value when left out.
        help (str): what ``--help`` says.
        choices (tuple[str, ...] | None): the values it takes, when only some are allowed.
        required (bool): the script refuses to run without it (no default).
    """

    flag: str
    type: Callable[[str], Any] | None
    default: Any
    help: str
    choices: tuple[str, ...] | None = None
    required: bool = False

    @property
    def dest(self) -> str:
        """The attribute argparse stores it under: ``"powersgd_rank"``."""
        return self.flag.removeprefix("--").replace("-", "_")

    def add_to(self, parser: argparse.ArgumentParser, *, unset: bool = False) -> None:
        """Declare the flag on ``parser``.

        Args:
            parser (argparse.ArgumentParser): the script's parser.
            unset (bool): default to None instead, which a script that passes the flag on
                reads as "leave it out: the worker's default" (and its help says so).
        """
        if self.type is None:
            parser.add_argument(self.flag, action="store_true", help=self.help)
            return
        default, help_ = self.default, self.help
        if unset:
            default, help_ = None, f"{help_} Left out: workload.py's ({_word(self.default)})."
        if self.required:
            parser.add_argument(self.flag, type=self.type, required=True, help=help_,
                                choices=self.choices)
            return
        parser.add_argument(self.flag, type=self.type, default=default, help=help_,
                            choices=self.choices)

    def words(self, value: Any) -> list[str]:
        """The command-line words that give the worker ``value``: none for the worker's own
        default (or a switch that is off), which it takes when the flag is left out."""
        if value is None or value == self.default or value is False:
            return []
        if self.type is None:
            return [self.flag]
        return [self.flag, _word(value)]


def _word(value: Any) -> str:
    """``value`` as the worker's parser reads it back: the shortest exact spelling of a float
    (60.0 -> ``"60"``, 0.003 -> ``"0.003"``), ``str`` of anything else."""
    if isinstance(value, float):
        short = f"{value:g}"
        return short if float(short) == value else repr(value)
    return str(value)


def _workload_default(key: str) -> str:
    """``"the workload's when left out (mnist1d 600, ..., charlm 400)"``, from the registry."""
    values = ", ".join(f"{w.name} {getattr(w, key):g}" for w in W.WORKLOADS.values())
    return f"the workload's when left out ({values})"


FLAGS: dict[str, Flag] = {f.dest: f for f in (
    # the model and its training (None: the workload's value)
    Flag("--width", int, None, "The model's width (MLP hidden units, CNN channels or "
         f"transformer width); {_workload_default('width')}."),
    Flag("--depth", int, None, "Hidden layers (MLP and CNN) or blocks (transformer); "
         f"{_workload_default('depth')}."),
    Flag("--heads", int, 4, "Attention heads of the transformer."),
    Flag("--context", int, 64, "Characters per training window of the transformer."),
    Flag("--eval-windows", int, 256,
         "How many fixed validation windows the transformer's loss is measured on."),
    Flag("--batch", int, None,
         f"Samples (or windows) per rank and step; {_workload_default('batch')}."),
    Flag("--lr", float, None, f"The learning rate; {_workload_default('lr')}."),
    Flag("--momentum", float, None, f"SGD's momentum; {_workload_default('momentum')}."),
    Flag("--weight-decay", float, None,
         f"AdamW's weight decay; {_workload_default('weight_decay')}."),
    Flag("--steps", int, None, f"Timed steps per run; {_workload_default('steps')}."),
    Flag("--lr-schedule", str, "constant",
         "The learning rate over the run, the same for every method: constant, or cosine (a "
         "linear warm-up over the first 5%% of --warmup + --steps, then a cosine to 0 at the "
         "end; a node past --steps, under a time budget, stays at 0).", LR_SCHEDULES),
    Flag("--warmup", int, 5, "Untimed steps before the timed window (they train too)."),
    Flag("--baseline-steps", int, 20, "Compute-only steps timed before training starts (a "
         "run whose workers restart: in their first life only)."),
    Flag("--snapshots", int, 0, "Parameter snapshots of each node, evaluated after the run (at "
         "evenly spaced steps, or times of a time budget); 0: 60 for mnist1d(-bn), 30 for "
         "charlm (its evaluation costs more)."),
    Flag("--seed", int, 0, "The seed of weights and batches (and of the data a sweep "
         "generates)."),
    # the methods' own settings
    Flag("--powersgd-rank", int, 4, "The rank of PowerSGD's low-rank approximation."),
    Flag("--localsgd-period", int, 8,
         "Steps between the parameter averages of post-local SGD."),
    Flag("--diloco-sync-every", int, 16, "DiLoCo's inner steps per outer round (streaming: "
         "each fragment once per round)."),
    Flag("--streaming-fragments", int, 4, "Streaming DiLoCo's number of fragments; it must "
         "divide --diloco-sync-every."),
    Flag("--streaming-delay", int, 1, "Streaming DiLoCo's fragment_sync_delay: inner steps a "
         "fragment's allreduce overlaps."),
    # how a run ends, and what is measured on the way
    Flag("--max-steps", int, None, "With --time-budget: the most steps a node takes (default "
         "100 x --steps: the budget decides)."),
    Flag("--pg-timeout", float, 300.0, "Seconds a collective (and torchft's quorum) may wait "
         "before the run fails; with --kill-node, the longest a survivor stays blocked on the "
         "lost node."),
    Flag("--kill-node", int, None, "Lose this node: every process of it (its ranks and its "
         "torchrun agent) is killed with SIGKILL at --kill-at of the run, as if the machine "
         "were lost; the survivors record what they did. 1 or more: node 0 hosts the "
         "rendezvous store."),
    Flag("--kill-at", float, None, "When --kill-node dies, a fraction strictly between 0 and "
         "1: after step round(F x steps) of that node, or F x --time-budget seconds into the "
         "timed window for the methods with a per-node budget."),
    Flag("--join-at", float, None, "With --kill-node: the lost node comes back and joins the "
         "running job. The launch links the nodes through a rendezvous (each node its own "
         "torchrun, python -m qcomm.rendezvous beside node 0); at --kill-at the node's ranks "
         "are killed but not its torchrun agent, which starts them again; they wait until F x "
         "--time-budget seconds into the timed window (F above --kill-at, below 1), then join "
         "from their neighbours' state: the wait-free methods that go on without a lost node "
         "(names ending in -cont). The peers recover their own way (recovery.py): ddp and "
         "localsgd by torchrun's elastic restart from a checkpoint (one elastic job), torchft's "
         "(streaming) DiLoCo by torchft's heal (a torchrun per node); the node's torchrun is "
         "killed and started again at F. A --time-budget in seconds."),
    Flag("--links", str, "world", "How the nodes reach each other: world, one torchrun world "
         "whose Gloo groups carry the links (the default); gloo, each node its own torchrun, "
         "linked through qcomm's rendezvous by a Gloo group of two per link; sockets, linked "
         "the same way over one-port TCP links (each node accepting on one port, the job token "
         "checked, AES-256-GCM), behind a firewall that lets in only those ports and the "
         "rendezvous's. gloo and sockets need a method that continues without a lost node "
         "(names ending in -cont, slow-link).", ("world", "gloo", "sockets")),
    Flag("--fsdp", None, False, "Shard the model inside each node with FSDP2 (fully_shard over "
         "the node's ranks, torchtitan's layout): hsdp, torchft-hsdp, qcomm-hier variants in "
         "lockstep and torchft's (streaming) DiLoCo run sharded; the other methods keep a whole "
         "model per rank and say n/a."),
    Flag("--profile", None, False, "cProfile every rank's timed steps; the top functions go "
         "to OUT.prof<rank>.txt (compare.py: runs/<run>.json.prof<rank>.txt)."),
)}

RUN_FILES: dict[str, Flag] = {f.dest: f for f in (
    Flag("--method", str, None, "The method to train with (methods.py explains the names: e.g. "
         "ddp, localsgd-p32, torchft-diloco-h32-o7-m5, slow-link, assgd-4-h8f4); each worker "
         "says which it runs.", required=True),
    Flag("--workload", str, "mnist1d", "What to train: MNIST-1D with an MLP and SGD, or the "
         "character transformer with AdamW (workloads.py).", tuple(W.WORKLOADS)),
    Flag("--data", str, None, "The workload's data file, an npz written by compare.py.",
         required=True),
    Flag("--out", str, None, "The JSON file rank 0 writes (a run whose workers restart: its "
         "last life's rank 0).", required=True),
)}
"""What one run of workload.py or recovery.py reads and writes: the method, the workload, its
data file and the JSON of its results (:func:`add_run_files`). Kept apart from :data:`FLAGS`:
compare.py spells ``--workload`` and ``--out`` too, for a list and a directory."""

METHOD_SETTINGS = ("powersgd_rank", "localsgd_period", "diloco_sync_every",
                   "streaming_fragments", "streaming_delay")
"""The methods' own settings, in the order every script's ``--help`` lists them."""

TRAINING = ("width", "depth", "heads", "context", "eval_windows", "batch", "lr", "momentum",
            "weight_decay", "steps", "lr_schedule", "warmup", "baseline_steps", "snapshots",
            "seed", *METHOD_SETTINGS)
"""The model, its training and the methods' settings: what workload.py and recovery.py (one
rank of a run either way) both take, in this order."""

RUN_END = ("pg_timeout", "kill_node", "kill_at", "join_at", "fsdp", "profile")
"""How a run of workload.py or recovery.py ends and what it measures on the way: the
deadline of a wait, the lost node (and its return), the sharding, the profile."""

PASSED_ON = ("width", "depth", "batch", "lr", "momentum", "weight_decay", "steps",
             "lr_schedule", "warmup",
             "seed", *METHOD_SETTINGS, "profile", "pg_timeout", "kill_node", "kill_at",
             "join_at", "fsdp", "links")
"""What compare.py passes on to every run as it got it (``--max-steps`` goes with the time
budget, which compare.py sets per layout)."""


def add_flags(parser: argparse.ArgumentParser, names: Iterable[str], *,
              unset: Iterable[str] = ()) -> None:
    """Declare the flags ``names`` (their ``dest``, e.g. ``"powersgd_rank"``) on ``parser``,
    in that order.

    Args:
        parser (argparse.ArgumentParser): the script's parser.
        names (Iterable[str]): keys of :data:`FLAGS`.
        unset (Iterable[str]): those of ``names`` that default to None on this parser
            (:meth:`Flag.add_to`).
    """
    unset = set(unset)
    for name in names:
        FLAGS[name].add_to(parser, unset=name in unset)


def add_run_files(parser: argparse.ArgumentParser) -> None:
    """Declare :data:`RUN_FILES` on a worker's ``parser`` (workload.py, recovery.py)."""
    for flag in RUN_FILES.values():
        flag.add_to(parser)


def command_line(values: Mapping[str, Any], names: Iterable[str]) -> list[str]:
    """The worker's words for the flags ``names``, each with its value in ``values``; a value
    that is the worker's default is left out (the worker takes it anyway).

    Args:
        values (Mapping[str, Any]): values by ``dest`` (e.g. ``vars(args)``).
        names (Iterable[str]): keys of :data:`FLAGS`.

    Returns:
        list[str]: e.g. ``["--lr", "0.003", "--kill-node", "1", "--kill-at", "0.33"]``.
    """
    return [word for name in names for word in FLAGS[name].words(values[name])]



def default_snapshots(given: int, workload: str) -> int:
    """``--snapshots`` as a worker uses it: ``given``, or for 0 the workload's count (30 for
    charlm, whose evaluation costs more; 60 for the others), as its help says."""
    if given:
        return given
    return 30 if workload == "charlm" else 60

if __name__ == "__main__":  # a library: say so rather than exit silently
    print(
        "bench/cluster/worker_flags.py is a library of the cluster benchmark (the flags "
        "workload.py shares with compare.py and ddp_reference.py), imported by them; it runs "
        "nothing. See bench/cluster/README.md."
    )
