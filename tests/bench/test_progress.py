"""bench/progress.py: a bar only on a terminal; in a log, about LINES plain lines per run, none
of them with a carriage return, the last one at the end."""

from __future__ import annotations

import io

import pytest

from bench import progress as P


class _Terminal(io.StringIO):
    """A stream that says it is a terminal (a StringIO says it is not)."""

    def isatty(self) -> bool:
        return True


@pytest.mark.parametrize("total", [1, 7, 15, 100, 1000, 12345])
def test_a_log_gets_about_lines_plain_lines_whatever_the_length(total: int) -> None:
    log = io.StringIO()
    bar = P.progress(total, "training", stream=log, unit="step", position=1, leave=False)
    assert isinstance(bar, P.LineProgress)
    with bar:
        for _ in range(total):
            bar.update()
    lines = log.getvalue().splitlines()
    assert "\r" not in log.getvalue()
    assert min(total, 10) <= len(lines) <= P.LINES + 1, lines
    assert lines[-1].startswith(f"training: {total}/{total} (100%) ")
    assert all(line.startswith("training: ") for line in lines)


def test_lines_carry_the_description_and_postfix_and_jumps_print_once() -> None:
    log = io.StringIO()
    bar = P.progress(150, "runs", stream=log)
    assert bar.every == 10
    bar.update(5)
    assert log.getvalue() == ""  # below the first multiple of every
    bar.set_description("charlm 2x2")
    bar.set_postfix(loss="0.123", epoch=2)
    bar.update(40)  # 5 -> 45 passes 10, 20, 30, 40: one line, not four
    (line,) = log.getvalue().splitlines()
    assert line.startswith("charlm 2x2: 45/150 (30%) ") and line.endswith("loss=0.123, epoch=2")
    bar.update(200)  # past the end: the final line, once
    bar.update(1)
    assert len(log.getvalue().splitlines()) == 2
    bar.close()


def test_a_terminal_gets_tqdms_bar_and_notes_do_not_break_it() -> None:
    tqdm = pytest.importorskip("tqdm").tqdm
    term = _Terminal()
    bar = P.progress(100, "runs", stream=term, leave=True)
    assert isinstance(bar, tqdm)
    bar.update(50)
    P.note("run 3: FAILED", stream=term)
    bar.close()
    out = term.getvalue()
    assert "\r" in out and "50/100" in out and "run 3: FAILED\n" in out


def test_a_terminal_without_tqdm_gets_lines(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(P, "_tqdm", lambda: None)
    term = _Terminal()
    bar = P.progress(3, "x", stream=term)
    assert isinstance(bar, P.LineProgress)
    P.note("hello", stream=term)
    assert term.getvalue() == "hello\n"


def test_notes_in_a_log_are_plain_lines() -> None:
    log = io.StringIO()
    P.note("run 3: FAILED (exit 1)\ntail", stream=log)
    assert log.getvalue() == "run 3: FAILED (exit 1)\ntail\n"


def test_a_closed_or_odd_stream_is_no_terminal() -> None:
    closed = io.StringIO()
    closed.close()
    assert not P.is_terminal(closed)
    assert not P.is_terminal(object())  # type: ignore[arg-type]
    assert P.is_terminal(_Terminal())
