"""How long a resume takes to load one rank's checkpoint file.

    python bench/checkpoint_resume.py --mb 500                 # this checkout
    python bench/checkpoint_resume.py --mb 500 --qcomm OTHER   # another version, same figures

One process (world size 1): an ``ASSGD`` with momentum over a model of ``--mb`` MB of float32
parameters and momentum together (half each), saved once with ``save_checkpoint`` into
``--dir`` (kept between runs of the same version: each version writes its own directory), then
``load_checkpoint`` into a fresh optimizer and model ``--repeat`` times. The figure is the median
wall time of a load, with every load's time beside it; the file is in the page cache after the
save, so this measures parsing and copying, not the disk. For a before/after comparison, run
both versions alternately (one process each: both are the package ``qcomm``).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path


def _model(numel: int):
    import torch

    # One big parameter and one small one: the file's size is the parameters'.
    return torch.nn.ParameterList([torch.nn.Parameter(torch.zeros(numel)),
                                   torch.nn.Parameter(torch.zeros(7))])


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        description="Median wall time of load_checkpoint on one rank's file of a given size.")
    ap.add_argument("--mb", type=float, default=500.0,
                    help="megabytes of the checkpoint's tensors (parameters + momentum), "
                         "default 500.")
    ap.add_argument("--repeat", type=int, default=3, help="timed loads (default 3).")
    ap.add_argument("--dir", default=None,
                    help="where the checkpoint is written (default bench/out/checkpoint-<MB>"
                         "-<version tag>); reused when it already holds one.")
    ap.add_argument("--qcomm", default=None,
                    help="a checkout whose qcomm package runs instead of this one's (for "
                         "before/after comparisons).")
    args = ap.parse_args(argv)
    if args.mb <= 0 or args.repeat < 1:
        ap.error(f"--mb must be > 0 and --repeat >= 1, got {args.mb} and {args.repeat}")
    sys.path.append(str(Path(__file__).resolve().parent.parent))
    from bench.common import REPO_ROOT, cpu_model, load_average, use_qcomm_from

    use_qcomm_from(args.qcomm)
    import torch

    import qcomm
    from qcomm.sgd import ASSGD, load_checkpoint, save_checkpoint

    source = Path(qcomm.__file__).resolve().parent.parent
    numel = int(args.mb * 1e6 / 8)   # float32 parameters and as many momentum values
    tag = "other" if args.qcomm else "this"
    directory = Path(args.dir) if args.dir else (
        REPO_ROOT / "bench" / "out" / f"checkpoint-{args.mb:g}mb-{tag}")
    print(f"# qcomm from {source}; cpu {cpu_model()}; load {load_average()}")
    if not any(directory.glob("rank*.pt")):
        model = _model(numel)
        opt = ASSGD(model.parameters(), lr=0.1, momentum=0.9)
        for p in model.parameters():
            p.grad = torch.ones_like(p)
        opt.step()
        save_checkpoint(directory, opt, model, extra={"step": 1})
    size = sum(f.stat().st_size for f in directory.iterdir())
    times = []
    for _ in range(args.repeat):
        model = _model(numel)
        opt = ASSGD(model.parameters(), lr=0.1, momentum=0.9)
        t0 = time.perf_counter()
        load_checkpoint(directory, opt, model)
        times.append(time.perf_counter() - t0)
        del model, opt
    print(f"files {size / 1e6:.1f} MB in {directory}: load {statistics.median(times):.3f} s "
          f"median (loads: {', '.join(f'{t:.3f}' for t in times)})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
