"""Fast checks of ``bench/adamw_averaging.py`` on a tiny transformer (width 16, one block, three
steps): with one node every variant is DDP bit for bit; with two nodes that see the same batches
every averaging variant is DDP bit for bit; with distinct batches averaging parameters is not
DDP; the JSON holds what the table shows. A few seconds."""

from __future__ import annotations

import importlib
import json
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

aa = importlib.import_module("bench.adamw_averaging")
W = importlib.import_module("bench.cluster.workloads")

ALL = ("ddp,params-every-1,params-every-2,params+moments-every-1,params+moments-every-2,"
       "params+exp_avg-every-1,params+m+vddp-every-1,params-every-1-vscaled")
EXACT = "ddp,params-every-1,params-every-2,params+moments-every-1,params+exp_avg-every-2," \
        "params+m+vddp-every-1"


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("charlm") / "charlm.npz"
    W.make_data("charlm", path, seed=0)
    return path


def _run(data: Path, nodes: int, variants: str, *extra: str) -> dict:
    return aa.main(["--data", str(data), "--nodes", str(nodes), "--variants", variants,
                    "--steps", "3", "--warmup", "1", "--width", "16", "--layers", "1",
                    "--eval-windows", "16", "--eval-every", "1", "--no-progress", *extra])


def _by_name(out: dict) -> dict[str, dict]:
    return {r["variant"]: r for r in out["results"]}


def test_one_node_every_variant_is_ddp_bit_for_bit(data) -> None:
    rows = _by_name(_run(data, 1, ALL))
    ddp = rows["ddp"]
    for name, r in rows.items():
        assert r["final_params_sha256"] == ddp["final_params_sha256"], name
        assert [p["val_loss"] for p in r["curve"]] == [p["val_loss"] for p in ddp["curve"]], name


def test_identical_batches_make_averaging_exact_ddp(data) -> None:
    rows = _by_name(_run(data, 2, EXACT, "--identical-batches"))
    digests = {r["final_params_sha256"] for r in rows.values()}
    assert len(digests) == 1, rows


def test_distinct_batches_averaging_is_not_ddp_and_json_agrees(data, tmp_path) -> None:
    path = tmp_path / "out.json"
    out = _run(data, 2, "ddp,params-every-1,params+moments-every-1", "--json", str(path))
    rows = _by_name(out)
    assert rows["params-every-1"]["final_params_sha256"] != rows["ddp"]["final_params_sha256"]
    # averaging the moments too changes the trajectory from the second step on
    assert (rows["params+moments-every-1"]["final_params_sha256"]
            != rows["params-every-1"]["final_params_sha256"])
    saved = json.loads(path.read_text())
    assert [r["variant"] for r in saved["results"]] == ["ddp", "params-every-1",
                                                         "params+moments-every-1"]
    for r in saved["results"]:
        assert r["ratio_to_ddp"] == pytest.approx(r["final_val_loss"]
                                                  / rows["ddp"]["final_val_loss"])
        assert [p["step"] for p in r["curve"]] == [0, 1, 2, 3]
    assert saved["data"]["fingerprint"] and saved["config"]["nodes"] == 2


def test_variant_names() -> None:
    v = aa.parse_variant("params+moments-every-2-vscaled")
    assert (v.what, v.every, v.vscaled) == ("params+moments", 2, True)
    for bad in ("params-every-0", "params+m+vddp-every-2", "moments-every-1"):
        with pytest.raises(ValueError):
            aa.parse_variant(bad)


def test_a_cosine_schedule_changes_the_run_and_keeps_the_exact_cases(data) -> None:
    # One node under the cosine schedule: still every variant DDP's bits (the schedule is the
    # same for every optimizer), and not the constant run's bits (the schedule acted).
    cosine = _by_name(_run(data, 1, ALL, "--lr-schedule", "cosine"))
    assert len({r["final_params_sha256"] for r in cosine.values()}) == 1
    constant = _by_name(_run(data, 1, "ddp"))
    assert cosine["ddp"]["final_params_sha256"] != constant["ddp"]["final_params_sha256"]


def test_the_schedule_sets_each_step_s_learning_rate(data) -> None:
    args = aa.parse_args(["--data", str(data), "--nodes", "2", "--steps", "3", "--warmup", "1",
                          "--width", "16", "--layers", "1", "--eval-windows", "16",
                          "--lr-schedule", "cosine"])
    nodes = aa.load_nodes(args, data)
    init = nodes[0].make_model().state_dict()
    tr = aa.Trainer(aa.parse_variant("params-every-1"), nodes, args, init)
    seen = []
    for i in range(4):
        tr.train_step(i)
        seen.append([g["lr"] for opt in tr.opts for g in opt.param_groups])
    # 4 steps: one of warm-up (5% of 4, at least 1), then a cosine from the top towards 0:
    # 1, cos of 0, of pi/3, of 2 pi/3 (halved and lifted)
    factors = [1.0, 1.0, 0.75, 0.25]
    for lrs, f in zip(seen, factors, strict=True):
        assert lrs == pytest.approx([args.lr * f] * len(lrs))


def test_an_unknown_schedule_is_refused_by_name(data, capsys) -> None:
    with pytest.raises(SystemExit):
        _run(data, 1, "ddp", "--lr-schedule", "linear")
    assert "--lr-schedule: invalid choice: 'linear'" in capsys.readouterr().err
