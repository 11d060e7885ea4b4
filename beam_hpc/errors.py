"""The one error family: every failure beam-hpc expects carries its own exit code.

``BeamError`` is the root; a message is written for people (what, the value, the fix). Two kinds:
:class:`InputError` (exit 2), bad input (a recipe, site, override, flag, path or run directory),
raised before anything is written, submitted or allocated; and :class:`RuntimeFailure` (exit 1), a
tool, Slurm, a node or the backend failing at run time. Modules define narrower classes under one of
the two (``NvmeError``, ``SubmitError``, ...), so a caller can catch what it handles; the CLI
(:mod:`beam_hpc.cli.app`) is the one place that maps ``exit_code`` to the process exit status.
Anything else that escapes is a bug: the CLI prints one line and the path of a log holding the
traceback. The built-in bases (``ValueError``, ``RuntimeError``) stay, so code catching those works.
"""

from __future__ import annotations

EXIT_OK, EXIT_FAILURE, EXIT_INPUT = 0, 1, 2


class BeamError(Exception):
    """Root of every expected failure; ``exit_code`` is what the CLI exits with."""

    exit_code: int = EXIT_FAILURE


class InputError(BeamError, ValueError):
    """Bad input: name the file or field, the value and the fix (exit 2)."""

    exit_code = EXIT_INPUT


class RuntimeFailure(BeamError, RuntimeError):
    """An expected failure at run time, with a message that says what to do (exit 1)."""

    exit_code = EXIT_FAILURE


def shorten(value: object, limit: int = 200) -> str:
    """``repr(value)`` cut to about ``limit`` characters: an error line must stay one line even
    when the value is megabytes long."""
    text = repr(value)
    if len(text) <= limit:
        return text
    return f"{text[:limit]}... ({len(text)} characters)"
