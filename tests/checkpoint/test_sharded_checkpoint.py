"""DCP checkpoints (qcomm/checkpoint/sharded_checkpoint.py) in one process: a run resumed from one
ends with the bits of the run that did not stop; loading runs no code from the files; a checkpoint
that is not one, or has no state of this rank, is a named error. The sharded runs over Gloo are
tests/examples/test_train_charlm_fsdp.py's."""

from __future__ import annotations

import warnings
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp

from qcomm.sgd import (
    CheckpointError,
    HierarchicalOptimizer,
    UnsafeCheckpointError,
    load_sharded_checkpoint,
    save_sharded_checkpoint,
)

warnings.filterwarnings("ignore", message=".*torch.distributed is disabled.*")


def _run(steps: int, start: tuple[torch.nn.Module, HierarchicalOptimizer] | None = None,
         ) -> tuple[torch.nn.Module, HierarchicalOptimizer]:
    if start is None:
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
        opt = HierarchicalOptimizer(torch.optim.AdamW(model.parameters(), lr=1e-2))
    else:
        model, opt = start
    for _ in range(steps):
        x = torch.randn(4, 8)   # the global generator: its state is part of the checkpoint
        opt.zero_grad()
        model(x).pow(2).mean().backward()
        opt.step()
    return model, opt


def _fresh() -> tuple[torch.nn.Module, HierarchicalOptimizer]:
    torch.manual_seed(123)  # other parameters and RNG: the load must bring them back
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
    return model, HierarchicalOptimizer(torch.optim.AdamW(model.parameters(), lr=1e-2))


def test_a_resumed_run_ends_with_the_bits_of_the_run_that_did_not_stop(tmp_path: Path) -> None:
    model, opt = _run(5)
    save_sharded_checkpoint(tmp_path / "ck", opt, model, extra={"step": 5, "tag": ("a", 1)})
    whole, _ = _run(5, (model, opt))
    resumed = _fresh()
    extra = load_sharded_checkpoint(tmp_path / "ck", resumed[1], resumed[0])
    assert extra == {"step": 5, "tag": ("a", 1)}
    assert resumed[1].engine.steps == 5
    _run(5, resumed)
    for a, b in zip(whole.parameters(), resumed[0].parameters(), strict=True):
        assert torch.equal(a, b)


class _Sentinel:
    """An object whose unpickling would create a file (what a malicious checkpoint does)."""

    def __init__(self, path: str) -> None:
        self.path = path

    def __reduce__(self):
        return (Path.touch, (Path(self.path),))


def test_an_item_that_would_run_code_is_refused(tmp_path: Path,
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    """A checkpoint whose optimizer learning rate is an object that runs code when unpickled
    (DCP pickles what is not a tensor, and its own loader unpickles it with
    ``weights_only=False``): refused, the code not run, the model untouched."""
    import torch.distributed.checkpoint.state_dict as sc  # where the save looks it up

    model, opt = _run(1)
    sentinel = tmp_path / "ran"
    real = sc.get_optimizer_state_dict

    def poisoned(m, o):
        state = real(m, o)
        state["param_groups"][0]["lr"] = _Sentinel(str(sentinel))
        return state

    monkeypatch.setattr(sc, "get_optimizer_state_dict", poisoned)
    save_sharded_checkpoint(tmp_path / "ck", opt, model)
    monkeypatch.setattr(sc, "get_optimizer_state_dict", real)
    target = _fresh()
    before = [p.detach().clone() for p in target[0].parameters()]
    with pytest.raises(UnsafeCheckpointError, match="weights-only unpickler refuses"):
        load_sharded_checkpoint(tmp_path / "ck", target[1], target[0])
    assert not sentinel.exists()
    assert target[1].engine.steps == 0 and not target[1].optimizer.state
    assert all(torch.equal(a, b) for a, b in zip(before, target[0].parameters(), strict=True))


def test_not_a_checkpoint_and_another_jobs_are_named_errors(tmp_path: Path) -> None:
    model, opt = _fresh()
    (tmp_path / "empty").mkdir()
    with pytest.raises(CheckpointError, match="is not a DCP checkpoint"):
        load_sharded_checkpoint(tmp_path / "empty", opt, model)
    dcp.save({"model": model.state_dict()}, checkpoint_id=str(tmp_path / "plain"))
    with pytest.raises(CheckpointError, match="holds no qcomm state of rank 0"):
        load_sharded_checkpoint(tmp_path / "plain", opt, model)


def test_extra_of_another_type_is_refused_before_anything_is_written(tmp_path: Path) -> None:
    model, opt = _run(1)
    with pytest.raises(TypeError, match=r"state\['extra'\] is a object"):
        save_sharded_checkpoint(tmp_path / "ck", opt, model, extra=object())
    assert not (tmp_path / "ck").exists()


def test_importing_the_optimizer_leaves_dcp_and_dtensor_unimported() -> None:
    """``import qcomm.sgd`` (which re-exports the sharded checkpoints' functions) imports
    neither torch.distributed.checkpoint nor DTensor: they take about 0.6 s, a third of the
    import, paid by every process of a job whose checkpoints are per-rank files. The first
    sharded save or load imports them."""
    import subprocess
    import sys

    code = ("import sys, qcomm.sgd, qcomm.checkpoint\n"
            "heavy = sorted(m for m in sys.modules if m.startswith(("
            "'torch.distributed.checkpoint', 'torch.distributed.tensor')))\n"
            "assert not heavy, heavy\n")
    root = Path(__file__).resolve().parents[2]
    proc = subprocess.run([sys.executable, "-c", code], cwd=root, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
