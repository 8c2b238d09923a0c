"""bench/finish_line.py: its variants (the named ones and the peers' tuning grid), the slow
member, and the refusals of what it cannot run."""

from __future__ import annotations

import json

import pytest

from bench import finish_line as F


def test_the_peers_tuning_grid_names_what_it_runs() -> None:
    v = F.variant("diloco-h64-o9-m5")
    assert (v.kind, v.period, v.outer_lr, v.outer_momentum) == ("diloco", 64, 0.9, 0.5)
    v = F.variant("local-sgd-p16")
    assert (v.kind, v.period) == ("local-sgd", 16)
    assert F.variant("diloco") is F.VARIANTS["diloco"]
    for bad in ("diloco-h0-o7-m5", "diloco-h32-o0-m5", "diloco-h32-o7-m10", "local-sgd-p0",
                "diloco-h32", "nope"):
        assert F.variant(bad) is None, bad


@pytest.mark.parametrize(("argv", "words"), [
    (["--variants", "diloco-h0-o7-m5"], "unknown variant 'diloco-h0-o7-m5'"),
    (["--variants", "slow-link,diloco", "--slow-member", "2"], "--slow-member"),
    (["--variants", "lockstep", "--slow-member", "2"], "--slow-member"),
    (["--variants", "slow-link", "--slow-member", "0"], "--slow-member"),
])
def test_what_it_cannot_run_is_refused_by_name(argv, words, capsys) -> None:
    with pytest.raises(SystemExit) as e:
        F.main(argv)
    assert e.value.code == 2 and words in capsys.readouterr().err


def _run(tmp_path, *extra: str) -> list[dict]:
    out = tmp_path / "runs.json"
    assert F.main(["--steps", "24", "--seeds", "1", "--width", "16", "--num-samples", "600",
                   "--marks", "12,24", "--json", str(out), *extra]) == 0
    return json.loads(out.read_text())


def test_a_slow_member_changes_the_run_and_the_anneal_by_the_jobs_progress_shows(tmp_path
                                                                                 ) -> None:
    variants = "slow-link-total,slow-link-total-own"
    healthy = _run(tmp_path, "--variants", variants)
    slow = _run(tmp_path, "--variants", variants, "--slow-member", "2")
    final = {(r["variant"]): r["final"] for r in healthy}
    # with every member at full speed nobody is ahead of anybody: the two anneals are one
    assert final["slow-link-total"] == final["slow-link-total-own"]
    # with the last member at half speed, its outer step anneals with the job's progress,
    # not with its own steps: the two runs part
    ends = {r["variant"]: r["curve"]["24"]["consensus"] for r in slow}
    assert ends["slow-link-total"] != ends["slow-link-total-own"]
    assert all(set(r["curve"]) == {"12", "24"} for r in healthy + slow)


def _fake(variant: str, accs: list[float], sent: float) -> dict:
    curve = {10 * (i + 1): {"acc": a, "consensus": 0.0} for i, a in enumerate(accs)}
    return {"variant": variant, "curve": curve, "final": accs[-1], "best": max(accs),
            "best_step": 10 * (accs.index(max(accs)) + 1), "bytes_per_step": sent}


def test_the_table_gives_the_median_runs_steps_to_the_target_and_its_bytes() -> None:
    runs = [_fake("a", [0.5, 0.7, 0.8], 2000), _fake("a", [0.6, 0.64, 0.7], 4000),
            _fake("a", [0.5, 0.6, 0.64], 3000),      # never: the median of 20, 30, never is 30
            _fake("b", [0.5, 0.6, 0.6], 100), _fake("b", [0.7, 0.6, 0.6], 100),
            _fake("b", [0.1, 0.2, 0.3], 100)]        # 10, never, never: the median never
    assert F.steps_to(runs[0], 0.65) == 20 and F.steps_to(runs[2], 0.65) is None
    rows = F.summarize(runs, ["a", "b"], [10, 20, 30], 0.65).splitlines()
    assert rows[0].endswith("| steps to 65% | kB / step |")
    assert rows[2].endswith("| 30 | 3.0 |") and rows[3].endswith("| never | 0.1 |")
