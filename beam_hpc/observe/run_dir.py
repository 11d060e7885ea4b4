"""Reading a run directory as a login-node command finds it: is it one, its plan, its last checkpoint.

Owns one concern: the checks every reader of a run directory starts with (`status`, `plot`, `logs`,
`cancel`, `run`), so that a wrong path or a damaged plan.json or checkpoint is the same bad input
(exit 2, named with its repair) whichever command met it. Nothing read is trusted.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from beam_hpc.errors import InputError, shorten
from beam_hpc.plan.paths import RunPaths
from beam_hpc.run import checkpoint_layout


class RunDirError(InputError):
    """The directory is not a beam-hpc run directory (the message says what is missing)."""


def load_plan(run_dir: Path) -> dict[str, Any] | None:
    """plan.json as a mapping (None when there is none). A plan that is not JSON, not a mapping or
    cut short is bad input (exit 2), named with its repair: every submission rewrites it."""
    p = Path(RunPaths(str(run_dir)).plan)
    repair = ("the plan is written atomically, so beam-hpc did not write this: restore it, or move it "
              "away (status and plot then work from the ledger and metrics alone)")
    try:
        plan = json.loads(p.read_bytes().decode("utf-8"))
    except FileNotFoundError:
        return None
    except IsADirectoryError:
        raise RunDirError(f"{p}: is a directory, not the run's plan; {repair}") from None
    except UnicodeDecodeError as err:
        raise RunDirError(f"{p}: not UTF-8 (byte {err.start}); {repair}") from None
    except (json.JSONDecodeError, RecursionError) as err:
        raise RunDirError(f"{p}: not valid JSON ({shorten(str(err), 120)}); {repair}") from None
    if not isinstance(plan, dict):
        raise RunDirError(f"{p}: holds a JSON {type(plan).__name__}, not a plan (a mapping); {repair}")
    if not isinstance(plan.get("recipe", {}), dict):
        raise RunDirError(f"{p}: its 'recipe' is {shorten(plan['recipe'], 60)}, not a mapping; {repair}")
    return plan


def check_run_dir(run_dir: str | Path) -> Path:
    """``run_dir`` as a Path once it is an existing directory; else :class:`RunDirError` (exit 2)
    naming it. Every reader of a run directory (status, plot, logs) starts here."""
    root = Path(run_dir)
    try:
        exists, is_dir = root.exists(), root.is_dir()
    except OSError as err:  # a name too long, a loop of links: no directory by that name
        raise RunDirError(f"{shorten(str(run_dir))}: not a usable path ({err.strerror}); give the run's "
                          "--output-dir") from None
    if not exists:
        raise RunDirError(f"{shorten(str(run_dir))}: no such run directory; give the run's --output-dir "
                          "(the directory that `beam-hpc submit` printed)")
    if not is_dir:
        raise RunDirError(f"{shorten(str(run_dir))}: is a file, not a run directory; give the run's "
                          "--output-dir (the directory holding plan.json and ledger.jsonl)")
    return root


def checkpoint_problems(ckpt_dir: Path, iteration: int) -> list[str]:
    """Why the checkpoint ``iteration`` cannot be resumed from: the layout's rules, then its files
    against their manifest (size and sha256) where the backend wrote one, so that a truncated
    model file is reported rather than shown as fine."""
    problems = checkpoint_layout.resume_problems(ckpt_dir)
    it_dir = checkpoint_layout.iteration_dir(ckpt_dir, iteration)
    if it_dir.is_dir():
        bad = checkpoint_layout.manifest_problem(it_dir)
        if bad is not None:
            problems.append(f"checkpoint {iteration}: {bad}; the next segment resumes from the newest complete "
                            f"checkpoint before it (beam_hpc.run.checkpoint_layout.newest_complete)")
    return problems
