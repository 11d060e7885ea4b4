"""The one logging set-up: every beam-hpc process writes its log lines in :data:`LOG_FORMAT`.

The CLI, a segment, a node step, the job's helpers and the drivers all call :func:`log_to_stream`
(and a segment :func:`log_to_file` for its segment.log), and every module logs through
``logging.getLogger(__name__)`` (a module that is also a program, run with ``python -m``, through
:func:`module_logger`), so a run's output reads as one voice and each line names the module that
wrote it. A handler is added once per process, however often this is called, and
writes to ``sys.stderr`` or ``sys.stdout`` as they are when a line is written (pytest swaps them
per test; a handler holding an old one would write into a closed capture).

No beam_hpc imports: every layer may use it.
"""

from __future__ import annotations

import logging
import sys
from pathlib import Path
from typing import TextIO

LOG_FORMAT = "%(asctime)s %(name)s %(levelname)s %(message)s"


class _ConsoleHandler(logging.StreamHandler):  # type: ignore[type-arg]
    """A handler on ``sys.<name>`` as it is at each line."""

    def __init__(self, name: str) -> None:
        self._stream_name = name
        super().__init__()

    @property  # type: ignore[override]
    def stream(self) -> TextIO:
        return getattr(sys, self._stream_name)

    @stream.setter
    def stream(self, _value: object) -> None:  # StreamHandler.__init__ sets it; the name decides
        pass


def module_logger(name: str) -> logging.Logger:
    """``logging.getLogger(__name__)`` for a module that is also a program: run as ``python -m
    beam_hpc.x`` its ``__name__`` is ``"__main__"``, and its logger is named ``beam_hpc.x`` instead."""
    if name == "__main__":
        spec = getattr(sys.modules.get("__main__"), "__spec__", None)
        name = spec.name if spec is not None else name
    return logging.getLogger(name)


def formatter() -> logging.Formatter:
    return logging.Formatter(LOG_FORMAT)


def log_to_stream(stream: str = "stderr", level: int | None = logging.INFO) -> None:
    """Log to ``sys.stderr`` (or ``"stdout"``) in the one format, with the root logger at ``level``
    (None: leave the level as it is). A console handler already on the root logger (of an earlier
    call, or a segment's) is kept and no second one is added."""
    if stream not in ("stderr", "stdout"):
        raise ValueError(f"stream {stream!r}: expected 'stderr' or 'stdout'")
    root = logging.getLogger()
    if level is not None:
        root.setLevel(level)
    if any(isinstance(h, _ConsoleHandler) or type(h) is logging.StreamHandler for h in root.handlers):
        return  # (a subclass, such as pytest's capture, is no console)
    handler = _ConsoleHandler(stream)
    handler.setFormatter(formatter())
    root.addHandler(handler)


def log_to_file(path: str | Path) -> logging.Handler:
    """Also log into ``path`` (appended), in the one format; returns the handler so that the caller
    can remove (and close) it when the file is no longer its own."""
    handler = logging.FileHandler(path)
    handler.setFormatter(formatter())
    logging.getLogger().addHandler(handler)
    return handler
