"""A training step end to end: K node processes train the same transformer with qcomm's named
settings and with the torch optimizer alone, and the step's figures are printed with their targets.

    python bench/gpu_step.py                         # CUDA: --size gpu; else --size tiny on CPU
    python bench/gpu_step.py --size tiny --steps 3 --warmup 1 --json bench/out/gpu-step.json
    python bench/gpu_step.py --check-targets         # CUDA: exit 1 when a target is missed

Each node is one process (one rank per node, Gloo between them), all on ``cuda:0`` when CUDA is
available: the nodes share the one device, so every step time is a shared-device time, the
same for every setting. The model is the cluster benchmark's character transformer
(bench/cluster/charlm.py); ``--size gpu`` is 85.6M parameters under bf16 autocast (fp32 master
weights), ``--size tiny`` a few thousand in fp32. The settings, run one after another in the
same processes: ``plain-adamw`` / ``plain-sgd`` (the torch optimizer alone),
``adamw-slow-link`` (``HierarchicalOptimizer(AdamW, **ADAMW_SLOW_LINK)``), ``slow-link``
(``ASSGD(**SLOW_LINK)``), and each qcomm setting again with the last node slowed
(``...+slow-peer``): how much of a slowed neighbour's time reaches node 0's step. What each
figure measures: bench/README.md (``gpu_step.py``). The JSON is rewritten after every
setting, so a run cut short leaves the settings it finished.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import math
import os
import statistics
import sys
import threading
import time
from pathlib import Path
from typing import Any

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch

from bench.common import environment, format_table, write_json

SIZES = {
    "tiny": {"width": 16, "layers": 1, "heads": 2, "context": 16, "batch": 4,
             "dtype": "float32"},
    # GPT-2 small's body (12 x 768) over bytes: 85M parameters, 8192 tokens per node per step.
    "gpu": {"width": 768, "layers": 12, "heads": 12, "context": 512, "batch": 16,
            "dtype": "bfloat16"},
}
VOCAB = 128
# (name, torch optimizer, qcomm setting in qcomm.sgd or None, the plain setting it is set against)
SETTINGS = [("plain-adamw", "adamw", None, None),
            ("adamw-slow-link", "adamw", "ADAMW_SLOW_LINK", "plain-adamw"),
            ("plain-sgd", "sgd", None, None),
            ("slow-link", "sgd", "SLOW_LINK", "plain-sgd")]
SLOW = "+slow-peer"   # the suffix of a setting run again with the last node slowed
# The qcomm share of the step (codec, copies, bookkeeping) and the codec's own, on CUDA.
TARGET_SHARE = 0.05
TARGET_COPIES = 1.0         # device-host copies per message sent, each way
TARGET_WAIT_SHARE = 0.05    # of the slowed peer's extra time, seen in node 0's step (wait-free)
# Steps under torch.profiler (CUDA): enough that SLOW_LINK (a fragment every 4 steps) sends.
PROFILED_STEPS = 8


# ---------------------------------------------------------------------------------------------
# the codec's time: every codec call goes through qcomm.compress.unchecked.backend_for(device)


class _TimedBackend:
    """A codec backend whose three operations are timed by a :class:`_CodecClock`."""

    def __init__(self, inner: Any, clock: _CodecClock) -> None:
        self._inner, self._clock = inner, clock

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self._inner, name)
        if name not in ("quantize_into", "dequantize_into", "dequant_accumulate_into"):
            return attr
        clock = self._clock

        def timed(*args: Any) -> Any:
            with clock.call(args[0]):   # the input (x, payload, payloads): on the call's device
                return attr(*args)
        return timed


class _CodecClock:
    """Sums the codec calls of the current step made by the main thread (the step's own): host
    seconds always; for CUDA tensors also the device time between a pair of events recorded
    on the current stream around the call (its kernels, as the stream ran them)."""

    def __init__(self) -> None:
        self.host_s = 0.0
        self.calls = 0
        self.events: list[tuple[Any, Any]] = []
        self.main = threading.main_thread()

    @contextlib.contextmanager
    def call(self, tensor: torch.Tensor):
        own = threading.current_thread() is self.main
        ev = None
        if own and tensor.is_cuda:
            ev = (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
            ev[0].record()
        t0 = time.perf_counter()
        try:
            yield
        finally:
            if own:
                self.host_s += time.perf_counter() - t0
                self.calls += 1
            if ev is not None:
                ev[1].record()
                self.events.append(ev)

    def take(self, cuda: bool) -> tuple[float, float | None, int]:
        """(host ms, device ms or None off CUDA, calls) since the last take; after a sync."""
        dev = sum(a.elapsed_time(b) for a, b in self.events) if cuda else None
        out = (1e3 * self.host_s, dev, self.calls)
        self.host_s, self.calls, self.events = 0.0, 0, []
        return out


_CLOCK = _CodecClock()


@contextlib.contextmanager
def _codec_clock():
    """qcomm.compress's codec calls through :class:`_TimedBackend` while inside; restored on
    leaving, so a process that runs other work afterwards (a test's pooled world) gets the
    library as it was."""
    from qcomm.compress import unchecked

    inner = unchecked.backend_for

    def backend_for(device: torch.device) -> Any:
        return _TimedBackend(inner(device), _CLOCK)
    unchecked.backend_for = backend_for
    try:
        yield
    finally:
        unchecked.backend_for = inner


# ---------------------------------------------------------------------------------------------
# one node (a process of the world)


def _device(cfg: dict) -> torch.device:
    if cfg["cpu"] or not torch.cuda.is_available():
        return torch.device("cpu")
    torch.cuda.set_device(0)   # every node on the one device (the emulation shares it)
    return torch.device("cuda", 0)


def _build(setting: str, model: torch.nn.Module, cfg: dict) -> tuple[Any, Any, bool]:
    """(the module to call, the optimizer, whether qcomm communicates) for ``setting``."""
    import qcomm.sgd

    _, inner, named, _ = next(s for s in SETTINGS if s[0] == setting.split("+")[0])
    total = cfg["warmup"] + cfg["steps"] + PROFILED_STEPS
    if inner == "adamw":
        opt: Any = torch.optim.AdamW(model.parameters(), lr=cfg["lr_adamw"])
        if named is None:
            return model, opt, False
        opt = qcomm.sgd.HierarchicalOptimizer(opt, procs_per_node=1, seed=0,
                                              **getattr(qcomm.sgd, named))
    elif named is None:
        return model, torch.optim.SGD(model.parameters(), lr=cfg["lr_sgd"], momentum=0.9), False
    else:
        # The run's length, as the README gives it: SLOW_LINK anneals its outer step to it.
        opt = qcomm.sgd.ASSGD(model.parameters(), lr=cfg["lr_sgd"], momentum=0.9,
                              procs_per_node=1, seed=0, total_steps=total,
                              **getattr(qcomm.sgd, named))
    return opt.data_parallel(model), opt, True


def _step_fn(module: Any, opt: Any, batches: torch.Tensor, dtype: torch.dtype,
             device: torch.device):
    """One training step on batch ``i``: ``batches`` (n, batch, context + 1) int64 on device."""
    from bench.cluster.charlm import lm_loss

    autocast = dtype != torch.float32

    def step(i: int) -> torch.Tensor:
        opt.zero_grad(set_to_none=True)
        with torch.autocast(device.type, dtype=dtype, enabled=autocast):
            loss = lm_loss(module, batches[i % batches.shape[0]])
        loss.backward()
        opt.step()
        return loss.detach()
    return step


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _timed_steps(step, device: torch.device, first: int, count: int, delay_s: float,
                 timed: bool) -> tuple[list[float], list[float], list[float | None]]:
    """Run steps ``first..first+count``; per step (ms): wall time, codec host, codec device.
    ``delay_s`` is slept before each step (a slower node; inside its own step time)."""
    walls, hosts, devs = [], [], []
    for i in range(first, first + count):
        _sync(device)
        _CLOCK.take(False)
        t0 = time.perf_counter()
        if delay_s:
            time.sleep(delay_s)
        step(i)
        _sync(device)
        wall = 1e3 * (time.perf_counter() - t0)
        host, dev, _ = _CLOCK.take(device.type == "cuda")
        if timed:
            walls.append(wall)
            hosts.append(host)
            devs.append(dev)
    return walls, hosts, devs


def _count_copies(step, device: torch.device, first: int) -> dict[str, int] | None:
    """Device-host copies in :data:`PROFILED_STEPS` steps, from torch.profiler's CUDA activity
    (its ``Memcpy DtoH`` / ``Memcpy HtoD`` records); None on CPU, where there is no device."""
    if device.type != "cuda":
        return None
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for i in range(first, first + PROFILED_STEPS):
            step(i)
        _sync(device)
    names = [e.name for e in prof.events()]
    return {"dtoh": sum(n.startswith("Memcpy DtoH") for n in names),
            "htod": sum(n.startswith("Memcpy HtoD") for n in names)}


def _messages(opt: Any, qcomm: bool) -> int:
    if not qcomm:
        return 0
    return int(sum(opt.stats()["messages_sent"].values()))


def node(rank: int, world: int, cfg: dict, setting: str, delay_s: float) -> dict:
    """Train ``setting`` on this node for warm-up + timed + profiled steps; its figures.
    ``delay_s``: sleep before each step on the last node (0: every node at full speed). The
    process's torch threads and qcomm's codec are as they were when it returns."""
    threads = torch.get_num_threads()
    try:
        if cfg["threads"]:
            torch.set_num_threads(cfg["threads"])
        with _codec_clock():
            return _node(rank, world, cfg, setting, delay_s)
    finally:
        torch.set_num_threads(threads)


def _node(rank: int, world: int, cfg: dict, setting: str, delay_s: float) -> dict:
    from bench.cluster.charlm import CharTransformer

    device = _device(cfg)
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
    torch.manual_seed(0)   # the same initial model on every node and in every setting
    model = CharTransformer(vocab=VOCAB, width=cfg["width"], layers=cfg["layers"],
                            heads=cfg["heads"], context=cfg["context"]).to(device)
    before = torch.nn.utils.parameters_to_vector(model.parameters()).detach().cpu()
    gen = torch.Generator(device).manual_seed(1000 + rank)   # each node its own batches
    batches = torch.randint(0, VOCAB, (8, cfg["batch"], cfg["context"] + 1), device=device,
                            generator=gen)
    module, opt, qcomm = _build(setting, model, cfg)
    step = _step_fn(module, opt, batches, getattr(torch, cfg["dtype"]), device)
    slow = delay_s if rank == world - 1 else 0.0
    first_loss = float(step(0))
    _timed_steps(step, device, 1, cfg["warmup"] - 1, slow, timed=False)
    sent0 = _messages(opt, qcomm)
    walls, hosts, devs = _timed_steps(step, device, cfg["warmup"], cfg["steps"], slow, True)
    sent1 = _messages(opt, qcomm)
    # The slowed-peer runs give the wait figures only: no profile (it costs seconds on CUDA).
    copies = (None if setting.endswith(SLOW)
              else _count_copies(step, device, cfg["warmup"] + cfg["steps"]))
    out = {"rank": rank, "device": str(device), "step_ms": walls, "codec_host_ms": hosts,
           "codec_device_ms": devs, "messages_timed": sent1 - sent0, "copies": copies,
           "messages_profiled": _messages(opt, qcomm) - sent1, "first_loss": first_loss,
           "peak_bytes": (torch.cuda.max_memory_allocated(device) if device.type == "cuda"
                          else None)}
    if qcomm:
        st = opt.stats()
        out.update(bytes_sent=dict(st["bytes_sent"]), messages_sent=dict(st["messages_sent"]))
        opt.average_parameters()   # collective: every node ends with the same model
        opt.close()                # before the world's group is used for the next setting
    after = torch.nn.utils.parameters_to_vector(model.parameters()).detach().cpu()
    out["param_change"] = float((after - before).norm())
    out["params"] = sum(p.numel() for p in model.parameters())
    return out


# ---------------------------------------------------------------------------------------------
# the figures


def _med(xs: list[float]) -> float:
    return float(statistics.median(xs))


def summarize(runs: list[dict]) -> dict:
    """One setting's figures from its nodes' results (:func:`node`'s dicts, by rank): medians
    and means over the timed steps per node, then the median over nodes. The means amortize
    what happens only on some steps (a gossip round every few steps); qcomm's figures use them.
    """
    steps = [_med(r["step_ms"]) for r in runs]
    means = [statistics.fmean(r["step_ms"]) for r in runs]
    host = [statistics.fmean(r["codec_host_ms"]) for r in runs]
    dev = [None if None in r["codec_device_ms"] else statistics.fmean(r["codec_device_ms"])
           for r in runs]
    return {"device": runs[0]["device"], "params": runs[0]["params"],
            "step_ms": _med(steps), "step_ms_per_node": steps,
            "step_ms_mean": _med(means), "step_ms_mean_per_node": means,
            "node0_step_ms_mean": means[0],
            "codec_host_ms": _med(host), "codec_host_ms_per_node": host,
            "codec_device_ms": None if None in dev else _med(dev),
            "codec_device_ms_per_node": dev,
            "messages_timed": [r["messages_timed"] for r in runs],
            "messages_profiled": [r["messages_profiled"] for r in runs],
            "copies": [r["copies"] for r in runs],
            "peak_bytes": [r["peak_bytes"] for r in runs],
            "bytes_sent": [r.get("bytes_sent") for r in runs],
            "first_loss": [r["first_loss"] for r in runs],
            "param_change": [r["param_change"] for r in runs]}


def _na(why: str) -> dict:
    return {"value": None, "target": None, "ok": None, "why": why}


def _fig(value: float, target: float | None, cuda: bool, unit: str, why: str = "") -> dict:
    """A figure and its target (``value <= target``), judged on CUDA only."""
    ok = None if target is None or not cuda else bool(value <= target)
    return {"value": value, "unit": unit, "target": target, "ok": ok,
            "why": why or ("" if cuda or target is None else
                           "measured on CPU: the targets hold for CUDA only")}


def _copies(s: dict, plain: dict, cuda: bool) -> dict:
    """Device-host copies per message, each way, less the plain setting's copies (per rank)."""
    if not cuda:
        return {"dtoh": _na("CPU: every tensor is in host memory, no copy to count"),
                "htod": _na("CPU: every tensor is in host memory, no copy to count")}
    sent = sum(s["messages_profiled"])
    if not sent:
        why = f"no message sent in the {PROFILED_STEPS} profiled steps"
        return {"dtoh": _na(why), "htod": _na(why)}
    out = {}
    for way in ("dtoh", "htod"):
        extra = sum(c[way] for c in s["copies"]) - sum(c[way] for c in plain["copies"])
        out[way] = _fig(extra / sent, TARGET_COPIES, cuda, "per message")
    return out


def figures(name: str, done: dict[str, dict]) -> dict:
    """The figures of qcomm setting ``name`` against its plain setting, from ``done``."""
    s = done[name]
    plain = done[next(x for x in SETTINGS if x[0] == name)[3]]
    cuda = s["device"].startswith("cuda")
    extra = s["step_ms_mean"] - plain["step_ms_mean"]
    codec = s["codec_device_ms"] if cuda else s["codec_host_ms"]
    out = {"extra_ms": _fig(extra, None, cuda, "ms", "mean step less plain's mean step"),
           "extra_share": _fig(extra / s["step_ms_mean"], TARGET_SHARE, cuda, "of step"),
           "codec_ms": _fig(codec, None, cuda, "ms", "mean per step: CUDA events around the "
                            "codec's calls" if cuda else "mean per step: host time (CPU)"),
           "codec_share": _fig(codec / s["step_ms_mean"], TARGET_SHARE, cuda, "of step"),
           **{f"copies_{k}": v for k, v in _copies(s, plain, cuda).items()}}
    if cuda:
        added = _med([a - b for a, b in zip(s["peak_bytes"], plain["peak_bytes"], strict=True)])
        out["peak_added_mib"] = _fig(added / 2**20, None, cuda, "MiB")
        out["peak_added_bytes_per_param"] = _fig(added / s["params"], None, cuda, "B/param")
    else:
        out["peak_added_mib"] = _na("CPU: torch.cuda's allocator counts device memory only")
    return out


def wait_figure(name: str, done: dict[str, dict], delay_ms: float) -> dict | None:
    """How much of the last node's added ``delay_ms`` per step reaches node 0's step through
    ``name``: qcomm's extra time on node 0 with the peer slowed, less without (the plain runs
    with the same slowed peer cancel what the shared device gives node 0 meanwhile)."""
    plain = next(x for x in SETTINGS if x[0] == name)[3]
    keys = (name + SLOW, plain + SLOW, name, plain)
    if any(k not in done for k in keys):
        return None
    a, b, c, d = (done[k]["node0_step_ms_mean"] for k in keys)
    wait = (a - b) - (c - d)
    import qcomm.sgd

    cuda = done[name]["device"].startswith("cuda")
    named = next(x for x in SETTINGS if x[0] == name)[2]
    wait_free = bool(getattr(qcomm.sgd, named).get("wait_free", False))
    fig = _fig(wait / delay_ms, TARGET_WAIT_SHARE if wait_free else None, cuda,
               "of the peer's delay")
    if not wait_free:
        fig["why"] = "lockstep: the control, it waits for its peer by design"
    return {"wait_ms": _fig(wait, None, cuda, "ms"), "wait_share": fig}


# ---------------------------------------------------------------------------------------------
# the command


def plan(qcomm_settings: list[str], slow_peer: bool) -> list[str]:
    """The settings to run, in order: each qcomm setting after its plain one; then, with
    ``slow_peer``, each pair again with the last node slowed."""
    out: list[str] = []
    for name, _, named, plain in SETTINGS:
        if named is not None and name in qcomm_settings:
            out += [plain, name]
    if slow_peer:
        out += [x + SLOW for x in list(out)]
    return out


def _rows(report: dict) -> list[list[object]]:
    rows: list[list[object]] = []
    for name, s in report["settings"].items():
        rows.append([name, "step (median)", f"{s['step_ms']:.3g}", "ms", "", "",
                     "per node " + ", ".join(f"{x:.3g}" for x in s["step_ms_per_node"])])
    for name, figs in [*report["figures"].items(), *report["wait"].items()]:
        for key, f in figs.items():
            value = "n/a" if f["value"] is None else f"{f['value']:.3g}"
            target = "" if f["target"] is None else f"<= {f['target']:g}"
            verdict = {True: "PASS", False: "FAIL", None: "n/a" if target else ""}[f["ok"]]
            rows.append([name, key, value, f.get("unit", ""), target, verdict, f["why"]])
    return rows


def print_table(report: dict) -> None:
    print(format_table(["setting", "figure", "value", "unit", "target", "verdict", "note"],
                       _rows(report)), flush=True)


def missed(report: dict) -> list[str]:
    """The figures whose target was judged and missed."""
    return [f"{name} {key}" for name, figs in [*report["figures"].items(),
                                               *report["wait"].items()]
            for key, f in figs.items() if f["ok"] is False]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--size", choices=sorted(SIZES), default=None,
                   help="model preset: gpu (~85M parameters, bf16 autocast) or tiny (fp32, "
                        "for CPU); default gpu on CUDA, else tiny")
    for flag in ("width", "layers", "heads", "context", "batch"):
        p.add_argument(f"--{flag}", type=int, default=None,
                       help=f"the transformer's {flag} (default: the preset's)")
    p.add_argument("--dtype", choices=["float32", "bfloat16"], default=None,
                   help="autocast dtype of the forward pass (default: the preset's)")
    p.add_argument("--nodes", type=int, default=2, help="node processes (default 2)")
    p.add_argument("--warmup", type=int, default=3, help="untimed steps first (>= 1)")
    p.add_argument("--steps", type=int, default=16,
                   help="timed steps (>= 1; 16 cover SLOW_LINK's gossip period)")
    p.add_argument("--settings", default="adamw-slow-link,slow-link",
                   help="qcomm settings, comma-separated: adamw-slow-link, slow-link (each "
                        "runs with its plain torch optimizer)")
    p.add_argument("--no-slow-peer", action="store_true",
                   help="skip the runs with the last node slowed (the wait figures)")
    p.add_argument("--peer-delay-ms", type=float, default=0.0,
                   help="the slowed node's sleep per step, ms (0: the first plain setting's "
                        "median step, at least 20)")
    p.add_argument("--cpu", action="store_true", help="run on CPU even when CUDA is available")
    p.add_argument("--threads", type=int, default=0,
                   help="torch threads per node process (0: the CPUs shared out among the "
                        "nodes, at least 1)")
    p.add_argument("--lr-adamw", type=float, default=3e-4, help="AdamW's learning rate")
    p.add_argument("--lr-sgd", type=float, default=0.05, help="SGD's learning rate")
    p.add_argument("--timeout-s", type=float, default=120.0,
                   help="limit for each setting's run, seconds (its nodes are killed past it)")
    p.add_argument("--time-budget", type=float, default=0.0,
                   help="seconds for all the settings: none starts after it, each gets at most "
                        "what is left (0: no budget)")
    p.add_argument("--json", type=Path, default=None,
                   help="write the figures here, rewritten after every setting")
    p.add_argument("--check-targets", action="store_true",
                   help="exit 1 when a target is missed (judged on CUDA only)")
    args = p.parse_args(argv)
    _check_args(p, args)
    return args


def _check_args(p: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Refuse bad flags by name (argparse's error: usage, the message, exit status 2)."""
    for flag in ("width", "layers", "heads", "context", "batch"):
        v = getattr(args, flag)
        if v is not None and v < 1:
            p.error(f"--{flag} must be >= 1, got {v}")
    for flag, low in (("nodes", 2), ("warmup", 1), ("steps", 1), ("threads", 0)):
        if getattr(args, flag) < low:
            p.error(f"--{flag} must be >= {low}, got {getattr(args, flag)}")
    for flag in ("peer_delay_ms", "time_budget", "lr_adamw", "lr_sgd", "timeout_s"):
        v = getattr(args, flag)
        zero_ok = flag in ("peer_delay_ms", "time_budget")
        if not math.isfinite(v) or v < 0 or (v == 0 and not zero_ok):
            p.error(f"--{flag.replace('_', '-')} must be a positive number, got {v}")
    known = [s[0] for s in SETTINGS if s[2] is not None]
    names = [x.strip() for x in args.settings.split(",") if x.strip()]
    bad = [x for x in names if x not in known]
    if bad or not names:
        p.error(f"--settings must name some of {known}, got {args.settings!r}")
    args.settings = names
    width = args.width or SIZES[args.size or "tiny"]["width"]
    heads = args.heads or SIZES[args.size or "tiny"]["heads"]
    if width % heads:
        p.error(f"--width ({width}) must be a multiple of --heads ({heads})")


def config(args: argparse.Namespace) -> dict:
    """The nodes' configuration: the preset (gpu on CUDA, else tiny) under the given flags."""
    cuda = torch.cuda.is_available() and not args.cpu
    cfg = dict(SIZES[args.size or ("gpu" if cuda else "tiny")])
    for key in ("width", "layers", "heads", "context", "batch", "dtype"):
        if getattr(args, key) is not None:
            cfg[key] = getattr(args, key)
    threads = args.threads or max(1, (os.cpu_count() or 1) // args.nodes)
    cfg.update(size=args.size or ("gpu" if cuda else "tiny"), nodes=args.nodes,
               warmup=args.warmup, steps=args.steps, cpu=args.cpu, threads=threads,
               lr_adamw=args.lr_adamw, lr_sgd=args.lr_sgd, profiled_steps=PROFILED_STEPS)
    return cfg


def _report(cfg: dict, done: dict[str, dict], delay_ms: float | None) -> dict:
    figs = {n: figures(n, done) for n, *_ in SETTINGS
            if n in done and next(x for x in SETTINGS if x[0] == n)[3] in done}
    wait = {}
    if delay_ms:
        wait = {n: w for n in figs if (w := wait_figure(n, done, delay_ms)) is not None}
    return {"config": cfg, "peer_delay_ms": delay_ms, "settings": done, "figures": figs,
            "wait": wait, "targets": {"share": TARGET_SHARE, "copies": TARGET_COPIES,
                                      "wait_share": TARGET_WAIT_SHARE}}


def run(args: argparse.Namespace, pool: Any = None) -> tuple[dict, str | None]:
    """Run every planned setting in one world of node processes; (the report, the error that
    stopped it or None). The JSON is written after each setting. ``pool``: a world of
    ``--nodes`` processes to run in (``WorldPool.run``'s interface), else a fresh one."""
    from qcomm.testing.multiprocess import WorldError, WorldPool

    if pool is None:
        with WorldPool(args.nodes, pg_timeout_s=args.timeout_s) as own:
            return run(args, own)
    cfg = config(args)
    order = plan(args.settings, not args.no_slow_peer)
    done: dict[str, dict] = {}
    delay_ms: float | None = None
    error = None
    cuda = torch.cuda.is_available() and not args.cpu
    env = environment(torch.device("cuda", 0) if cuda else torch.device("cpu"))
    report = {**_report(cfg, done, delay_ms), "environment": env}
    deadline = time.monotonic() + (args.time_budget or math.inf)
    for name in order:
        left = deadline - time.monotonic()
        if left <= 0:
            error = (f"--time-budget {args.time_budget:g} s spent: settings not run: "
                     f"{', '.join(order[order.index(name):])}")
            break
        if name.endswith(SLOW) and delay_ms is None:
            base = done[next(x for x in order if not x.endswith(SLOW))]["step_ms"]
            delay_ms = args.peer_delay_ms or max(base, 20.0)
        t0 = time.monotonic()
        limit = min(args.timeout_s, left)
        try:
            runs = pool.run(node, args=(cfg, name, (delay_ms or 0.0) / 1e3), timeout_s=limit)
        except WorldError as e:
            error = f"setting {name} failed (its limit {limit:.0f} s): {e}"
            break
        done[name] = summarize(runs)
        report = {**_report(cfg, done, delay_ms), "environment": env}
        report["complete"] = False
        if args.json:
            write_json(args.json, report)
        print(f"== {name}: {done[name]['step_ms']:.3g} ms per step "
              f"({time.monotonic() - t0:.1f} s)", flush=True)
    report["complete"] = error is None
    report["error"] = error
    if args.json:
        write_json(args.json, report)
    return report, error


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    report, error = run(args)
    print_table(report)
    if error:
        print(f"gpu_step: {error}", file=sys.stderr)
        return 2
    bad = missed(report)
    if bad:
        print("targets missed: " + "; ".join(bad), flush=True)
    if args.check_targets and (args.cpu or not torch.cuda.is_available()):
        print("--check-targets: on CPU every target is n/a (nothing judged)")
    return 1 if (args.check_targets and bad) else 0


if __name__ == "__main__":
    sys.exit(main())
