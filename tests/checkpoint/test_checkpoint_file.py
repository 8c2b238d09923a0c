"""Checkpoint files: loading never runs code from the file (unless trusted), a resume reads each
rank file once, bad files get named errors and change nothing, and files written before the
metadata record existed still resume bit for bit.

Each bad-file case checks, besides the error, that the model's parameters, the optimizer's
state and torch's RNG are exactly what they were before the call.
"""

from __future__ import annotations

import copy
import json
import os
import shutil
from fractions import Fraction
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.distributed as dist

from qcomm.sgd import (
    ASSGD,
    CheckpointError,
    UnsafeCheckpointError,
    checkpoint_path,
    load_checkpoint,
    save_checkpoint,
)
from tests.checkpoint.legacy_checkpoint import make as legacy

LEGACY = Path(__file__).resolve().parent / "legacy_checkpoint"


class _RunsCommand:
    """What a malicious file holds: unpickling it calls ``os.system``."""

    def __init__(self, command: str) -> None:
        self.command = command

    def __reduce__(self):
        return (os.system, (self.command,))


def _trained(steps: int = 3, seed: int = 0) -> tuple[torch.nn.Module, ASSGD]:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(4, 5), torch.nn.BatchNorm1d(5),
                                torch.nn.Linear(5, 2))
    opt = ASSGD(model.parameters(), lr=0.1, momentum=0.9)
    for _ in range(steps):
        opt.zero_grad()
        model(torch.randn(6, 4)).square().mean().backward()
        opt.step()
    return model, opt


class _Snapshot:
    """The model's state, the optimizer's state and the RNG, to compare after a failed load."""

    def __init__(self, model: torch.nn.Module, opt: ASSGD) -> None:
        self.model, self.opt = model, opt
        self.params = {k: v.clone() for k, v in model.state_dict().items()}
        self.state = copy.deepcopy(opt.state_dict())
        self.rng = torch.get_rng_state()

    def unchanged(self) -> bool:
        now = self.model.state_dict()
        same_model = all(torch.equal(now[k], v) for k, v in self.params.items())
        return (same_model and _equal(self.opt.state_dict(), self.state)
                and torch.equal(torch.get_rng_state(), self.rng))


def _equal(a: object, b: object) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(
            _equal(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(
            _equal(x, y) for x, y in zip(a, b, strict=True))
    return a == b


def _rewrite(directory: Path, change, *, record: bool = True) -> None:
    """Rewrite rank 0's file with ``change(payload)`` applied; keep its record in step with the
    new size (so that only the content is at fault) unless ``record`` is False."""
    path = directory / "rank00000.pt"
    payload = torch.load(path, weights_only=True)
    change(payload)
    torch.save(payload, path)
    if record:
        meta_path = path.with_suffix(".json")
        meta = json.loads(meta_path.read_text())
        meta["bytes"] = path.stat().st_size
        meta_path.write_text(json.dumps(meta))


def _fresh() -> tuple[torch.nn.Module, ASSGD, _Snapshot]:
    """A different model and optimizer to load into (trained from another seed, so a load
    that changed anything shows)."""
    model, opt = _trained(steps=2, seed=7)
    torch.manual_seed(1234)   # an RNG state unlike the saved one
    return model, opt, _Snapshot(model, opt)


# ---------------------------------------------------------------------------------------------
# loading runs no code


@pytest.mark.parametrize("with_record", [True, False], ids=["record", "legacy"])
def test_a_file_that_runs_a_command_is_refused_and_the_command_does_not_run(
        tmp_path: Path, with_record: bool) -> None:
    sentinel = tmp_path / "ran"
    model, opt = _trained()
    save_checkpoint(tmp_path / "ckpt", opt, model)
    if not with_record:
        (tmp_path / "ckpt" / "rank00000.json").unlink()

    def inject(payload: dict) -> None:
        payload["extra"] = _RunsCommand(f"touch {sentinel}")

    _rewrite(tmp_path / "ckpt", inject, record=with_record)
    model2, opt2, before = _fresh()
    with pytest.raises(UnsafeCheckpointError, match=r"posix\.system.*trusted=True") as info:
        load_checkpoint(tmp_path / "ckpt", opt2, model2)
    assert info.value.types == ["posix.system"]
    assert isinstance(info.value, CheckpointError) and isinstance(info.value, ValueError)
    assert not sentinel.exists()
    assert before.unchanged()


def test_loads_use_the_weights_only_unpickler_unless_trusted(tmp_path, monkeypatch) -> None:
    model, opt = _trained()
    save_checkpoint(tmp_path, opt, model)
    calls: list[bool] = []
    real = torch.load

    def recording(*args, **kwargs):
        calls.append(kwargs.get("weights_only"))
        return real(*args, **kwargs)

    monkeypatch.setattr(torch, "load", recording)
    model2, opt2, _ = _fresh()
    load_checkpoint(tmp_path, opt2, model2)
    assert calls == [True]          # one read of the rank file, weights only
    load_checkpoint(tmp_path, opt2, model2, trusted=True)
    assert calls == [True, False]
    (tmp_path / "rank00000.json").unlink()   # a file without a record: still read once
    load_checkpoint(tmp_path, opt2, model2)
    assert calls == [True, False, True]


def test_extra_with_other_objects_needs_trusted_and_changes_nothing_without(tmp_path) -> None:
    model, opt = _trained()
    with pytest.warns(UserWarning, match=r"fractions\.Fraction.*trusted=True"):
        save_checkpoint(tmp_path, opt, model, extra={"epoch": Fraction(1, 3)})
    model2, opt2, before = _fresh()
    with pytest.raises(UnsafeCheckpointError, match=r"fractions\.Fraction.*trusted=True"):
        load_checkpoint(tmp_path, opt2, model2)
    assert before.unchanged()
    assert load_checkpoint(tmp_path, opt2, model2, trusted=True) == {"epoch": Fraction(1, 3)}
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(),
                                                 model2.state_dict().values(), strict=True))


def test_plain_extra_is_returned_as_saved_without_a_warning(tmp_path, recwarn) -> None:
    model, opt = _trained()
    extra = {"epoch": 3, "loader": [1, 2, (3, "x")], "t": torch.arange(3), "none": None,
             "flag": True, "lr": 0.5}
    save_checkpoint(tmp_path, opt, model, extra=extra)
    assert not [w for w in recwarn if "safe loader" in str(w.message)]
    model2, opt2, _ = _fresh()
    assert _equal(load_checkpoint(tmp_path, opt2, model2), extra)


def test_trusted_must_be_a_bool(tmp_path) -> None:
    model, opt = _trained()
    save_checkpoint(tmp_path, opt, model)
    with pytest.raises(TypeError, match="trusted"):
        load_checkpoint(tmp_path, opt, model, trusted="yes")


# ---------------------------------------------------------------------------------------------
# bad files: named errors, nothing changed


def _saved(tmp_path: Path) -> Path:
    model, opt = _trained()
    save_checkpoint(tmp_path / "ckpt", opt, model)
    return tmp_path / "ckpt"


def _truncate(d: Path) -> None:
    data = (d / "rank00000.pt").read_bytes()
    (d / "rank00000.pt").write_bytes(data[: len(data) // 2])


def _truncate_legacy(d: Path) -> None:
    (d / "rank00000.json").unlink()
    _truncate(d)


def _garbage(d: Path) -> None:
    (d / "rank00000.pt").write_bytes(os.urandom(4096))
    (d / "rank00000.json").unlink()


def _garbage_record(d: Path) -> None:
    (d / "rank00000.json").write_text("{not json")


def _record_of_another_save(d: Path) -> None:
    meta = json.loads((d / "rank00000.json").read_text())
    meta["steps"] += 1
    (d / "rank00000.json").write_text(json.dumps(meta))


def _replaced_file(d: Path) -> None:
    # Another save's rank file (same size, other save_id) under the old record.
    record = (d / "rank00000.json").read_text()
    model, opt = _trained()
    save_checkpoint(d, opt, model)
    (d / "rank00000.json").write_text(record)


def _record_of_another_rank(d: Path) -> None:
    meta = json.loads((d / "rank00000.json").read_text())
    meta["rank"] = 1
    (d / "rank00000.json").write_text(json.dumps(meta))


def _not_a_checkpoint(d: Path) -> None:
    torch.save({"weights": torch.ones(3)}, d / "rank00000.pt")
    (d / "rank00000.json").unlink()


def _bad_rng(d: Path) -> None:
    _rewrite(d, lambda p: p.__setitem__("rng", torch.zeros(3)))


_DAMAGES = [
    (_truncate, r"has \d+ bytes but its record .* says \d+: the file was truncated"),
    (_truncate_legacy, r"not a readable checkpoint \(truncated or corrupted\)"),
    (_garbage, r"not a torch checkpoint"),
    (_garbage_record, r"rank00000\.json is not a qcomm checkpoint record"),
    (_record_of_another_save, r"disagrees with rank00000\.pt on steps"),
    (_replaced_file, r"disagrees with rank00000\.pt on save_id"),
    (_record_of_another_rank, r"belongs to rank 1, but it is the record of rank00000\.pt"),
    (_not_a_checkpoint, r"is not a qcomm checkpoint \(expected a dict"),
    (_bad_rng, r"random-number state"),
]


@pytest.mark.parametrize(("damage", "message"), _DAMAGES,
                         ids=[d.__name__.strip("_") for d, _ in _DAMAGES])
def test_a_bad_file_raises_a_named_error_and_changes_nothing(tmp_path, damage, message) -> None:
    directory = _saved(tmp_path)
    damage(directory)
    model2, opt2, before = _fresh()
    with pytest.raises(CheckpointError, match=message) as info:
        load_checkpoint(directory, opt2, model2)
    assert info.value.path.parent == directory
    assert before.unchanged()


@pytest.mark.parametrize("seed", range(40))
def test_garbage_of_any_bytes_is_named_not_a_torch_checkpoint(tmp_path, seed) -> None:
    """Random bytes stop the unpickler in many places (UnpicklingError, IndexError, ...); every
    one of them is named as garbage, never as a damaged checkpoint."""
    directory = _saved(tmp_path)
    rng = np.random.default_rng(seed)
    (directory / "rank00000.pt").write_bytes(rng.integers(0, 256, 4096, dtype=np.uint8).tobytes())
    (directory / "rank00000.json").unlink()
    model2, opt2, before = _fresh()
    with pytest.raises(CheckpointError, match="not a torch checkpoint"):
        load_checkpoint(directory, opt2, model2)
    assert before.unchanged()


def test_a_model_that_does_not_fit_the_file_changes_nothing(tmp_path) -> None:
    directory = _saved(tmp_path)
    torch.manual_seed(0)
    other = torch.nn.Sequential(torch.nn.Linear(4, 5), torch.nn.BatchNorm1d(5),
                                torch.nn.Linear(5, 3))   # last layer of another width
    opt = ASSGD(other.parameters(), lr=0.1, momentum=0.9)
    before = _Snapshot(other, opt)
    with pytest.raises(CheckpointError, match=r"'2\.weight' has shape \(3, 5\).*\(2, 5\)"):
        load_checkpoint(directory, opt, other)
    assert before.unchanged()


def test_a_file_saved_without_a_model_refuses_one_and_changes_nothing(tmp_path) -> None:
    _, opt = _trained()
    save_checkpoint(tmp_path, opt)
    model2, opt2, before = _fresh()
    with pytest.raises(CheckpointError, match="saved with model=None"):
        load_checkpoint(tmp_path, opt2, model2)
    assert before.unchanged()


# ---------------------------------------------------------------------------------------------
# files of another rank, and files written before the metadata record (2 ranks, Gloo)


def _other_rank_body(rank: int, world: int, directory: str, copy_record: bool) -> str:
    model, opt = _trained(seed=rank)
    save_checkpoint(directory, opt, model)
    opt.close()
    dist.barrier()
    if rank == 0:
        d = Path(directory)
        shutil.copy(d / "rank00001.pt", d / "rank00000.pt")
        if copy_record:
            shutil.copy(d / "rank00001.json", d / "rank00000.json")
    dist.barrier()
    model2, opt2, before = _fresh()
    try:
        load_checkpoint(directory, opt2, model2)
    except CheckpointError as exc:
        assert before.unchanged()
        return str(exc)
    finally:
        opt2.close()
    return "loaded"


@pytest.mark.parametrize("copy_record", [True, False], ids=["with-record", "file-only"])
def test_another_ranks_file_is_refused(gloo, tmp_path, copy_record) -> None:
    out = gloo.run(_other_rank_body, 2, args=(str(tmp_path), copy_record))
    assert out[1] == "loaded"
    expected = "belongs to rank 1" if copy_record else "disagrees with rank00000.pt on"
    assert expected in out[0], out[0]


def _legacy_body(rank: int, world: int, fixture: str, resaved: str) -> dict:
    steps = range(legacy.STEPS, legacy.STEPS + 3)
    # The run the fixture was cut from, uninterrupted, with today's code.
    saved = torch.load(Path(fixture) / f"rank{rank:05d}.pt", weights_only=True)
    full = legacy.model()
    opt = ASSGD(full.parameters(), **legacy.OPTIONS)
    legacy.train(full, opt, rank, range(legacy.STEPS))
    # The fixture's bits come from the machine that wrote it: a CPU whose float kernels round
    # otherwise (AVX-512 against AVX2 matmuls) reaches step 5 with other bits, and "the bits of
    # the uninterrupted run" means nothing there.
    same_machine = all(torch.equal(v, saved["model"][k]) for k, v in full.state_dict().items())
    legacy.train(full, opt, rank, range(legacy.STEPS, legacy.STEPS + 3))
    opt.close()
    # Resumed from the old file (plain data: the safe loader reads it).
    net = legacy.model()
    opt = ASSGD(net.parameters(), **legacy.OPTIONS)
    torch.manual_seed(99)
    extra = load_checkpoint(fixture, opt, net)
    loaded = (all(torch.equal(v, saved["model"][k]) for k, v in net.state_dict().items())
              and torch.equal(torch.get_rng_state(), saved["rng"]))
    save_checkpoint(resaved, opt, net, extra=extra)     # today's format, the same state
    legacy.train(net, opt, rank, steps)
    opt.close()
    # Resumed from the re-saved file.
    net2 = legacy.model()
    opt2 = ASSGD(net2.parameters(), **legacy.OPTIONS)
    load_checkpoint(resaved, opt2, net2)
    legacy.train(net2, opt2, rank, steps)
    opt2.close()

    def same(a, b):
        return all(torch.equal(x, y) for x, y in zip(a.parameters(), b.parameters(),
                                                       strict=True))

    return {"extra": extra, "loaded": loaded, "same_machine": same_machine,
            "as_uninterrupted": same(net, full), "as_resaved": same(net, net2)}


def test_a_file_written_before_records_existed_resumes_bit_exact(gloo, tmp_path) -> None:
    """The fixture was written by the code before metadata records (2 nodes x 1 rank, lockstep
    4-bit gossip with a round in flight, step 5): it loads with the safe loader, and 3 more
    steps give the bits of a run resumed from a re-save and, on a machine that computes the
    fixture's first 5 steps bit for bit, of today's uninterrupted run. (A deliberate change of
    the lockstep gossip's arithmetic would need the fixture rewritten: see its make.py.)"""
    fixture = tmp_path / "plain"
    shutil.copytree(LEGACY / "plain", fixture)
    out = gloo.run(_legacy_body, 2, args=(str(fixture), str(tmp_path / "resaved")))
    for r in out:
        assert r["extra"] == {"step": legacy.STEPS}
        assert r["loaded"] and r["as_resaved"], r
        assert r["as_uninterrupted"] or not r["same_machine"], r


def test_an_old_file_with_other_objects_needs_trusted_and_says_why() -> None:
    # Rank 0's file alone (this process is one rank): the world-size check comes after the
    # file is read, so the refusal is about the file's content.
    model = legacy.model()
    opt = ASSGD(model.parameters(), **legacy.OPTIONS)
    before = _Snapshot(model, opt)
    with pytest.raises(UnsafeCheckpointError,
                       match=r"fractions\.Fraction.*trusted=True.*saved no metadata record"):
        load_checkpoint(LEGACY / "fraction", opt, model)
    assert before.unchanged()
    with pytest.raises(ValueError, match="world size 2"):
        load_checkpoint(LEGACY / "fraction", opt, model, trusted=True)
    extra = load_checkpoint(LEGACY / "fraction", opt, model, trusted=True,
                            on_world_size_change="reinit")
    assert extra == Fraction(1, 3)


@pytest.mark.parametrize(("rank", "error"), [(-1, ValueError), ("0", TypeError),
                                             (1.0, TypeError), (True, TypeError)])
def test_a_rank_files_path_takes_a_rank_and_names_it_otherwise(tmp_path, rank, error) -> None:
    """A negative rank made ``rank-0001.pt`` (a file no load would look for), a string a
    format error that named no argument."""
    with pytest.raises(error, match=r"rank must be an int >= 0, got"):
        checkpoint_path(tmp_path, rank)
    assert checkpoint_path(tmp_path, np.int64(3)) == tmp_path / "rank00003.pt"
