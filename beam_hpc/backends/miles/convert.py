"""HF -> torch_dist with Miles's converter, as a Slurm job of its own, run once per model.

Full-parameter Miles runs start from the model's Megatron ``torch_dist`` copy (``model.ref_load``).
Miles's ``tools/convert_hf_to_torch_dist.py`` makes it under torchrun, one rank per GPU of a node,
from the model's architecture flags; rank 0 writes ``release`` into the tracker file as its very
last step, Miles's success signal. That is GPU batch work, done once before the first segment, so
``beam-hpc prepare --convert RECIPE --site SITE`` runs it as a job of its own:

- on the login node, :func:`convert_spec` (pure) turns recipe + site into a :class:`ConvertSpec`;
  :func:`submit_convert` skips a done or queued conversion, else writes the spec and the batch
  script (:func:`render_script`, through beam_hpc.slurm.script as every batch script) and submits;
- in the job, ``run`` takes the output's lock, clears a failed try's leftovers, starts ``exec`` in
  the site's container (which execs torchrun on Miles's converter) and on success writes the done
  marker. An output beam-hpc did not record, or recorded for another model, is never overwritten.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Literal

from beam_hpc.backends.miles import architecture
from beam_hpc.config.recipe import Recipe, format_walltime, parse_walltime
from beam_hpc.config.site import Site
from beam_hpc.errors import InputError, RuntimeFailure
from beam_hpc.files import write_json_atomic
from beam_hpc.logging_setup import log_to_stream, module_logger
from beam_hpc.node.container import Command, container_command
from beam_hpc.plan.paths import RunPaths
from beam_hpc.run import lock as run_lock
from beam_hpc.run.checkpoint_layout import LATEST_FILE, write_atomic
from beam_hpc.slurm import client as slurm_client
from beam_hpc.slurm.environment import SlurmEnvironment
from beam_hpc.slurm.script import BatchJob, render_batch, site_component

log = module_logger(__name__)  # also run as python -m

CONVERTER = "tools/convert_hf_to_torch_dist.py"  # under the Miles tree
RELEASE = "release"  # Megatron's name for a checkpoint that is not a training iteration
MARKER = "beam-convert.json"  # beam-hpc's done marker, inside the output directory
# Leftovers of a converter that died: its iteration dir, the moved release dir, the tracker.
_PARTIAL = ("iter_0000001", RELEASE, LATEST_FILE)
DEFAULT_WALLTIME = "04:00:00"
MILES_DIR_VAR = "MILES_DIR"  # set by beam-hpc's image (apptainer.def %environment)
MEGATRON_VAR = "MEGATRON_PATH"

State = Literal["done", "missing", "partial"]


class ConvertError(RuntimeFailure):
    """The conversion job could not be submitted or did not produce a complete checkpoint."""


@dataclass(frozen=True)
class ConvertSpec:
    """Everything the conversion job needs; written to ``<output_dir>/convert/convert.json``."""

    hf_checkpoint: str
    output: str  # model.ref_load
    model_args: tuple[str, ...]
    gpus: int  # per node; one node
    cpus: int | None
    partition: str | None
    walltime: str
    job_name: str
    work_dir: str  # script, spec and logs
    site: dict[str, Any] = field(default_factory=dict)

    @property
    def spec_path(self) -> Path:
        return Path(self.work_dir, "convert.json")

    @property
    def script_path(self) -> Path:
        return Path(self.work_dir, "convert.sbatch")

    @property
    def log_dir(self) -> Path:
        return Path(self.work_dir, "logs")

    def key(self) -> dict[str, Any]:
        """What makes two conversions the same: the weights and the architecture they are read as."""
        return {"hf_checkpoint": os.path.normpath(self.hf_checkpoint), "model_args": list(self.model_args)}

    def site_obj(self) -> Site:
        return Site.model_validate(self.site)

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=2, sort_keys=True) + "\n"

    @classmethod
    def load(cls, path: str | Path) -> ConvertSpec:
        d = json.loads(Path(path).read_text())
        d["model_args"] = tuple(d["model_args"])
        return cls(**d)


# -- pure: recipe + site -> spec -> script ---------------------------------------------------------
def convert_spec(recipe: Recipe, site: Site, *, walltime: str = DEFAULT_WALLTIME) -> ConvertSpec:
    """The conversion a recipe needs; InputError naming the field when it needs none or cannot have one."""
    if recipe.backend != "miles":
        raise InputError(f"backend: {recipe.backend!r} recipes need no torch_dist copy; --convert is for backend: miles")
    if recipe.training.mode == "lora":
        raise InputError("training.mode: lora runs load the HF checkpoint through Megatron-Bridge; they need no "
                          "torch_dist copy, so there is nothing to --convert")
    m = recipe.model
    if not m.ref_load:
        raise InputError("model.ref_load: not set; name the directory the torch_dist copy goes to, e.g. "
                          f"--set model.ref_load={m.path.rstrip('/')}_torch_dist")
    for name, value in (("model.path", m.path), ("model.ref_load", m.ref_load), ("output_dir", recipe.output_dir)):
        if not os.path.isabs(value):
            raise InputError(f"{name}: {value!r} is relative; the conversion job runs on a compute node, so give "
                              "an absolute path on shared storage")
    if os.path.normpath(m.ref_load) == os.path.normpath(m.path):
        raise InputError(f"model.ref_load: {m.ref_load} is model.path itself; the torch_dist copy needs its own directory")
    arch = architecture.resolve(m)  # the same sources as the training command, checked against config.json
    if arch.deferred_script or not arch.args:
        raise InputError(
            f"model.miles_model_script: {m.miles_model_script or '(none)'} is not readable here, and Miles's converter "
            "builds the Megatron model from the architecture flags before any job runs; make the script readable on "
            "this node, set model.hf_config (config.json of a Qwen2/Qwen3/Qwen3-MoE/DeepSeek-V3/GLM-4.5 model), "
            "or list the flags in model.miles_model_args")
    gpus = recipe.topology.trainer.gpus_per_node
    if gpus < 1:
        raise InputError("topology.trainer.gpus_per_node: the converter runs on a trainer node's GPUs; set it (the seed: 8)")
    if gpus > site.gpus_per_node:
        raise InputError(f"topology.trainer.gpus_per_node: {gpus} GPUs, but site {site.name!r} nodes have "
                          f"{site.gpus_per_node}; lower it or use another site")
    try:
        walltime = format_walltime(parse_walltime(walltime))
    except ValueError:
        raise InputError(f"--walltime: {walltime!r} is not a Slurm time; use HH:MM:SS or D-HH:MM:SS") from None
    name = re.sub(r"[^A-Za-z0-9_.-]", "-", Path(m.ref_load).name)[:40]
    return ConvertSpec(
        hf_checkpoint=m.path, output=os.path.normpath(m.ref_load), model_args=tuple(arch.args),
        gpus=gpus, cpus=recipe.topology.trainer.cpus_per_node or site.cpus_per_node,
        partition=site.partitions.for_group("trainer"), walltime=walltime, job_name=f"beam-convert-{name}",
        work_dir=RunPaths(recipe.output_dir).convert, site=site.model_dump(mode="json"),
    )


def batch_job(spec: ConvertSpec) -> BatchJob:
    """One trainer-partition node with the converter's GPUs and the site's options, the site's
    lines, then Python: the batch script as values (beam_hpc.slurm.script renders it)."""
    site = spec.site_obj()
    node = site_component(site, nodes=1, gpus_per_node=spec.gpus, partition=spec.partition,
                          cpus_per_task=spec.cpus, constraint=site.constraints.for_group("trainer"))
    run = f"exec {shlex.quote(site.python)} -m beam_hpc.backends.miles.convert run --spec {shlex.quote(str(spec.spec_path))}"
    note = (f"Generated by beam-hpc: {spec.hf_checkpoint} -> {spec.output} (torch_dist, Miles's {CONVERTER}). "
            "Submitted by `beam-hpc prepare --convert`; safe to resubmit by hand.")
    return BatchJob(name=spec.job_name, time=spec.walltime, output=f"{spec.log_dir}/convert-%j.out",
                    components=(node,), site=site, body=(run,), notes=(note,))


def render_script(spec: ConvertSpec) -> str:
    return render_batch(batch_job(spec))


def converter_argv(spec: ConvertSpec, python: str, miles_dir: str) -> list[str]:
    """torchrun (as a module, no PATH lookup) over the node's GPUs, then Miles's converter flags.

    One node, so the rendezvous stays on it: ``--standalone`` picks a free port (two conversions on
    one node do not clash, unlike a fixed master port), and ``--local-addr 127.0.0.1`` keeps it off
    the node's hostname, which need not resolve inside a job (it does not on the local cluster)."""
    return [python, "-m", "torch.distributed.run", "--standalone", "--local-addr=127.0.0.1",
            f"--nproc-per-node={spec.gpus}",
            str(Path(miles_dir, CONVERTER)), *spec.model_args,
            "--hf-checkpoint", spec.hf_checkpoint, "--save", spec.output]


# -- is it done? -------------------------------------------------------------------------------------
def output_complete(output: str | Path) -> bool:
    """Miles's success signal: the tracker says ``release`` (written last) and ``release/`` has files."""
    out = Path(output)
    try:
        tracker = (out / LATEST_FILE).read_text().strip()
    except (FileNotFoundError, NotADirectoryError):
        return False
    release = out / RELEASE
    return tracker == RELEASE and release.is_dir() and any(release.iterdir())


def read_marker(output: str | Path) -> dict[str, Any] | None:
    try:
        return json.loads(Path(output, MARKER).read_text())
    except FileNotFoundError:
        return None
    except json.JSONDecodeError as err:
        raise InputError(f"model.ref_load: {Path(output, MARKER)} is damaged ({err}); remove it and "
                          "the conversion output, then run prepare --convert again") from None


def conversion_state(spec: ConvertSpec) -> State:
    """``done``, ``missing`` (nothing there), or ``partial`` (leftovers of a failed try, safe to
    clear). Raises InputError for an output that must not be touched: one without beam-hpc's
    marker that looks complete (made by hand or by Miles's own scripts), or one made from
    another HF checkpoint or other architecture flags."""
    out = Path(spec.output)
    marker = read_marker(out)
    complete = output_complete(out)
    if marker is not None:
        if marker.get("key") != spec.key():
            raise InputError(
                f"model.ref_load: {out} holds a conversion of {marker.get('key')}, not of "
                f"{spec.key()}; point model.ref_load at a new directory (or remove {out} to convert again)")
        if complete:
            return "done"
    elif complete:
        raise InputError(
            f"model.ref_load: {out} already holds a torch_dist checkpoint that beam-hpc did not make (no {MARKER}); "
            "if it is this model's conversion, use it as it is and skip --convert, else remove it")
    if out.is_dir() and any((out / name).exists() for name in (*_PARTIAL, MARKER)):
        return "partial"
    return "missing"


def clear_partial(output: str | Path) -> list[str]:
    """Remove what a failed converter left (only its own names): Miles's ``shutil.move`` would nest
    a new ``iter_0000001`` inside an old ``release`` instead of replacing it."""
    out = Path(output)
    removed = []
    for name in (*_PARTIAL, MARKER):
        p = out / name
        if p.is_dir():
            shutil.rmtree(p)
        elif p.exists():
            p.unlink()
        else:
            continue
        removed.append(str(p))
    return removed


# -- login node: submit once ---------------------------------------------------------------------------
@dataclass(frozen=True)
class ConvertResult:
    spec: ConvertSpec
    action: Literal["skipped", "submitted", "pending"]
    job_id: str | None = None
    detail: str = ""


def queued_jobs(job_name: str) -> list[str]:
    """Job ids of this name that Slurm still has (pending or running)."""
    try:
        return slurm_client.queued_job_ids(job_name)
    except slurm_client.SlurmError as err:
        raise ConvertError(f"squeue failed: {err.detail}") from err


def submit_convert(recipe: Recipe, site: Site, *, walltime: str = DEFAULT_WALLTIME) -> ConvertResult:
    """Submit the conversion unless it is done or already queued; invalid input raises InputError."""
    spec = convert_spec(recipe, site, walltime=walltime)
    state = conversion_state(spec)
    if state == "done":
        return ConvertResult(spec, "skipped", detail=f"{spec.output} is already converted ({MARKER} present)")
    if not Path(spec.hf_checkpoint).is_dir():
        raise InputError(f"model.path: {spec.hf_checkpoint} is not a directory; download the HF checkpoint first "
                          "(beam-hpc prepare --model ID) or fix model.path")
    waiting = queued_jobs(spec.job_name)
    if waiting:
        return ConvertResult(spec, "pending", waiting[0], f"job {waiting[0]} ({spec.job_name}) is already queued or running")
    spec.log_dir.mkdir(parents=True, exist_ok=True)  # Slurm opens --output before the script runs
    write_atomic(spec.spec_path, spec.to_json())
    write_atomic(spec.script_path, render_script(spec))
    spec.script_path.chmod(0o755)
    try:
        job_id = slurm_client.sbatch([str(spec.script_path)], timeout=None)
    except slurm_client.NoJobId as err:
        raise ConvertError(f"could not read a job id from sbatch's output {err.stdout!r}") from err
    except slurm_client.SlurmError as err:
        raise ConvertError(f"sbatch refused the conversion job: {err.detail}") from err
    return ConvertResult(spec, "submitted", job_id, f"{state} -> converting in job {job_id}; log {spec.log_dir}")


# -- inside the allocation -----------------------------------------------------------------------------
def container_step(spec: ConvertSpec, spec_path: str, base: dict[str, str] | None = None) -> Command:
    """The ``exec`` phase under the site's container runtime, with the HF checkpoint, the output's
    parent and the work directory bound (the site's shared paths are bound anyway)."""
    site = spec.site_obj()
    py = site.node_python
    binds = [str(Path(spec.hf_checkpoint)), str(Path(spec.output).parent), spec.work_dir]
    return container_command(site, [py, "-m", "beam_hpc.backends.miles.convert", "exec", "--spec", spec_path],
                             {"PYTHONUNBUFFERED": "1"}, binds, base=base)


def output_lock(output: str | Path) -> Path:
    """The lock beside the output (not under one run's directory: several recipes may share one
    converted model), so that two conversion jobs never write the same ``model.ref_load``."""
    out = Path(output)
    return out.with_name(f".{out.name}.convert.lock")


def run(spec_path: str) -> int:
    """On the batch host, holding the output's lock: skip if done, clear leftovers, convert in the
    container, check, mark done. The squeue check at submission catches a queued twin by name; the
    lock catches the rest (two submissions racing past that check, a renamed job), with Slurm
    judging a lock left by a killed job stale as it does for a run's lock."""
    spec = ConvertSpec.load(spec_path)
    lock = output_lock(spec.output)
    slurm = SlurmEnvironment.current()
    me = run_lock.Holder.me(slurm.job_id, slurm.restart_count)
    try:
        previous = run_lock.acquire(lock, me)
    except run_lock.RunLockError as err:
        holder = run_lock.read_holder(lock)
        who = holder.describe() if holder else "another job"
        raise ConvertError(f"model.ref_load: {spec.output} is being converted by {who}; wait for it to end "
                           f"(`beam-hpc prepare --convert` then skips), or scancel it to start over ({err})") from err
    if previous is not None:
        log.warning("took over the conversion lock of %s", previous.describe())
    try:
        return _convert(spec, spec_path)
    finally:
        run_lock.release(lock, me)


def _convert(spec: ConvertSpec, spec_path: str) -> int:
    state = conversion_state(spec)
    if state == "done":
        log.info("%s is already converted; nothing to do", spec.output)
        return 0
    if state == "partial":
        log.warning("removed leftovers of an earlier try: %s", clear_partial(spec.output))
    Path(spec.output).mkdir(parents=True, exist_ok=True)
    cmd = container_step(spec, spec_path)
    log.info("converting %s -> %s: %s", spec.hf_checkpoint, spec.output, shlex.join(cmd.argv))
    t0 = time.time()
    rc = subprocess.run(cmd.argv, env=cmd.env, stdin=subprocess.DEVNULL, check=False).returncode
    if rc != 0:
        raise ConvertError(f"the converter exited with code {rc}; see the output above (job log under {spec.log_dir})")
    if not output_complete(spec.output):
        raise ConvertError(f"the converter exited 0 but {spec.output} is incomplete (no '{RELEASE}' in "
                           f"{LATEST_FILE}, or an empty {RELEASE}/); not marking it done")
    marker = {"key": spec.key(), "converter": CONVERTER, "gpus": spec.gpus, "seconds": round(time.time() - t0, 1),
              "job_id": SlurmEnvironment.current().job_id, "finished": time.time()}
    write_json_atomic(Path(spec.output, MARKER), marker, indent=2)
    log.info("converted in %.1f s; marked done: %s", marker["seconds"], Path(spec.output, MARKER))
    return 0


def miles_dir(environ: dict[str, str] | None = None) -> str:
    """The Miles tree inside the container: ``$MILES_DIR`` (beam-hpc's image sets it), else the
    directory above the ``miles`` package that Python imports."""
    env = os.environ if environ is None else environ
    if env.get(MILES_DIR_VAR):
        return env[MILES_DIR_VAR]
    import importlib.util

    found = importlib.util.find_spec("miles")
    if found is None or not found.submodule_search_locations:
        raise ConvertError(f"no Miles here: ${MILES_DIR_VAR} is unset and `import miles` fails; run inside "
                           "beam-hpc's image (container.image) or set MILES_DIR in the site's env")
    return str(Path(next(iter(found.submodule_search_locations))).parent)


def exec_converter(spec_path: str) -> None:
    """Inside the container: Miles and Megatron on PYTHONPATH (as Miles's scripts put them), exec torchrun."""
    spec = ConvertSpec.load(spec_path)
    root = miles_dir()
    script = Path(root, CONVERTER)
    if not script.is_file():
        raise ConvertError(f"{script}: Miles's converter is missing; check ${MILES_DIR_VAR} ({root})")
    paths = [root, os.environ.get(MEGATRON_VAR, ""), os.environ.get("PYTHONPATH", "")]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(dict.fromkeys(p for p in paths if p)))
    argv = converter_argv(spec, sys.executable, root)
    sys.stdout.flush()
    os.execve(argv[0], argv, env)


def main(argv: list[str] | None = None) -> int:
    log_to_stream()
    p = argparse.ArgumentParser(prog="python -m beam_hpc.backends.miles.convert")
    p.add_argument("phase", choices=["run", "exec"], help="run: on the batch host; exec: inside the container")
    p.add_argument("--spec", required=True, help="<output_dir>/convert/convert.json")
    a = p.parse_args(argv)
    try:
        if a.phase == "exec":
            exec_converter(a.spec)
        return run(a.spec)
    except (RuntimeFailure, InputError, OSError) as err:
        log.error("conversion failed: %s", err)
        return 1


if __name__ == "__main__":
    sys.exit(main())
