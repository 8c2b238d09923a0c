"""examples/train_charlm.py as two machines would run it: two torchrun agents on localhost,
joined by c10d rendezvous, one process each, each with its own checkpoint directory (no shared
filesystem). Each agent gives its own ``--local-addr`` (127.0.0.1, 127.0.0.2), as two hosts
would have two addresses: torchrun orders the nodes by it, so the ranks survive the restart.

Checked: both agents exit 0; the validation loss falls and is finite; both ranks end with the
same parameters after the final average; and a run resumed from the step-4 checkpoints (each
agent reading only its own directory), named or found by ``--resume latest`` (the newest step
both machines hold), ends with exactly the bytes of the uninterrupted run.
"""

from __future__ import annotations

import contextlib
import importlib.util
import math
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from qcomm.checkpoint.checkpoint_file import checkpoint_path
from qcomm.testing.multiprocess import descendants, free_ports

REPO = Path(__file__).resolve().parents[2]
EXAMPLE = REPO / "examples" / "train_charlm.py"
TORCHRUN = Path(sys.executable).with_name("torchrun")
ADDRS = ("127.0.0.1", "127.0.0.2")  # node rank 0 and 1: torchrun sorts the nodes by address
TINY = ["--width", "32", "--layers", "1", "--heads", "2", "--context", "32", "--batch-size",
        "8", "--steps", "8", "--log-every", "4", "--val-windows", "32", "--timeout-s", "60"]
LAUNCH_TIMEOUT_S = 150  # a hang fails the test instead of stalling the suite


def _stop(procs: list[subprocess.Popen]) -> None:
    """SIGTERM the agents (torchrun then stops its workers), SIGKILL whatever remains."""
    pids = [d for p in procs if p.poll() is None for d in descendants(p.pid)]
    for p in procs:
        if p.poll() is None:
            p.terminate()
    deadline = time.monotonic() + 15
    for p in procs:
        try:
            p.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            p.kill()
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)


def _launch(tmp: Path, run_id: str, extra: list[list[str]],
            start_order: tuple[int, ...] = (0, 1)) -> list[str]:
    """Both agents of one job (agent i on address ``ADDRS[i]``, started in ``start_order``),
    ``extra[i]`` appended to agent i's script arguments; returns each agent's output (stdout
    and stderr) once both have exited 0."""
    return _launch_together(tmp, [(run_id, extra, start_order)])[0]


def _launch_together(tmp: Path, jobs: list[tuple[str, list[list[str]], tuple[int, ...]]]
                     ) -> list[list[str]]:
    """Jobs of :func:`_launch` (its arguments, one tuple per job) run at the same time, each on
    its own port: each job's agents' outputs once every agent has exited 0. (Independent
    jobs overlap their agents' tens of seconds of start and exit.)"""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        [str(REPO), *filter(None, [os.environ.get("PYTHONPATH")])]), OMP_NUM_THREADS="1")
    logs = {run_id: [tmp / f"{run_id}-agent{i}.log" for i in range(len(ADDRS))]
            for run_id, _, _ in jobs}
    procs: dict[str, list[subprocess.Popen]] = {}
    try:
        for (run_id, extra, start_order), port in zip(jobs, free_ports(len(jobs)),
                                                     strict=True):
            started: dict[int, subprocess.Popen] = {}
            for i in start_order:
                with open(logs[run_id][i], "w") as f:
                    started[i] = subprocess.Popen(
                        [str(TORCHRUN), "--nnodes", "2", "--nproc-per-node", "1",
                         "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}",
                         "--rdzv-id", run_id, "--local-addr", ADDRS[i], "--max-restarts", "0",
                         str(EXAMPLE), *TINY, *extra[i]],
                        cwd=tmp, env=env, stdout=f, stderr=subprocess.STDOUT,
                        start_new_session=True)
                procs[run_id] = [started[k] for k in sorted(started)]
        every = [p for job in procs.values() for p in job]
        deadline = time.monotonic() + LAUNCH_TIMEOUT_S
        # Poll them all: an agent that failed leaves the other waiting for it until a timeout.
        while any(p.poll() is None for p in every) and time.monotonic() < deadline \
                and all(p.returncode in (None, 0) for p in every):
            time.sleep(0.2)
        # None: still running, stopped below
        codes = {run_id: [p.poll() for p in job] for run_id, job in procs.items()}
    finally:
        _stop([p for job in procs.values() for p in job])
    for run_id, job_codes in codes.items():
        if job_codes != [0] * len(ADDRS):
            outputs = "\n".join(f"--- agent {i}\n{log.read_text()[-3000:]}"
                                 for i, log in enumerate(logs[run_id]))
            pytest.fail(f"{run_id}: exit codes {job_codes} (None: still running after "
                        f"{LAUNCH_TIMEOUT_S} s, or stopped when another failed)\n{outputs}")
    return [[log.read_text() for log in logs[run_id]] for run_id, _, _ in jobs]


def _digest(output: str, rank: int) -> str:
    found = re.findall(rf"rank {rank}: parameters sha256 ([0-9a-f]{{64}})(?![0-9a-f])", output)
    assert len(found) == 1, output[-4000:]
    return found[0]


def _val_loss(output: str, step: int) -> float:
    found = re.findall(rf"^validation loss at step {step}: (\S+) ", output, re.M)
    assert len(found) == 1, output[-4000:]
    return float(found[0])


def test_two_agents_train_average_and_resume_exactly(tmp_path: Path) -> None:
    if not TORCHRUN.exists():
        pytest.skip(f"no torchrun next to {sys.executable}")
    dirs = [tmp_path / f"host{i}" for i in range(2)]
    full = _launch(tmp_path, "full",
                   [["--ckpt-dir", str(d), "--save-every", "4"] for d in dirs])

    # The layout is two nodes (one per agent), and the gossip crossed between them.
    assert "qcomm: 2 nodes x 1 rank;" in full[0], full[0][-4000:]
    inter = re.findall(r"^bytes sent by all ranks: ([\d,]+) between nodes", full[0], re.M)
    assert inter and int(inter[0].replace(",", "")) > 0, full[0][-4000:]
    before, after = _val_loss(full[0], 0), _val_loss(full[0], 8)
    assert math.isfinite(after) and after < before - 0.1, (before, after)
    # Both ranks hold the same parameters after average_parameters() (two separate one-rank
    # worlds, or a broken average, would differ: every rank draws its own batches).
    digest = _digest(full[0], 0)
    assert _digest(full[1], 1) == digest

    # No shared filesystem: each agent wrote only its own rank's files.
    for rank, d in enumerate(dirs):
        assert sorted(p.name for p in (d / "step0000004").iterdir()) == [
            f"rank{rank:05d}.json", f"rank{rank:05d}.pt"]

    # Two jobs at once (independent: "resumed" reads only step 4, which "latest" does not
    # write). Restarted from step 4, each agent from its own directory, started in the other
    # order: the same ranks (by address) and the same final bytes as the uninterrupted run.
    # As a job restarted by torchrun runs again: --resume latest. Machine 1 died while it
    # wrote its step-8 checkpoint (no record beside the file): both resume from step 4, the
    # newest step both hold, and end with the uninterrupted run's bytes.
    (dirs[1] / "step0000008" / "rank00001.json").unlink()
    resumed, latest = _launch_together(tmp_path, [
        ("resumed", [["--resume", str(d / "step0000004")] for d in dirs], (1, 0)),
        ("latest", [["--ckpt-dir", str(d), "--resume", "latest"] for d in dirs], (0, 1))])
    assert "resumed from" in resumed[0] and "at step 4" in resumed[0], resumed[0][-4000:]
    assert _digest(resumed[0], 0) == digest
    assert _digest(resumed[1], 1) == digest
    assert f"resumed from {dirs[0] / 'step0000004'} at step 4" in latest[0], latest[0][-4000:]
    assert _digest(latest[0], 0) == digest
    assert _digest(latest[1], 1) == digest


def test_resume_latest_with_nothing_saved_starts_at_step_0_and_needs_a_directory(
        tmp_path: Path) -> None:
    env = dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS="1")
    run = lambda *extra: subprocess.run([sys.executable, str(EXAMPLE), *TINY, *extra], env=env,
                                        capture_output=True, text=True, timeout=120)
    fresh = run("--ckpt-dir", str(tmp_path / "none"), "--resume", "latest")
    assert fresh.returncode == 0, fresh.stderr[-3000:]
    assert f"no checkpoint under {tmp_path / 'none'}: starting at step 0" in fresh.stdout
    assert (tmp_path / "none" / "step0000008" / "rank00000.pt").is_file()
    bad = run("--resume", "latest")
    assert bad.returncode == 2 and "--resume latest looks under --ckpt-dir" in bad.stderr


def test_a_stop_file_ends_the_run_at_the_next_logged_step_as_its_end(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """--stop-file: once the file exists the run ends at the next --log-every step and does
    there what it does at --steps (the final average, validation loss and checkpoint of that
    step); under torchrun it needs --wait-free (lockstep nodes would stop at different steps:
    refused by its argument checks, here in this process, before any process group)."""
    env = dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS="1")
    stop = tmp_path / "stop"
    stop.touch()
    args = [*TINY, "--steps", "1000", "--ckpt-dir", str(tmp_path / "ck"), "--stop-file",
            str(stop)]
    run = subprocess.run([sys.executable, str(EXAMPLE), *args], env=env, capture_output=True,
                         text=True, timeout=120)
    assert run.returncode == 0, run.stderr[-3000:]
    assert re.search(rf"^step 4/1000: .*\nstopped at step 4 of 1000: {re.escape(str(stop))} "
                     r"exists\n", run.stdout, re.M), run.stdout[-3000:]
    assert math.isfinite(_val_loss(run.stdout, 4)), run.stdout[-3000:]
    assert "step 8/1000" not in run.stdout, run.stdout[-3000:]
    assert sorted(p.name for p in (tmp_path / "ck").iterdir()) == ["step0000004"]
    example = _example_module(monkeypatch)
    monkeypatch.setenv("RANK", "0")
    with pytest.raises(SystemExit) as refused:
        example.main(args)
    assert refused.value.code == 2
    assert "--stop-file needs --wait-free" in capsys.readouterr().err


def _example_module(monkeypatch: pytest.MonkeyPatch) -> Any:
    """examples/train_charlm.py imported in this process."""
    spec = importlib.util.spec_from_file_location("train_charlm", EXAMPLE)
    example = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, "train_charlm", example)   # its dataclasses look it up
    spec.loader.exec_module(example)
    return example


@pytest.mark.parametrize("value", ["-1", "nan", "inf", "60001"])
def test_compute_ms_out_of_range_is_refused_naming_it(
        value: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    example = _example_module(monkeypatch)
    with pytest.raises(SystemExit) as refused:
        example.main([*TINY, "--compute-ms", value])
    assert refused.value.code == 2
    err = capsys.readouterr().err
    assert "--compute-ms must be a number of milliseconds from 0 to 60000" in err, err


def test_compute_ms_paces_every_step(monkeypatch: pytest.MonkeyPatch,
                                     capfd: pytest.CaptureFixture[str]) -> None:
    """--compute-ms 50: each step sleeps 50 ms after its backward, so no logged rate reaches
    20 steps/s (a lower bound on the time, whatever the machine), and the run ends as any."""
    example = _example_module(monkeypatch)
    monkeypatch.delenv("RANK", raising=False)
    assert example.main([*TINY, "--steps", "8", "--log-every", "4", "--compute-ms", "50"]) == 0
    out = capfd.readouterr().out   # the digest line goes to the file descriptor itself
    rates = [float(r) for r in re.findall(r"^step \d+/8: .* ([\d.]+) steps/s$", out, re.M)]
    assert len(rates) == 2 and all(r < 20 for r in rates), out[-3000:]
    assert math.isfinite(_val_loss(out, 8)), out[-3000:]


def test_a_job_restarted_by_its_torchrun_resumes_from_its_newest_checkpoint(
        tmp_path: Path) -> None:
    """One torchrun of two processes, --max-restarts 1 and --resume latest: rank 1 is killed
    after the step-100 checkpoint, torchrun starts both again and they go on from it. (torch's
    agent keeps its store across restarts: the restarted ranks' group must not read their
    predecessors' addresses, or its Gloo connect is refused.) The kill waits for rank 1's own
    record of that checkpoint too: the gossip is wait-free, and on a loaded machine rank 0
    logged step 150 while rank 1 had not written its part of step 100 yet (the restart then
    found no checkpoint every rank held and started at step 0)."""
    if not TORCHRUN.exists():
        pytest.skip(f"no torchrun next to {sys.executable}")
    env = dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS="1")
    log = tmp_path / "job.log"
    flags = [*TINY[:TINY.index("--steps")], "--steps", "400", "--log-every", "10",
             "--val-windows", "32", "--wait-free", "--timeout-s", "20", "--procs-per-node",
             "1", "--ckpt-dir", str(tmp_path / "ck"), "--save-every", "100", "--resume",
             "latest"]
    with open(log, "w") as f:
        agent = subprocess.Popen([str(TORCHRUN), "--standalone", "--nproc-per-node", "2",
                                  "--max-restarts", "1", str(EXAMPLE), *flags], env=env,
                                 stdout=f, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        deadline = time.monotonic() + LAUNCH_TIMEOUT_S
        # the record a rank writes after its file (what --resume latest looks for)
        rank1_saved = checkpoint_path(tmp_path / "ck" / "step0000100", 1).with_suffix(".json")
        while not (re.search(r"^step 150/400", log.read_text(), re.M) and rank1_saved.exists()):
            assert time.monotonic() < deadline and agent.poll() is None, log.read_text()[-3000:]
            time.sleep(0.1)
        for pid in descendants(agent.pid):
            with contextlib.suppress(OSError):
                environ = b"\0" + Path(f"/proc/{pid}/environ").read_bytes()
                if b"\0RANK=1\0" in environ:
                    os.kill(pid, signal.SIGKILL)
        code = agent.wait(timeout=LAUNCH_TIMEOUT_S)
    finally:
        _stop([agent])
    out = log.read_text()
    assert code == 0, out[-3000:]
    assert re.search(r"^resumed from .*step0000[12]00 at step [12]00$", out, re.M), out[-3000:]
    assert len({d for d in re.findall(r"parameters sha256 ([0-9a-f]{64})", out)}) == 1
