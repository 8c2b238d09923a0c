"""The workloads the cluster benchmark trains: what model, data, optimizer and quality metric.

- ``mnist1d``: MNIST-1D (generated), MLP 40 -> 512 x 3 -> 10 (551,434 parameters), SGD with
  momentum; quality: test accuracy (higher is better).
- ``mnist1d-bn``: the same data and optimizer, a 1-D CNN with BatchNorm after each of its 3
  convolutions (128 channels) and a 512-unit head (433,418 parameters): the workload whose
  buffers (running statistics) must agree across ranks.
- ``charlm``: Python's stdlib source as characters (corpus.py), decoder-only transformer
  (charlm.py, 1,230,976 parameters), AdamW; quality: validation loss in nats per character
  (lower is better).

The registry (:data:`WORKLOADS`) is pure Python (compare.py and the tests read its defaults);
:func:`load` builds a workload on a rank and imports torch.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any


@dataclass(frozen=True)
class WorkloadInfo:
    """One workload's defaults (compare.py's options fall back to them).

    Attributes:
        name: the command-line name.
        metric: the quality measured on the held-out data (a key of every curve point).
        goal: ``"max"`` (accuracy) or ``"min"`` (loss): which way is better.
        optimizer: ``"sgd"`` (lr, momentum) or ``"adamw"`` (lr, betas 0.9/0.95, weight decay).
        lr, momentum, weight_decay, batch, steps: training defaults (batch per rank).
        width, depth: the model's size (MLP: hidden width and layers; transformer: width and
            blocks).
        target: the quality whose first reaching is "time to target".
        description: one line.
    """

    name: str
    metric: str
    goal: str
    optimizer: str
    lr: float
    batch: int
    steps: int
    target: float
    description: str
    width: int
    depth: int
    momentum: float = 0.0
    weight_decay: float = 0.0

    def reached(self, value: float, target: float) -> bool:
        """Whether ``value`` is at least as good as ``target``."""
        return value >= target if self.goal == "max" else value <= target


WORKLOADS: dict[str, WorkloadInfo] = {
    w.name: w
    for w in (
        WorkloadInfo("mnist1d", "test_acc", "max", "sgd", lr=0.05, momentum=0.9, batch=32,
                     steps=600, target=0.70, width=512, depth=3,
                     description="MNIST-1D, MLP 40-512-512-512-10, SGD + momentum"),
        WorkloadInfo("mnist1d-bn", "test_acc", "max", "sgd", lr=0.05, momentum=0.9, batch=32,
                     steps=600, target=0.70, width=128, depth=3,
                     description="MNIST-1D, CNN 3 x (conv, BatchNorm, ReLU) + 512 head, "
                                 "SGD + momentum"),
        # target: the validation loss fp32 DDP with 4 ranks reaches at about 70% of the 400-step
        # budget (ddp_reference.py; bench/cluster/README.md, "The workloads").
        WorkloadInfo("charlm", "val_loss", "min", "adamw", lr=3e-3, weight_decay=0.1, batch=8,
                     steps=400, target=1.90, width=128, depth=6,
                     description="stdlib source, character transformer 1.23M, AdamW"),
    )
}


def parse_workloads(spec: str) -> list[str]:
    """Comma list of workload names -> names, in order.

    Raises:
        ValueError: an unknown or empty name list (the message lists the known ones).
    """
    names = [s.strip() for s in spec.split(",") if s.strip()]
    unknown = [n for n in names if n not in WORKLOADS]
    if unknown or not names:
        hint = ""
        if unknown:
            # imported here: qcomm.validation imports torch, which the registry does not need
            from qcomm.validation import did_you_mean

            hint = did_you_mean(unknown[0], WORKLOADS)
        raise ValueError(f"workload: unknown {unknown or spec!r}; known: {list(WORKLOADS)}{hint}")
    return names


# ---------------------------------------------------------------------------------------------
# building a workload on a rank (imports torch)


@dataclass
class Workload:
    """A workload ready to train on one rank.

    Attributes:
        info: the registry entry.
        make_model: a fresh, seeded-by-the-caller model (the same architecture every call).
        loss: ``loss(model, i)``: the training loss of this rank's ``i``-th batch.
        evaluate: ``evaluate(model)``: the quality metric on the held-out data.
        model_config: what the result JSON records about the model.
        data_config: what it records about the data (e.g. the corpus fingerprint).
    """

    info: WorkloadInfo
    make_model: Callable[[], Any]
    loss: Callable[[Any, int], Any]
    evaluate: Callable[[Any], float]
    model_config: dict[str, Any]
    data_config: dict[str, Any]


def load(name: str, data: Path, *, rank: int, seed: int, batch: int, total_steps: int,
         args: Any) -> Workload:
    """Workload ``name`` on ``rank``: data from ``data`` (compare.py writes it), model
    hyperparameters from ``args`` (workload.py's options). Every rank draws its own batches;
    the stream depends on (seed, rank) only, so every method sees the same batches."""
    if name in ("mnist1d", "mnist1d-bn"):
        return _mnist1d(data, rank=rank, seed=seed, batch=batch, total=total_steps, args=args,
                        name=name)
    if name == "charlm":
        return _charlm(data, rank=rank, seed=seed, batch=batch, total=total_steps, args=args)
    raise ValueError(f"workload must be one of {list(WORKLOADS)}, got {name!r}")


def make_mlp(width: int, depth: int):
    """MLP 40 -> width (x depth hidden layers, ReLU) -> 10."""
    from torch import nn

    layers: list[nn.Module] = []
    d = 40
    for _ in range(depth):
        layers += [nn.Linear(d, width), nn.ReLU()]
        d = width
    layers.append(nn.Linear(d, 10))
    return nn.Sequential(*layers)


def make_cnn_bn(width: int, depth: int, head: int = 512):
    """1-D CNN on MNIST-1D's 40 points: ``depth`` x (Conv1d stride 2, BatchNorm1d, ReLU) with
    ``width`` channels, then a ``head``-unit ReLU layer and 10 logits. Input [B, 40]."""
    from torch import nn

    layers: list[nn.Module] = [nn.Unflatten(1, (1, 40))]
    channels, length = 1, 40
    for i in range(depth):
        kernel = 5 if i == 0 else 3
        layers += [nn.Conv1d(channels, width, kernel, stride=2, padding=1),
                   nn.BatchNorm1d(width), nn.ReLU()]
        channels, length = width, (length + 2 - kernel) // 2 + 1
    layers += [nn.Flatten(), nn.Linear(width * length, head), nn.ReLU(), nn.Linear(head, 10)]
    return nn.Sequential(*layers)


def _mnist1d(data: Path, *, rank: int, seed: int, batch: int, total: int, args: Any,
             name: str = "mnist1d") -> Workload:
    import numpy as np
    import torch
    from torch import nn

    d = np.load(data)
    x = torch.from_numpy(d["x"]).float()
    y = torch.from_numpy(d["y"]).long()
    x_test = torch.from_numpy(d["x_test"]).float()
    y_test = torch.from_numpy(d["y_test"]).long()
    gen = torch.Generator().manual_seed(seed * 1009 + rank)
    batches = torch.randint(0, x.shape[0], (total, batch), generator=gen)

    def loss(model, i: int):
        idx = batches[i % total]
        return nn.functional.cross_entropy(model(x[idx]), y[idx])

    @torch.no_grad()
    def evaluate(model) -> float:
        was = model.training
        model.eval()   # BatchNorm: the running statistics, not the test batch's
        acc = float((model(x_test).argmax(1) == y_test).float().mean())
        model.train(was)
        return acc

    make = make_cnn_bn if name == "mnist1d-bn" else make_mlp
    return Workload(WORKLOADS[name], lambda: make(args.width, args.depth), loss,
                    evaluate, {"width": args.width, "depth": args.depth},
                    {"train": int(x.shape[0]), "test": int(x_test.shape[0])})


def _charlm(data: Path, *, rank: int, seed: int, batch: int, total: int, args: Any) -> Workload:
    import numpy as np
    import torch

    from bench.cluster import charlm

    d = np.load(data)
    train_np, val_np = d["train"], d["val"]
    train = torch.from_numpy(train_np)
    ctx = args.context
    gen = torch.Generator().manual_seed(seed * 1009 + rank)
    starts = charlm.sample_windows(train_np, ctx, total * batch, gen).view(total, batch)
    val = charlm.validation_windows(val_np, ctx, args.eval_windows)

    def make_model():
        return charlm.CharTransformer(vocab=128, width=args.width, layers=args.depth,
                                      heads=args.heads, context=ctx)

    def loss(model, i: int):
        return charlm.lm_loss(model, charlm.gather_windows(train, starts[i % total], ctx))

    def evaluate(model) -> float:
        return charlm.validation_loss(model, val)

    return Workload(WORKLOADS["charlm"], make_model, loss, evaluate,
                    {"width": args.width, "depth": args.depth, "heads": args.heads,
                     "context": ctx},
                    {"train_tokens": len(train_np), "val_tokens": len(val_np),
                     "eval_windows": args.eval_windows,
                     "fingerprint": str(d["fingerprint"])})


def make_data(name: str, path: Path, *, seed: int, num_samples: int = 12000) -> dict[str, Any]:
    """Write workload ``name``'s data file (npz) to ``path``; returns what describes it."""
    if name in ("mnist1d", "mnist1d-bn"):
        import numpy as np
        from mnist1d.data import get_dataset_args, make_dataset

        a = get_dataset_args()
        a.num_samples = num_samples
        a.seed = seed
        d = make_dataset(a)
        np.savez(path, x=d["x"].astype(np.float32), y=d["y"].astype(np.int64),
                 x_test=d["x_test"].astype(np.float32), y_test=d["y_test"].astype(np.int64))
        return {"num_samples": num_samples, "seed": seed}
    if name == "charlm":
        from bench.cluster import corpus

        c = corpus.build()
        corpus.save(c, path)
        return {"train_tokens": len(c.train), "val_tokens": len(c.val),
                "train_files": len(c.train_files), "val_files": len(c.val_files),
                "fingerprint": corpus.fingerprint(c), "stdlib": str(corpus.stdlib_dir())}
    raise ValueError(f"workload must be one of {list(WORKLOADS)}, got {name!r}")


if __name__ == "__main__":  # a library: say so rather than exit silently
    print(
        "bench/cluster/workloads.py is a library of the cluster benchmark (the workloads: data, "
        "model, optimizer, quality), imported by compare.py and workload.py; it runs nothing. See "
        "bench/cluster/README.md."
    )
