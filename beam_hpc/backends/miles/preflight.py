"""The image's own Miles checks the driver's command before the run starts.

Why: Miles changes fast and a site's image may hold another Miles than the one the flag table
(``flags.SOURCES``) was written against. An image whose Miles does not know a flag (``miles-rl``
0.0.2 lacks ``--save-trigger-sentinel`` and the NVMe-streaming flags), or whose validation refuses
the combination, would fail only after the allocation was granted, Ray came up on every node and the
model started loading. Here that Miles's own ``parse_args()`` (argparse, ``hf_validate_args``, Miles's
and Megatron's ``validate_args``) runs on the exact argv the driver will get, placeholders filled
with harmless values, in a few seconds, through the site's container seam, so the parser is the
image's (:mod:`beam_hpc.backends.miles.parser_check` runs there). Two callers, one check: the job,
on the head node before Ray starts (:func:`check_in_job`), and ``beam-hpc doctor --recipe``
(:func:`check_recipe`). A refusal quotes Miles's message and, for an unknown flag, names the
beam-hpc setting behind it; the verdict also says which model-script form the image read.
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import tempfile
import time
from dataclasses import dataclass, field, replace
from typing import Any

from beam_hpc.backends.miles.architecture import MODEL_SCRIPT_OPTION, MODEL_SCRIPT_VAR_OPTION
from beam_hpc.backends.miles.flags import SOURCES
from beam_hpc.backends.miles.parser_check import RESULT_PREFIX
from beam_hpc.config.recipe import Recipe
from beam_hpc.config.site import Site
from beam_hpc.node.container import container_command

log = logging.getLogger(__name__)
CHECK_MODULE = "beam_hpc.backends.miles.parser_check"
DEFAULT_TIMEOUT_S = 300.0  # importing Miles + Megatron + SGLang takes 10-30 s on a loaded CPU
# What to do when the image's Miles does not know a flag beam-hpc emits.
NEWER_IMAGE = "or build the site's image from a newer Miles (container.image)"
ADVICE: dict[str, str] = {
    "--save-trigger-sentinel": "set lifecycle.save_on_request: false (saves then happen only every "
                               "checkpoint.interval rollouts; a walltime or preemption stop resumes from the last one), "
                               + NEWER_IMAGE,
    "--stream-optimizer-state-to-disk": "set training.offload.target: cpu (Megatron's host-RAM optimizer offload) "
                                        "or none, " + NEWER_IMAGE,
    "--offload-train-disk-dir": "set training.offload.target: cpu or none, " + NEWER_IMAGE,
    "--offload-train-target": "set training.offload.target: cpu or none, " + NEWER_IMAGE,
}


@dataclass(frozen=True)
class Verdict:
    """What the image's Miles said about the argv."""

    ok: bool
    error: str = ""
    unrecognized: tuple[str, ...] = ()
    seconds: float = 0.0
    detail: dict[str, Any] = field(default_factory=dict)

    def model_script_note(self) -> str | None:
        """Which model script the image read and in which form (None when the flags were settled
        on the login node): ``doctor --recipe`` and the in-job log say it."""
        found = self.detail.get("model_script") or {}
        if not found:
            return None
        where = found.get("where", "image")
        form = {"python": f"Python model_args() through the {where}'s Miles loader",
                "bash": f"bash MODEL_ARGS array read on the {where}"}.get(found.get("form"), str(found.get("form")))
        return f"model script {found.get('path')}: {form}, {found.get('flags')} words of architecture flags"

    def refusal(self) -> str | None:
        """None when Miles accepted the command; else Miles's message and, per unknown flag, the
        beam-hpc setting behind it and what to do."""
        if self.ok:
            return None
        lines = [f"the image's Miles refuses the driver command: {self.error}"]
        for flag in self.unrecognized:
            source = SOURCES.get(flag)
            if source is None:
                lines.append(f"  {flag}: not set by beam-hpc (model.miles_model_args, the model script or "
                             "backend_options.extra_args): remove it or use an image whose Miles has it")
            else:
                lines.append(f"  {flag}: from {source}; "
                             + ADVICE.get(flag, f"change {source.split(' ')[0]}, {NEWER_IMAGE}"))
        return "\n".join(lines)


def harmless_values(output_dir: str) -> dict[str, str]:
    """Placeholder values for a command that is parsed, never run."""
    return {"job_id": "0", "nvme_dir": os.path.join(tempfile.gettempdir(), "beam-parser-check"),
            "head_ip": "127.0.0.1", "ray_address": "127.0.0.1:6379", "run_dir": output_dir}


def check_argv(driver_argv: list[str] | tuple[str, ...], python: str, output_dir: str,
               num_rollout: int = 1) -> list[str]:
    """The parser-check command for a Plan driver argv: ``python -m parser_check [--model-script ..]
    -- <entry> <Miles flags>`` with placeholders filled. A model script only the image can read
    (``--model-script``) is carried along and read there as the launcher will read it: a ``.py``
    script through the image's Miles ``load_model_args``, a ``.sh`` one for its array."""
    from beam_hpc.plan.plan import fill

    argv = list(driver_argv)
    if "--" not in argv:
        raise ValueError("driver argv without the launcher's --: not a Miles driver command")
    cut = argv.index("--")
    launcher, rest = argv[:cut], argv[cut + 1:]
    carried: list[str] = []
    for i, a in enumerate(launcher):
        if a in (MODEL_SCRIPT_OPTION, MODEL_SCRIPT_VAR_OPTION) and i + 1 < len(launcher):
            carried += [a, launcher[i + 1]]
    values = {**harmless_values(output_dir), "num_rollout": str(num_rollout)}
    return [python, "-m", CHECK_MODULE, *carried, "--", *(fill(a, **values) for a in rest)]


def run_check(site: Site, driver_argv: list[str] | tuple[str, ...], output_dir: str, *,
              env: dict[str, str] | None = None, binds: list[str] | None = None,
              timeout_s: float = DEFAULT_TIMEOUT_S, num_rollout: int = 1) -> Verdict:
    """Run the image's Miles parser on the driver argv through the site's container runtime."""
    argv = check_argv(driver_argv, site.node_python, output_dir, num_rollout)
    cmd = container_command(site, argv, env or {}, binds or [])
    start = time.monotonic()
    try:
        res = subprocess.run(cmd.argv, env=cmd.env, capture_output=True, text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired:
        return Verdict(False, f"Miles's parser did not answer within {timeout_s:.0f} s", seconds=timeout_s)
    except FileNotFoundError as err:
        return Verdict(False, f"cannot run the check: {err}", seconds=time.monotonic() - start)
    seconds = time.monotonic() - start
    for line in reversed(res.stdout.splitlines()):
        if line.startswith(RESULT_PREFIX):
            d = json.loads(line[len(RESULT_PREFIX):])
            return Verdict(bool(d.get("ok")), d.get("error", ""), tuple(d.get("unrecognized", [])), seconds, d)
    tail = (res.stderr or res.stdout).strip().splitlines()[-3:]
    return Verdict(False, f"the check printed no verdict (exit {res.returncode}): {' | '.join(tail)}", seconds=seconds)


def check_plan(plan: Any, *, timeout_s: float = DEFAULT_TIMEOUT_S) -> Verdict:
    """The Plan's driver command and environment (Megatron asserts ``CUDA_DEVICE_MAX_CONNECTIONS=1``
    from it), checked by the image's Miles."""
    return run_check(plan.site, plan.driver_argv, plan.output_dir, env=_env(plan.driver_env, plan.output_dir),
                     binds=[plan.output_dir], timeout_s=timeout_s, num_rollout=plan.recipe.num_rollout)


def check_recipe(recipe: Recipe, site: Site, *, timeout_s: float = DEFAULT_TIMEOUT_S) -> Verdict:
    """The check for ``beam-hpc doctor --recipe``: the Plan's driver command, through the image
    (the run directory need not exist yet, so it is not bound)."""
    from beam_hpc.backends.miles.architecture import resolve
    from beam_hpc.backends.registry import plan_for

    plan = plan_for(recipe, site)
    verdict = run_check(site, plan.driver_argv, plan.output_dir, env=_env(plan.driver_env, plan.output_dir),
                        timeout_s=timeout_s, num_rollout=plan.recipe.num_rollout)
    arch = resolve(recipe.model)
    if arch.script_form and not arch.deferred_script:  # read here, at submit time: say so too
        found = {"path": recipe.model.miles_model_script, "form": arch.script_form,
                 "flags": len(arch.args) - len(recipe.model.miles_model_args), "where": "login node"}
        verdict = replace(verdict, detail={**verdict.detail, "model_script": found})
    return verdict


def check_in_job(plan: Any, *, timeout_s: float = DEFAULT_TIMEOUT_S) -> str | None:
    """The in-job hook (head node, before Ray starts): None when the image's Miles accepts the
    driver command, else the refusal message for the ledger and the log. Reference-backend plans
    pass unchecked."""
    if plan.recipe.backend != "miles":
        return None
    verdict = check_plan(plan, timeout_s=timeout_s)
    note = verdict.model_script_note()
    if note:
        log.info("in the image: %s", note)
    return verdict.refusal()


def _env(driver_env: dict[str, str], output_dir: str) -> dict[str, str]:
    """The driver's environment with placeholders filled, minus Ray's address (no Ray here)."""
    from beam_hpc.plan.plan import fill

    values = harmless_values(output_dir)
    return {k: fill(v, **values) for k, v in driver_env.items() if k != "RAY_ADDRESS"}
