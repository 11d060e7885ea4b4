"""One small progress bar for long steps (downloads, image staging, conversion), on stderr.

Why it exists: a multi-GB copy or a conversion that runs for minutes with no output looks hung on
a login node, and in a batch log a redraw per byte is noise. So: on a terminal the bar redraws in
place at most a few times a second; anywhere else (a Slurm log, a pipe) it writes one plain line
per 10 % step and one at the end. No dependency, so any module may use it; it writes only to the
stream it is given (stderr by default), never to stdout, which stays for a command's results.
The duration, size and plain-table formatters used by `status` and `doctor` live here too, so
every human-facing number in beam-hpc reads the same way.

    with Progress("staging image", total=size, unit="B") as bar:
        for chunk in chunks:
            ...
            bar.update(len(chunk))
"""

from __future__ import annotations

import sys
import time
from collections.abc import Iterable, Iterator
from typing import TextIO, TypeVar

T = TypeVar("T")

_BAR_WIDTH = 24
_REDRAW_S = 0.2  # terminal redraw interval
_LOG_STEPS = 10  # non-terminal: one line per tenth of the total


def human(value: float, unit: str) -> str:
    """``1536, "B"`` -> ``"1.5 KiB"``; other units get SI-free plain numbers (``"12 rollouts"``)."""
    if unit == "B":
        for prefix in ("", "Ki", "Mi", "Gi", "Ti"):
            if abs(value) < 1024 or prefix == "Ti":
                return f"{value:.0f} B" if not prefix else f"{value:.1f} {prefix}B"
            value /= 1024
    number = f"{value:.0f}" if float(value).is_integer() else f"{value:.1f}"
    return f"{number} {unit}".rstrip()


def duration(seconds: float) -> str:
    """``3725`` -> ``"1h02m05s"``; short and sortable by eye."""
    s = int(round(max(seconds, 0)))
    h, rem = divmod(s, 3600)
    m, s = divmod(rem, 60)
    if h:
        return f"{h}h{m:02d}m{s:02d}s"
    return f"{m}m{s:02d}s" if m else f"{s}s"


class Progress:
    """A progress bar for one step. ``total=None`` shows a counter and rate without a bar."""

    def __init__(self, label: str, total: float | None = None, *, unit: str = "",
                 stream: TextIO | None = None, interactive: bool | None = None, enabled: bool = True) -> None:
        """``enabled=False`` counts but writes nothing (a ``--no-progress`` flag needs no stand-in)."""
        self.enabled = enabled
        self.label = label
        self.total = total if total and total > 0 else None
        self.unit = unit
        self.stream = stream if stream is not None else sys.stderr
        isatty = getattr(self.stream, "isatty", None)
        self.interactive = bool(isatty and isatty()) if interactive is None else interactive
        self.done = 0.0
        self._t0 = time.monotonic()
        self._last_draw = 0.0
        self._last_logged_step = -1
        self._closed = False

    def __enter__(self) -> Progress:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def update(self, n: float = 1) -> None:
        """Add ``n`` units of work done."""
        self.set(self.done + n)

    def set(self, done: float) -> None:
        """Set the amount of work done (for callers that know the absolute position)."""
        self.done = done
        if self.interactive:
            now = time.monotonic()
            if now - self._last_draw >= _REDRAW_S:
                self._last_draw = now
                self._write("\r" + self.line() + "\x1b[K")
        elif self.total:
            step = int(min(self.done / self.total, 1.0) * _LOG_STEPS + 1e-9)
            if self._last_logged_step < step < _LOG_STEPS:
                self._last_logged_step = step
                self._write(self.line() + "\n")

    def line(self) -> str:
        """The current one-line rendering (also what tests look at)."""
        elapsed = time.monotonic() - self._t0
        rate = self.done / elapsed if elapsed > 0 else 0.0
        rate_txt = f"{human(rate, self.unit)}/s" if self.unit else f"{rate:.1f}/s"
        if self.total is None:
            return f"{self.label}: {human(self.done, self.unit)} {rate_txt} {duration(elapsed)}"
        frac = min(self.done / self.total, 1.0)
        filled = int(frac * _BAR_WIDTH)
        bar = "#" * filled + "-" * (_BAR_WIDTH - filled)
        eta = (self.total - self.done) / rate if rate > 0 and frac < 1 else 0.0
        return (f"{self.label}: [{bar}] {frac * 100:3.0f}% {human(self.done, self.unit)}"
                f"/{human(self.total, self.unit)} {rate_txt} ETA {duration(eta)}")

    def close(self) -> None:
        """Draw the final state once (a closed bar ignores further closes)."""
        if self._closed:
            return
        self._closed = True
        self._write(("\r" + self.line() + "\x1b[K\n") if self.interactive else self.line() + "\n")

    def _write(self, text: str) -> None:
        if not self.enabled:
            return
        self.stream.write(text)
        self.stream.flush()


def text_table(headers: list[str], rows: list[list[str]]) -> str:
    """Plain left-aligned columns (status, doctor): readable in a terminal and in a log alike."""
    cells = [headers] + [[str(c) for c in row] for row in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(r, widths, strict=False)).rstrip() for r in cells)


def track(items: Iterable[T], label: str, total: int | None = None, **kwargs: object) -> Iterator[T]:
    """Iterate ``items`` with a bar counting them (``total`` defaults to ``len(items)``)."""
    if total is None and hasattr(items, "__len__"):
        total = len(items)  # type: ignore[arg-type]
    with Progress(label, total, **kwargs) as bar:  # type: ignore[arg-type]
        for item in items:
            yield item
            bar.update(1)
