"""``bench/store_connects.py`` connects the clients it says, one by one, and reports each time
(what it lists as slow is what its times say) and the resolver's options in effect."""

from __future__ import annotations

import json

import pytest

from bench import store_connects


def test_it_times_every_connect_and_lists_the_slow_ones(tmp_path, capsys) -> None:
    out = tmp_path / "s.json"
    assert store_connects.main(["--connects", "4", "--slow-s", "1e-9", "--out", str(out)]) == 0
    data = json.loads(out.read_text())
    assert len(data["times_s"]) == 4 and all(t > 0 for t in data["times_s"])
    assert data["slow"] == [0, 1, 2, 3]   # every connect took longer than a nanosecond
    assert "4 connects: median" in capsys.readouterr().out


def test_the_resolver_options_come_from_the_environment_first(monkeypatch) -> None:
    monkeypatch.setenv("RES_OPTIONS", "timeout:1 attempts:3")
    assert store_connects.resolver_options() == "RES_OPTIONS=timeout:1 attempts:3"


@pytest.mark.parametrize(("argv", "match"), [(["--connects", "0"], "--connects must be"),
                                             (["--slow-s", "0"], "--slow-s must be")])
def test_bad_arguments_are_named(argv: list[str], match: str, capsys) -> None:
    with pytest.raises(SystemExit):
        store_connects.main(argv)
    assert match in capsys.readouterr().err
