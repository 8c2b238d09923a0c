"""Train a small character-level transformer with AdamW on qcomm, on one machine or several.

Launch it with torchrun; one line per machine (README.md, "Run on several machines"):

    # two machines, one process each; HOST0 is the first machine's address
    torchrun --nnodes 2 --nproc-per-node 1 --rdzv-backend c10d \\
        --rdzv-endpoint HOST0:29400 --rdzv-id charlm examples/train_charlm.py --steps 300

    # one torchrun per machine, found through a rendezvous that outlives every machine:
    python -m qcomm.rendezvous --port 29400 --nodes 2                  # on a machine that stays
    QCOMM_RENDEZVOUS=HOST:29400 torchrun --standalone --nproc-per-node 1 \
        examples/train_charlm.py --wait-free --on-peer-loss continue   # on each machine
    # (several such nodes on one machine: OMP_NUM_THREADS=1 in front of each; a node whose
    # options differ from the running job's exits with status 78, its restarts at once)

    # one machine, 4 processes emulating 2 nodes of 2 (gossip between the two halves)
    torchrun --nproc-per-node 4 examples/train_charlm.py --procs-per-node 2

    # the same with the model sharded inside each node by FSDP2 (each rank gossips its shard)
    torchrun --nproc-per-node 4 examples/train_charlm.py --procs-per-node 2 --fsdp

    # one process, no torchrun: plain AdamW (nothing to communicate)
    python examples/train_charlm.py --steps 50

The model is a decoder-only transformer over bytes (GPT-2's layout at toy size). The text is
this interpreter's own standard library (its ``*.py`` files), which every machine with Python
has, so nothing is downloaded; ``--text FILE`` trains on a file of your own instead. Each rank
draws its own random windows of the training text.

The optimizer is ``HierarchicalOptimizer(torch.optim.AdamW(...))``: gradients averaged inside
each node (``--ddp``: by torch's DDP during backward; ``--fsdp``: the model sharded over the
node's ranks by FSDP2, each rank gossiping its own shard), AdamW's own update, then compressed
asynchronous gossip of the parameters between nodes. The ranks per node are torchrun's
``LOCAL_WORLD_SIZE`` unless ``--procs-per-node`` says otherwise. Backend: Gloo on CPU; on GPU,
NCCL for CUDA tensors with Gloo for the few CPU tensors (``--backend``).

Rank 0 (with the rendezvous, each node's first rank) prints the mean training loss of its own
batches and the bytes this rank sent between nodes every ``--log-every`` steps, and the
validation loss before and after training (a node that joins a running job: once it holds
the parameters a running neighbour handed it, at its first step); at the end every rank
averages the parameters exactly (``average_parameters()``) and prints their sha256, the same
on every rank.
``--ckpt-dir DIR`` writes ``DIR/step0000100/rank00000.pt`` and its record ``rank00000.json``
(one pair per rank, every rank at the same step);
``--resume DIR/step0000100`` goes on from there (on CPU, tests/examples/test_train_charlm.py
checks that it ends with the bytes of an uninterrupted run). ``--stop-file PATH`` ends the run
before ``--steps`` once PATH exists (with ``--wait-free``, each node at its own next logged step),
with the same final average, report and checkpoint.
"""

from __future__ import annotations

import argparse
import datetime
import hashlib
import logging
import math
import os
import sys
import sysconfig
import time
import warnings
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from qcomm import rendezvous
from qcomm.collectives import PeerError
from qcomm.engine import CommOptions
from qcomm.engine.report import lost_and_back
from qcomm.rendezvous.refusals import REFUSED_EXIT_CODE, RefusedError
from qcomm.rendezvous.seat import init_torchrun_group
from qcomm.sgd import (
    HierarchicalOptimizer,
    checkpoint_path,
    load_checkpoint,
    load_sharded_checkpoint,
    save_checkpoint,
    save_sharded_checkpoint,
)

log = logging.getLogger("train_charlm")

VOCAB = 128  # ASCII bytes are their own token; every other byte becomes token 127
OTHER = VOCAB - 1


# ---------------------------------------------------------------------------------------------
# the text


def stdlib_source(limit: int) -> bytes:
    """The first ``limit`` bytes of this interpreter's standard-library ``*.py`` files (those
    directly in the stdlib directory, sorted by name), concatenated.

    Raises:
        ValueError: the directory holds fewer bytes of source (e.g. a zipped stdlib).
    """
    root = Path(sysconfig.get_paths()["stdlib"])
    parts, size = [], 0
    for path in sorted(root.glob("*.py")):
        if size >= limit:
            break
        data = path.read_bytes()
        parts.append(data)
        size += len(data)
    if size < limit:
        raise ValueError(f"{root} holds {size} bytes of *.py source, fewer than the {limit} "
                         "asked for; pass --text FILE or smaller --train-bytes/--val-bytes")
    return b"".join(parts)[:limit]


def load_text(path: str | None, train_bytes: int, val_bytes: int) -> tuple[torch.Tensor,
                                                                           torch.Tensor]:
    """(train, validation) uint8 token tensors: the text's first ``train_bytes`` and the
    ``val_bytes`` right after them (contiguous sides, so no validation line was trained on)."""
    total = train_bytes + val_bytes
    if path is None:
        data = stdlib_source(total)
    else:
        data = Path(path).read_bytes()[:total]
        if len(data) < total:
            raise ValueError(f"{path} holds {len(data)} bytes, fewer than --train-bytes + "
                             f"--val-bytes = {total}")
    tokens = torch.frombuffer(bytearray(data), dtype=torch.uint8).clone()
    tokens[tokens >= OTHER] = OTHER
    return tokens[:train_bytes], tokens[train_bytes:]


def random_windows(tokens: torch.Tensor, context: int, count: int) -> torch.Tensor:
    """``count`` random windows of ``context + 1`` tokens, int64 (count, context + 1).

    Drawn from torch's global CPU generator on purpose: :func:`load_checkpoint` restores its
    state, so a resumed run draws the same batches as an uninterrupted one."""
    starts = torch.randint(0, len(tokens) - context - 1, (count,))
    return tokens[starts[:, None] + torch.arange(context + 1)].long()


def fixed_windows(tokens: torch.Tensor, context: int, count: int) -> torch.Tensor:
    """``count`` windows spread evenly over ``tokens``: the same validation set every run."""
    starts = torch.linspace(0, len(tokens) - context - 1, count).long()
    return tokens[starts[:, None] + torch.arange(context + 1)].long()


# ---------------------------------------------------------------------------------------------
# the model


class Block(nn.Module):
    """Pre-norm transformer block: causal self-attention, then a 4x GELU MLP, each residual."""

    def __init__(self, width: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.ln1 = nn.LayerNorm(width)
        self.qkv = nn.Linear(width, 3 * width)
        self.proj = nn.Linear(width, width)
        self.ln2 = nn.LayerNorm(width)
        self.mlp = nn.Sequential(nn.Linear(width, 4 * width), nn.GELU(),
                                 nn.Linear(4 * width, width))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = (z.view(b, t, self.heads, c // self.heads).transpose(1, 2)
                   for z in self.qkv(self.ln1(x)).split(c, dim=2))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(y.transpose(1, 2).reshape(b, t, c))
        return x + self.mlp(self.ln2(x))


class CharLM(nn.Module):
    """Decoder-only transformer: tokens (batch, time) int64 -> logits (batch, time, VOCAB)."""

    def __init__(self, width: int, layers: int, heads: int, context: int) -> None:
        super().__init__()
        self.tok = nn.Embedding(VOCAB, width)
        self.pos = nn.Embedding(context, width)
        self.blocks = nn.Sequential(*(Block(width, heads) for _ in range(layers)))
        self.ln = nn.LayerNorm(width)
        self.head = nn.Linear(width, VOCAB)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.tok(idx) + self.pos(torch.arange(idx.shape[1], device=idx.device))
        return self.head(self.ln(self.blocks(x)))


def next_token_loss(model: nn.Module, windows: torch.Tensor) -> torch.Tensor:
    """Mean cross-entropy (nats) of each window's next characters."""
    logits = model(windows[:, :-1])
    return F.cross_entropy(logits.reshape(-1, VOCAB), windows[:, 1:].reshape(-1))


@torch.no_grad()
def evaluate(model: nn.Module, windows: torch.Tensor, batch: int = 64) -> float:
    """Mean next-character loss of ``model`` over ``windows`` (nats)."""
    total = 0.0
    for i in range(0, len(windows), batch):
        w = windows[i:i + batch]
        total += float(next_token_loss(model, w)) * len(w)
    return total / len(windows)


def parameters_sha256(model: nn.Module) -> str:
    """sha256 of every parameter's bytes, in ``state_dict`` order: equal digests, equal
    parameters."""
    h = hashlib.sha256()
    for name, t in model.state_dict().items():
        if hasattr(t, "full_tensor"):   # FSDP2: the whole parameter (a collective in the node)
            t = t.full_tensor()
        h.update(name.encode())
        h.update(t.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


# ---------------------------------------------------------------------------------------------
# the processes


@dataclass(frozen=True)
class Place:
    """Where this process runs: its rank among ``world`` and its device."""

    rank: int
    world: int
    device: torch.device
    speaks: bool = True  # prints the lines every rank of its node would print alike

    @property
    def distributed(self) -> bool:
        return self.world > 1


def start_processes(backend: str, timeout_s: float, address: str | None = None,
                    node_id: int | None = None, linked: bool = False) -> Place:
    """Join the job (torchrun's, or through the rendezvous at ``address`` with one torchrun
    per node; ``linked``: the nodes linked through it, so that a node can come back while the
    job runs) and pick this rank's device.

    Raises:
        RuntimeError: a GPU backend asked for without enough GPUs on this machine.
    """
    if "RANK" not in os.environ and address is None:  # plain `python train_charlm.py`
        return Place(0, 1, torch.device("cuda" if torch.cuda.is_available() else "cpu"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if backend == "auto":
        backend = "nccl" if torch.cuda.is_available() else "gloo"
    if backend == "nccl":
        if local_rank >= torch.cuda.device_count():
            raise RuntimeError(f"--backend nccl: local rank {local_rank} needs a GPU of its own, "
                               f"this machine has {torch.cuda.device_count()}; start fewer "
                               "processes per node (--nproc-per-node) or use --backend gloo")
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
        # CUDA tensors (gradients, parameters, gossip payloads) go through NCCL; the few CPU
        # tensors (qcomm's control votes, this script's byte totals) through Gloo.
        pg_backend = "cpu:gloo,cuda:nccl"
    else:
        device = torch.device("cpu")
        pg_backend = "gloo"
    # One timeout bounds every wait, so a machine that dies ends the job instead of hanging it.
    if address is not None and linked:  # nodes come and go: default group = this node
        seat = rendezvous.init_node(address, backend=pg_backend, node_id=node_id,
                                    timeout_s=timeout_s)
        return Place(seat.rank, seat.world_size, device, speaks=local_rank == 0)
    if address is not None:  # every node its own torchrun: each node's first rank speaks
        seat = rendezvous.init_process_group(address, backend=pg_backend, node_id=node_id,
                                             timeout_s=timeout_s)
        return Place(seat.rank, seat.world_size, device, speaks=local_rank == 0)
    # torch.distributed.init_process_group, but fit for torchrun --max-restarts (torch's agent
    # keeps its store across restarts; see init_torchrun_group)
    init_torchrun_group(pg_backend, datetime.timedelta(seconds=timeout_s))
    return Place(dist.get_rank(), dist.get_world_size(), device, speaks=dist.get_rank() == 0)


def comm_options(args: argparse.Namespace) -> dict[str, object]:
    """The communication options given on the command line, as HierarchicalOptimizer's
    keyword arguments (checked here, before any process group exists)."""
    options = dict(bits=args.bits, block_size=args.block_size, rounding=args.rounding,
                   graph=args.graph, staleness=args.staleness, gamma=args.gamma,
                   sync_every=args.sync_every, fragments=args.fragments,
                   outer_momentum=args.outer_momentum, intra_bits=args.intra_bits,
                   procs_per_node=args.procs_per_node, wait_free=args.wait_free,
                   on_peer_loss=args.on_peer_loss, timeout_s=args.timeout_s, seed=args.seed,
                   join_optimizer_state=args.join_optimizer_state)
    CommOptions.from_kwargs(options)  # ValueError/TypeError naming the bad option
    return options


def say(place: Place, text: str) -> None:
    """Print on rank 0 only (with the rendezvous, on each node's first rank): lines every rank
    would print alike, or that rank's own figures."""
    if place.speaks:
        print(text, flush=True)


def losses_words(dropped: list[int], rejoined: list[int]) -> str:
    """The neighbours this rank dropped, in words: those still lost, and apart those that
    came back (a node restarted into the running job is live, not dropped)."""
    still, back = lost_and_back(dropped, rejoined)
    return "; ".join([*([f"ranks dropped: {still}"] if still else []),
                      *([f"ranks lost and back: {back}"] if back else [])])


def stop_file_seen(args: argparse.Namespace, opt: HierarchicalOptimizer, step: int) -> bool:
    """True when ``--stop-file`` exists at a logged step, on every rank of the node alike
    (collective over the node's ranks at those steps: a rank that saw it alone would leave the
    node's others waiting in the next step's gradient mean)."""
    if args.stop_file is None or step % args.log_every:
        return False
    return opt.node_any(os.path.exists(args.stop_file))


def step_dir(root: str, step: int) -> Path:
    """The checkpoint directory of ``step`` under ``--ckpt-dir``."""
    return Path(root) / f"step{step:07d}"


def shard_inside_nodes(model: nn.Module, place: Place, procs_per_node: int | None) -> None:
    """FSDP2 over each node's ranks: every block, then the root, ``fully_shard`` over the
    "shard" dimension of a ``(nodes, procs_per_node)`` mesh (docs/engine.md, "Sharded models").
    Collective: every rank calls it."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    ppn = procs_per_node or int(os.environ.get("LOCAL_WORLD_SIZE", place.world))
    mesh = init_device_mesh(place.device.type, (place.world // ppn, ppn),
                            mesh_dim_names=("replicate", "shard"))
    for block in model.blocks:
        fully_shard(block, mesh=mesh["shard"])
    fully_shard(model, mesh=mesh["shard"])


def latest_checkpoint(root: str, place: Place, sharded: bool) -> Path | None:
    """The newest step directory under ``root`` that every rank finished writing its part of,
    or None. Each rank looks at what it sees (a directory per machine is fine): its file's
    record, written after the file (with FSDP2, DCP's metadata, written last); the ranks then
    agree on the newest step all of them hold (collective)."""
    def done(where: Path) -> bool:
        if sharded:
            return (where / ".metadata").is_file()
        return checkpoint_path(where, place.rank).with_suffix(".json").is_file()

    steps = sorted(int(w.name[4:]) for w in Path(root).glob("step[0-9]*") if done(w))
    newest = steps[-1] if steps else -1
    if place.distributed:
        common = torch.tensor([newest], dtype=torch.int64)  # CPU: Gloo moves it either way
        dist.all_reduce(common, op=dist.ReduceOp.MIN)
        newest = int(common.item())
    if newest < 0:
        return None
    if newest not in steps:
        raise FileNotFoundError(f"rank {place.rank}: the newest checkpoint every rank holds is "
                                f"step {newest}, which this rank does not have under {root}")
    return step_dir(root, newest)


def same_start(model: nn.Module, place: Place) -> None:
    """Rank 0's parameters on every rank: qcomm needs every rank to start from the same
    ones; the seed gives them on one torch build, rank 0's copy gives them across machines."""
    if place.distributed:
        for t in model.state_dict().values():
            dist.broadcast(t, src=0)


def save(args: argparse.Namespace, opt: HierarchicalOptimizer, model: nn.Module, place: Place,
         step: int) -> None:
    """The checkpoint of ``step`` under ``--ckpt-dir``: one file per rank, or with ``--fsdp``
    one DCP checkpoint of the sharded state (a directory every rank reaches)."""
    where = step_dir(args.ckpt_dir, step)
    if args.fsdp:
        save_sharded_checkpoint(where, opt, model, extra={"step": step})
        say(place, f"saved {where} (DCP, the sharded state of every rank)")
    else:
        save_checkpoint(where, opt, model, extra={"step": step})
        say(place, f"saved {where} (one file per rank)")


def train(args: argparse.Namespace, place: Place, options: dict[str, object]) -> None:
    """Build, (resume,) train, average, report, save. Every rank runs it in lock step."""
    train_tokens, val_tokens = load_text(args.text, args.train_bytes, args.val_bytes)
    val_windows = fixed_windows(val_tokens, args.context, args.val_windows).to(place.device)

    torch.manual_seed(args.seed)
    model = CharLM(args.width, args.layers, args.heads, args.context).to(place.device)
    if args.fsdp:   # whole first (one rank's copy on every rank), then each rank keeps its part
        same_start(model, place)
        shard_inside_nodes(model, place, args.procs_per_node)
        # FSDP2 warns that the root's output (the logits) is a view, in case a caller changes
        # it in place; next_token_loss only reshapes it.
        warnings.filterwarnings("ignore", message="FSDP2-wrapped module .* returned a view")
    opt = HierarchicalOptimizer(
        torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=args.weight_decay),
        **options)
    try:
        start = 0
        if args.resume == "latest":
            found = latest_checkpoint(args.ckpt_dir, place, args.fsdp)
            args.resume = None if found is None else str(found)
            if found is None:
                say(place, f"no checkpoint under {args.ckpt_dir}: starting at step 0")
        if args.resume and args.fsdp:  # one DCP checkpoint of the sharded state, RNG included
            start = int(load_sharded_checkpoint(args.resume, opt, model)["step"])
            say(place, f"resumed from {args.resume} at step {start}")
        elif args.resume:
            mine = checkpoint_path(args.resume, place.rank)
            if not mine.is_file():
                raise FileNotFoundError(
                    f"rank {place.rank}: no checkpoint file {mine}. Every rank reads the file "
                    "it wrote itself: resume with the same machines and processes, and with "
                    "per-machine directories keep each machine's rank (torchrun orders the "
                    "machines by --local-addr, else by host name)")
            # Every rank reads its own file; torch's RNG state comes back with it.
            start = int(load_checkpoint(args.resume, opt, model)["step"])
            say(place, f"resumed from {args.resume} at step {start}")
        else:
            if not args.fsdp:
                same_start(model, place)
            # Different batches on every rank, drawn from the global generator (see
            # random_windows) after the model's initialisation.
            torch.manual_seed(args.seed * 1_000_003 + place.rank + 1)
        # Either way the model is attached: its buffers would agree as its parameters do.
        net = opt.data_parallel(model) if args.ddp else opt.attach(model)

        n_params = sum(p.numel() for p in model.parameters())
        say(place, f"{n_params:,} parameters; {place.world} processes on {place.device.type}; "
                   f"text: {len(train_tokens):,} training / {len(val_tokens):,} validation "
                   f"bytes; comm options {options}")
        # A node that joins the running job holds its own fresh parameters until its first
        # step has taken a running neighbour's: their loss would read as the job's.
        seat = rendezvous.linked_seat()
        joining = seat is not None and seat.joining
        if joining:
            say(place, f"node {seat.node} joins the running job: its validation loss follows "
                       "once it holds a running neighbour's parameters")
        else:
            say(place, f"validation loss at step {start}: {evaluate(model, val_windows):.4f} "
                       "(rank 0's parameters)")

        running, count, t0 = 0.0, 0, time.perf_counter()
        step, end = start, args.steps
        while step < args.steps:
            batch = random_windows(train_tokens, args.context, args.batch_size)
            opt.zero_grad()
            loss = next_token_loss(net, batch.to(place.device))
            loss.backward()
            if args.compute_ms:   # a larger model's kernels: the CPU and the GIL left free
                time.sleep(args.compute_ms / 1e3)
            if args.clip > 0:
                # The node's mean gradient first, so that every rank clips the same gradient.
                opt.sync_gradients()
                torch.nn.utils.clip_grad_norm_(model.parameters(), args.clip)
            opt.step()
            # A node that came back to the running job takes its neighbour's step count.
            step = max(step + 1, opt.stats()["steps"])
            if joining:
                joining = False
                say(place, f"validation loss at step {step}: "
                           f"{evaluate(model, val_windows):.4f} (node {seat.node} joined: the "
                           "parameters a running neighbour handed it)")
            running, count = running + loss.item(), count + 1
            if not math.isfinite(running):
                raise FloatingPointError(f"rank {place.rank}: training loss {loss.item()} at "
                                         f"step {step}; lower --lr")
            if step % args.log_every == 0 or step == args.steps:
                sent = opt.stats()["bytes_sent"]
                say(place, f"step {step}/{args.steps}: train loss {running / count:.4f} "
                           f"(rank {place.rank}, mean of {count} steps), sent by rank "
                           f"{place.rank} so far: {sent['inter']:,} bytes between nodes, "
                           f"{sent['intra']:,} inside its node; "
                           f"{count / (time.perf_counter() - t0):.1f} steps/s")
                running, count, t0 = 0.0, 0, time.perf_counter()
            if args.ckpt_dir and args.save_every and step % args.save_every == 0 \
                    and step < args.steps:
                # Every rank saves at the same step (the gossip rounds in flight are saved
                # with their neighbours' payloads, which arrive only at that step).
                save(args, opt, model, place, step)
            if stop_file_seen(args, opt, step):
                say(place, f"stopped at step {step} of {args.steps}: {args.stop_file} exists")
                end = step
                break

        # The exact global mean on every rank: evaluation and the final checkpoint see one
        # model, not one per node.
        opt.average_parameters()
        say(place, f"validation loss at step {end}: {evaluate(model, val_windows):.4f} "
                   "(global mean of the parameters)")
        stats = opt.stats()
        sent = stats["bytes_sent"]
        totals = torch.tensor([sent["inter"], sent["intra"]], dtype=torch.int64)
        if stats.get("dropped_ranks"):  # the whole world's sum would wait for the lost
            say(place, f"nodes live at the end: {stats['live_nodes']} "
                       f"({losses_words(stats['dropped_ranks'], stats['rejoined_ranks'])})")
        elif rendezvous.linked_seat() is not None:  # no group spans the job
            say(place, f"nodes live at the end: {stats['live_nodes']}")
        elif place.distributed:
            dist.all_reduce(totals)  # CPU tensor: Gloo moves it under both backends
            say(place, f"bytes sent by all ranks: {int(totals[0]):,} between nodes, "
                       f"{int(totals[1]):,} inside nodes")
        # One write of the whole line: the ranks share torchrun's stdout, and a print's text
        # and its newline may reach it apart, between another rank's.
        sys.stdout.flush()
        os.write(sys.stdout.fileno(),
                 f"rank {place.rank}: parameters sha256 {parameters_sha256(model)}\n".encode())
        if args.ckpt_dir:
            save(args, opt, model, place, end)
    finally:
        opt.close()  # before destroy_process_group: it releases qcomm's groups and transport


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        description="Train a small character-level transformer with AdamW on qcomm's "
                    "hierarchical communication; run it under torchrun.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    g = ap.add_argument_group("training")
    g.add_argument("--steps", type=int, default=300, help="Total optimizer steps.")
    g.add_argument("--batch-size", type=int, default=32, help="Windows per rank and step.")
    g.add_argument("--lr", type=float, default=3e-3, help="AdamW learning rate.")
    g.add_argument("--weight-decay", type=float, default=0.01, help="AdamW weight decay.")
    g.add_argument("--clip", type=float, default=1.0,
                   help="Clip the node's mean gradient to this norm; 0 turns clipping off.")
    g.add_argument("--seed", type=int, default=0,
                   help="Seed of the model, of the batches and of stochastic rounding.")
    g.add_argument("--log-every", type=int, default=25, help="Steps between loss lines.")
    g.add_argument("--compute-ms", type=float, default=0.0, metavar="MS",
                   help="Emulated compute: sleep MS after each step's backward, as a larger "
                        "model's GPU kernels would take, the CPU and the GIL left free (the "
                        "wait-free gossip's overlap on a laptop; several tiny nodes on one "
                        "machine paced instead of spinning).")
    g.add_argument("--stop-file", default=None, metavar="PATH",
                   help="End the run before --steps once PATH exists (looked for at every "
                        "--log-every step; a node's ranks agree on it): the run averages, "
                        "reports and saves as at --steps. Needs --wait-free under torchrun: "
                        "each node stops at its own step and the final average waits for "
                        "the others.")
    g = ap.add_argument_group("model and text")
    g.add_argument("--width", type=int, default=128, help="Embedding width.")
    g.add_argument("--layers", type=int, default=2, help="Transformer blocks.")
    g.add_argument("--heads", type=int, default=4, help="Attention heads (divide --width).")
    g.add_argument("--context", type=int, default=64, help="Characters per window.")
    g.add_argument("--text", default=None,
                   help="A text file to train on; default: this Python's stdlib sources.")
    g.add_argument("--train-bytes", type=int, default=1 << 20, help="Training text size.")
    g.add_argument("--val-bytes", type=int, default=64 << 10, help="Validation text size.")
    g.add_argument("--val-windows", type=int, default=128, help="Validation windows.")
    g = ap.add_argument_group(
        "communication (qcomm.engine.CommOptions; the defaults are README.md's "
        "ADAMW_SLOW_LINK)")
    g.add_argument("--bits", type=int, default=4, choices=(1, 2, 4, 8),
                   help="Bits per value of the gossip between nodes.")
    g.add_argument("--block-size", type=int, default=128,
                   help="Values per quantization scale (a power of two in [32, 4096]).")
    g.add_argument("--rounding", default="nearest", choices=("nearest", "stochastic"),
                   help="Rounding of the quantizer.")
    g.add_argument("--graph", default="ring", choices=("ring", "exponential", "complete"),
                   help="Gossip graph between nodes.")
    g.add_argument("--sync-every", type=int, default=2,
                   help="Every part of the parameters is gossiped once every this many steps.")
    g.add_argument("--fragments", type=int, default=2,
                   help="Fragments per gossip period (divides --sync-every).")
    g.add_argument("--gamma", type=float, default=1.0,
                   help="Consensus step in (0, 1]; values above 0.5 need --fragments > "
                        "--staleness.")
    g.add_argument("--staleness", type=int, default=1, help="Gossip rounds in flight.")
    g.add_argument("--outer-momentum", type=float, default=0.0,
                   help="Outer Nesterov momentum on each fragment's progress (SGD's "
                        "SLOW_LINK uses 0.9; it makes AdamW worse).")
    g.add_argument("--intra-bits", type=int, default=None, choices=(1, 2, 4, 8),
                   help="Quantize the gradient mean inside a node too; default: full "
                        "precision.")
    g.add_argument("--procs-per-node", type=int, default=None,
                   help="Ranks per node; default: torchrun's LOCAL_WORLD_SIZE. Smaller than "
                        "--nproc-per-node emulates several nodes on one machine.")
    g.add_argument("--wait-free", action="store_true",
                   help="No node waits for a neighbour's gossip round (nodes of different "
                        "speeds).")
    g.add_argument("--ddp", action="store_true",
                   help="Average gradients inside each node with torch DDP during backward.")
    g.add_argument("--fsdp", action="store_true",
                   help="Shard the model inside each node with torch's FSDP2 (fully_shard over "
                        "the node's ranks); each rank gossips its own shard between nodes. "
                        "Needs torchrun; not with --ddp or --intra-bits. Checkpoints are DCP's "
                        "(a directory every rank reaches).")
    g.add_argument("--on-peer-loss", default="raise", choices=("raise", "continue"),
                   help="continue: a node that dies or falls silent is dropped and the others "
                        "go on without it (needs --wait-free); raise: the job stops.")
    g.add_argument("--join-optimizer-state", default="copy", choices=("copy", "fresh"),
                   help="A node that comes back to the running job (--rendezvous) starts "
                        "AdamW's moments from the neighbour that hands it its parameters "
                        "(copy) or afresh (fresh).")
    g.add_argument("--rendezvous", default=os.environ.get(rendezvous.ENV_VAR),
                   metavar="HOST:PORT",
                   help="The job's rendezvous (python -m qcomm.rendezvous), when each node "
                        f"runs its own torchrun; default ${rendezvous.ENV_VAR}.")
    g.add_argument("--node-id", type=int, default=None,
                   help="This node's seat with --rendezvous (default: in order of arrival).")
    g.add_argument("--timeout-s", type=float, default=300.0,
                   help="Longest wait for another rank, in seconds, in qcomm and in "
                        "torch.distributed; past it the job fails with an error naming the "
                        "rank.")
    g.add_argument("--backend", default="auto", choices=("auto", "gloo", "nccl"),
                   help="auto: nccl when CUDA is available, else gloo. nccl puts each local "
                        "rank on its own GPU and moves CPU tensors through Gloo.")
    g = ap.add_argument_group("checkpoints")
    g.add_argument("--ckpt-dir", default=None,
                   help="Write DIR/stepNNNNNNN/rankRRRRR.pt and .json (one pair per rank) every "
                        "--save-every steps and at the end (after the final average).")
    g.add_argument("--save-every", type=int, default=0,
                   help="Steps between checkpoints; 0: only at the end.")
    g.add_argument("--resume", default=None,
                   help="A step directory written by --ckpt-dir (DIR/stepNNNNNNN): go on "
                        "from it, up to --steps in all. Same number of machines and "
                        "processes, same options. 'latest': the newest step under --ckpt-dir "
                        "that every rank finished writing, or step 0 when there is none (the "
                        "command a job restarted by torchrun's --max-restarts runs again).")
    return ap


def main(argv: list[str] | None = None) -> int:
    ap = build_parser()
    args = ap.parse_args(argv)
    if args.width % args.heads:
        ap.error(f"--width {args.width} is not a multiple of --heads {args.heads}")
    if min(args.steps, args.log_every, args.batch_size, args.context) < 1 or args.save_every < 0:
        ap.error("--steps, --log-every, --batch-size and --context must be >= 1, "
                 "--save-every >= 0")
    if not 0 <= args.compute_ms <= 60_000:   # NaN fails both
        ap.error(f"--compute-ms must be a number of milliseconds from 0 to 60000, got "
                 f"{args.compute_ms}")
    if args.stop_file and not args.wait_free and ("RANK" in os.environ or args.rendezvous):
        # Lockstep nodes would see the file at different steps: one would average while
        # another still gossips.
        ap.error("--stop-file needs --wait-free under torchrun: lockstep nodes would not "
                 "stop at one step")
    if args.resume == "latest" and not args.ckpt_dir:
        ap.error("--resume latest looks under --ckpt-dir: give one")
    if args.fsdp:
        clash = [flag for flag, on in (("--ddp", args.ddp), ("--intra-bits", args.intra_bits))
                 if on]
        if clash:
            ap.error(f"--fsdp cannot be combined with {', '.join(clash)}: FSDP2 averages the "
                     "gradients inside the node itself (no DDP, nothing for qcomm to quantize "
                     "there)")
        if "RANK" not in os.environ:
            ap.error("--fsdp shards the model over a node's processes: launch with torchrun")
    try:
        options = comm_options(args)
        if args.rendezvous is not None:
            rendezvous.parse_address(args.rendezvous, "--rendezvous")
    except (TypeError, ValueError) as e:
        ap.error(str(e))
    rank = os.environ.get("RANK", "0")
    # qcomm logs the topology it detected (nodes x ranks, what is compressed where) at INFO on
    # rank 0 through the "qcomm" logger, and peer failures at WARNING.
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr,
                        format=f"%(asctime)s rank {rank} %(name)s %(levelname)s: %(message)s")
    logging.getLogger("qcomm").setLevel(logging.INFO)
    place = None
    try:
        place = start_processes(args.backend, args.timeout_s, args.rendezvous, args.node_id,
                                linked=args.on_peer_loss == "continue")
        rank = str(place.rank)  # the job's rank (with the rendezvous, torchrun's is the node's)
        for handler in logging.getLogger().handlers:
            handler.setFormatter(logging.Formatter(
                f"%(asctime)s rank {rank} %(name)s %(levelname)s: %(message)s"))
        if not place.distributed:
            print("one process: plain AdamW, nothing to communicate (launch with torchrun "
                  "for several)", flush=True)
        train(args, place, options)
    except PeerError as e:
        # Another rank died, hung past --timeout-s or sent corrupt data: say which, and stop.
        log.error("rank %s: stopping, a peer failed: %s", rank, e)
        return 1
    except RefusedError as e:
        # The running job refused this node's options: a restart would be refused alike, so
        # the exit status says so (torchrun's summary shows it; its restarts end at once).
        log.error("rank %s: refused by the running job: %s", rank, e)
        return REFUSED_EXIT_CODE
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
