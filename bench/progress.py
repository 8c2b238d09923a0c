"""Progress of a long run: a tqdm bar on a terminal, a plain line now and then in a log.

A bar redraws itself with carriage returns many times a second, which a terminal overwrites but
a redirected log keeps, every redraw of it. :func:`progress` therefore draws a bar only when
its stream is a terminal; otherwise it returns a :class:`LineProgress`, which prints one plain
line every ``ceil(total / LINES)`` steps (and one at the end): about ``LINES`` lines per run
whatever its length. Both take the same calls (the part of tqdm's interface the benchmarks and
examples use), so a caller does not care which it got.
"""

from __future__ import annotations

import math
import sys
import time
from typing import Any, TextIO

__all__ = ["LINES", "LineProgress", "is_terminal", "note", "progress"]

LINES = 15
"""Lines a :class:`LineProgress` prints over a whole run (one more where the last step falls
between two of them)."""


def is_terminal(stream: TextIO) -> bool:
    """Whether ``stream`` is a terminal (a closed or odd stream counts as none)."""
    try:
        return bool(stream.isatty())
    except (AttributeError, ValueError, OSError):
        return False


def progress(total: int, desc: str = "", *, stream: TextIO | None = None,
             **bar_options: Any) -> Any:
    """A progress bar over ``total`` steps on ``stream`` (default: sys.stderr): tqdm's on a
    terminal, with ``bar_options`` (``position``, ``leave``, ``unit``, ...), else a
    :class:`LineProgress`, which has no use for them (and on a terminal without tqdm, which
    only the bars need)."""
    stream = sys.stderr if stream is None else stream
    tqdm = _tqdm() if is_terminal(stream) else None
    if tqdm is not None:
        return tqdm(total=total, desc=desc, file=stream, **bar_options)
    return LineProgress(total, desc, stream)


def _tqdm() -> Any:
    """tqdm's bar class, or None where it is not installed."""
    try:
        from tqdm import tqdm
    except ImportError:
        return None
    return tqdm


def note(message: str, *, stream: TextIO | None = None) -> None:
    """Print ``message`` on its own lines without breaking a bar drawn on ``stream``."""
    stream = sys.stderr if stream is None else stream
    tqdm = _tqdm() if is_terminal(stream) else None
    if tqdm is not None:
        tqdm.write(message, file=stream)
    else:
        print(message, file=stream, flush=True)


class LineProgress:
    """What a log gets instead of a bar: ``"<desc>: <n>/<total> (<pct>%) <elapsed>s <postfix>"``
    every ``every`` steps and when the count reaches ``total``.

    Args:
        total: the steps of the run (>= 0).
        desc: the label of each line (``set_description`` changes it).
        stream: where the lines go.
        lines: about how many lines the whole run prints.
    """

    def __init__(self, total: int, desc: str, stream: TextIO, lines: int = LINES) -> None:
        self.total = total
        self.desc = desc
        self.n = 0
        self.every = max(1, math.ceil(total / lines))
        self._stream = stream
        self._postfix = ""
        self._start = time.monotonic()
        self._ended = False

    def update(self, n: int = 1) -> None:
        """Count ``n`` more steps; print a line when a multiple of ``every`` is passed, or the
        end reached (once)."""
        before = self.n
        self.n += n
        if self.n >= self.total > 0 and not self._ended:
            self._ended = True
            self._line()
        elif self.n // self.every > before // self.every and self.n < self.total:
            self._line()

    def set_description(self, desc: str) -> None:
        """The label of the next lines (tqdm's, without a redraw: a log needs none)."""
        self.desc = desc

    def set_postfix(self, **values: Any) -> None:
        """``key=value`` pairs shown at the end of the next lines."""
        self._postfix = ", ".join(f"{k}={v}" for k, v in values.items())

    def close(self) -> None:
        """Nothing to clear: the lines stay as written."""

    def __enter__(self) -> LineProgress:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _line(self) -> None:
        pct = f" ({100 * self.n / self.total:.0f}%)" if self.total else ""
        elapsed = time.monotonic() - self._start
        tail = f" {self._postfix}" if self._postfix else ""
        label = f"{self.desc.strip()}: " if self.desc.strip() else ""
        print(f"{label}{self.n}/{self.total}{pct} {elapsed:.0f}s{tail}", file=self._stream,
              flush=True)


if __name__ == "__main__":
    print("bench/progress.py is a library of the benchmarks (a progress bar on a terminal, a "
          "line now and then in a redirected log), imported by them; it runs nothing. See "
          "bench/README.md.")
