"""Heterogeneous Slurm jobs through submitit (a submitit plugin).

Why: submitit (1.5) cannot submit heterogeneous jobs (upstream issue 1741) and reads job states
only from `sacct`, which sites without slurmdbd (and the local test cluster) do not have. This
module adds, through submitit's plugin entry points (`[project.entry-points.submitit]` in
pyproject.toml), an executor named `beamhet` (``submitit.AutoExecutor(folder, cluster="beamhet")``):
component 0 takes the executor's usual parameters, each dict in `het_components` adds one more
component after `#SBATCH hetjob`, and job-level options are written once, in component 0. Job
states come from `squeue`, which lists het components as `<leader>+<offset>`.

Facts it relies on, checked on the local cluster: in every task of an `srun --het-group=0,1,...`
step SLURM_JOB_ID is the leader's and SLURM_PROCID is global, so submitit's `<id>_<procid>_*`
pickles line up; srun's `%j`/`%t` patterns expand per component for groups >= 1, so each task
redirects its own output instead of `srun -o`.
"""

from __future__ import annotations

import getpass
import os
import pickletools
import shlex
import shutil
import time
import typing as tp
from pathlib import Path

from submitit.core import core, logger, utils
from submitit.slurm import slurm

from beam_hpc.slurm import client
from beam_hpc.slurm.client import JobState
from beam_hpc.slurm.environment import SlurmEnvironment
from beam_hpc.slurm.script import HETJOB, directive, sbatch_option

CLUSTER_NAME = "beamhet"
"""The name to pass to `submitit.AutoExecutor(cluster=...)` and the prefix of its parameters."""

HET_COMPONENT_KEYS = frozenset({
    "nodes", "ntasks_per_node", "gpus_per_node", "cpus_per_task", "partition", "account",
    "mem", "constraint", "additional_parameters",
})
"""Keys a `het_components` entry may have; `additional_parameters` is a dict of extra sbatch
flags for that component (e.g. {"exclusive": True, "tmp": "2T"})."""

_COUNT_KEYS = ("nodes", "ntasks_per_node", "gpus_per_node", "cpus_per_task")

# Job states, most significant first: a hetjob's state is the first one any component has.
# (JobState members: beam-hpc spells Slurm's states once, in beam_hpc.slurm.client; being str,
# they compare equal to squeue's text)
_STATE_PRECEDENCE = tuple(JobState[name] for name in (
    "FAILED", "NODE_FAIL", "OUT_OF_MEMORY", "BOOT_FAIL", "DEADLINE", "TIMEOUT", "CANCELLED",
    "PREEMPTED", "REQUEUED", "REQUEUE_HOLD", "REQUEUE_FED", "SPECIAL_EXIT", "SUSPENDED",
    "STOPPED", "RESIZING", "SIGNALING", "STAGE_OUT", "RUNNING", "CONFIGURING", "COMPLETING",
    "PENDING", "COMPLETED",
))
VANISHED = "VANISHED"
"""State of a job that left the queue without a result pickle (killed, purged, lost)."""


def validate_het_components(components: tp.Any) -> list[dict[str, tp.Any]]:
    """Check `het_components` and return it with defaults filled in (ntasks_per_node=1).

    Raises ValueError naming the component index, the key and the fix.
    """
    if not isinstance(components, (list, tuple)):
        raise ValueError(f"het_components must be a list of dicts, got {type(components).__name__}")
    checked = []
    for i, comp in enumerate(components):
        if not isinstance(comp, dict):
            raise ValueError(f"het_components[{i}] must be a dict, got {type(comp).__name__}")
        unknown = sorted(set(comp) - HET_COMPONENT_KEYS)
        if unknown:
            raise ValueError(f"het_components[{i}] has unknown key(s) {unknown}; allowed: "
                             f"{sorted(HET_COMPONENT_KEYS)} (put other sbatch flags in "
                             "'additional_parameters')")
        for key in _COUNT_KEYS:
            value = comp.get(key)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int)
                                      or value < 1):
                raise ValueError(f"het_components[{i}].{key} = {value!r}: must be an integer >= 1")
        extra = comp.get("additional_parameters")
        if extra is not None and not isinstance(extra, dict):
            raise ValueError(f"het_components[{i}].additional_parameters must be a dict of sbatch "
                             f"flags, got {type(extra).__name__}")
        checked.append({"nodes": 1, "ntasks_per_node": 1, **comp})
    return checked


def _component_lines(comp: dict[str, tp.Any]) -> list[str]:
    """``#SBATCH hetjob`` and one component's lines, written by beam-hpc's one option writer
    (:func:`beam_hpc.slurm.script.sbatch_option`): an ``additional_parameters`` key replaces the
    same option named by the component (``ntasks_per_node`` and ``ntasks-per-node`` are one)."""
    flags = {k: v for k, v in comp.items() if k != "additional_parameters" and v is not None}
    flags.update({k.replace("-", "_"): v for k, v in (comp.get("additional_parameters") or {}).items()})
    return [HETJOB] + [directive(sbatch_option(k.replace("_", "-"), v)) for k, v in flags.items()]


def _task_path(template: Path) -> str:
    """Shell word for a submitit log path in which %j is the leader's job id and %t the global
    task rank, both expanded by the task itself (srun's own %j/%t are wrong for het groups)."""
    parts = []
    for i, chunk in enumerate(str(template).split("%t")):
        if i:
            parts.append('"${SLURM_PROCID}"')
        for k, piece in enumerate(chunk.split("%j")):
            if k:
                parts.append('"${SLURM_JOB_ID}"')
            if piece:
                parts.append(shlex.quote(piece))
    return "".join(parts)


def make_het_sbatch_text(command: str, folder: str | Path,
                         parameters: dict[str, tp.Any]) -> str:
    """The sbatch script for `parameters` (SlurmExecutor's, plus `het_components`).

    Builds component 0 with submitit's own script writer (so job-level flags appear exactly once),
    inserts one `#SBATCH hetjob` block per extra component, and replaces submitit's srun line with
    one that runs every het group and lets each task redirect its own stdout/stderr.
    """
    params = dict(parameters)
    components = validate_het_components(params.pop("het_components", None) or [])
    srun_args = list(params.pop("srun_args", None) or [])
    if not params.pop("use_srun", True):
        raise ValueError(f"{CLUSTER_NAME}: use_srun=False is not supported (the het groups are "
                         "started with srun); drop the parameter")
    if components and params.get("ntasks_per_node") is None:
        params["ntasks_per_node"] = 1  # otherwise the het step asks for more CPUs than allocated
    stderr_to_stdout = bool(params.get("stderr_to_stdout", False))
    paths = utils.JobPaths(folder)
    out = _task_path(paths.stdout)
    err = "2>&1" if stderr_to_stdout else "2>> " + _task_path(paths.stderr)
    inner = f"exec {command} >> {out} {err}"
    # srun refuses --het-group in an ordinary job ("No directives to start application...").
    # A caller that names its own --het-group in srun_args (e.g. a single task on group 0 that
    # starts the other steps itself) keeps it.
    het_group = [f"--het-group={','.join(str(g) for g in range(len(components) + 1))}"]
    if any(a.startswith("--het-group") for a in srun_args):
        het_group = []
    srun = " ".join(["srun", "--unbuffered", *(het_group if components else []),
                     *(shlex.quote(a) for a in srun_args), "bash", "-c", shlex.quote(inner)])
    text = slurm._make_sbatch_string(command=srun, folder=folder, use_srun=False, **params)

    lines = text.split("\n")
    stock_export = "export SUBMITIT_EXECUTOR=slurm"
    if lines.count(stock_export) != 1:
        raise RuntimeError("submitit's sbatch template changed (no single "
                           f"'{stock_export}' line); beam_hpc.slurm.submitit_het needs an update")
    lines[lines.index(stock_export)] = f"export SUBMITIT_EXECUTOR={CLUSTER_NAME}"
    end = lines.index("# Parameters") + 1  # component 0's flags follow this line
    while end < len(lines) and lines[end].startswith("#SBATCH"):
        end += 1
    has_dependency = bool(params.get("dependency")
                          or (params.get("additional_parameters") or {}).get("dependency"))
    extra = []
    for comp in components:
        extra += _component_lines(comp)
        if has_dependency and "dependency" not in (comp.get("additional_parameters") or {}):
            # Slurm propagates the dependency to every component, and a propagated `singleton`
            # waits for component 0 (same name) forever. Component 0's dependency already holds
            # back the whole hetjob (its components start together), so clear it here.
            extra.append(directive(sbatch_option("dependency", "")))
    out = lines[:end] + extra + lines[end:]
    if components:
        # sbatch (22.05, checked on the local cluster) drops the empty lines of a heterogeneous
        # job's script: without them, the text submitted (and a dry run's) is the one Slurm keeps
        return "\n".join(line for line in out if line) + "\n"
    return "\n".join(out)


def submission_text(folder: str | Path, python: str, parameters: dict[str, tp.Any]) -> str:
    """The script ``HetSlurmExecutor(folder, python=python)`` submits with ``parameters``, made
    without an executor (submitit refuses to build one where there is no ``srun``, and a dry run
    may be on a laptop): the parameters as its ``update_parameters`` keeps them, and the command as
    submitit 1.5.4's ``SlurmExecutor._submitit_command_str`` writes it (submitit/slurm/slurm.py)."""
    params = dict(parameters)
    if params.get("het_components") is not None:
        params["het_components"] = validate_het_components(params["het_components"])
    where = Path(folder).expanduser().absolute()
    command = " ".join([python, "-u -m submitit.core._submit", shlex.quote(str(where))])
    return make_het_sbatch_text(command, where, params)


def _result_outcome(result_pickle: Path) -> str | None:
    """'success' or 'error' from a submitit result pickle, read without unpickling the result
    (which may need the job's own modules); None when absent or unreadable."""
    try:
        with result_pickle.open("rb") as fh:
            for opcode, arg, _ in pickletools.genops(fh):
                if "UNICODE" in opcode.name:
                    return arg if arg in ("success", "error") else None
    except (OSError, ValueError, EOFError):
        return None
    return None


def aggregate_state(states: tp.Iterable[str]) -> str:
    """One state for a hetjob from its components' states (see _STATE_PRECEDENCE)."""
    seen = [s.split()[0].rstrip("+") for s in states if s]
    for state in _STATE_PRECEDENCE:
        if state in seen:
            return state.value
    return seen[0] if seen else JobState.UNKNOWN.value


class HetSlurmInfoWatcher(core.InfoWatcher):
    """Job states from `squeue --states=all`, so `Job.state`/`done()` work without slurmdbd.

    A job that is no longer listed (Slurm purges finished jobs after MinJobAge) is COMPLETED or
    FAILED according to its task-0 result pickle, or VANISHED (done) when it has none; a job is
    only declared gone once it was seen in the queue or `vanish_grace_s` after registration.
    """

    def __init__(self, delay_s: int = 60, vanish_grace_s: float = 10.0) -> None:
        super().__init__(delay_s=delay_s)
        self.vanish_grace_s = vanish_grace_s
        self._registered_at: dict[str, float] = {}
        self._seen: set[str] = set()
        self._result_pickles: dict[str, Path] = {}

    def register_job(self, job_id: str) -> None:
        super().register_job(job_id)
        self._registered_at.setdefault(job_id, time.monotonic())

    def register_result_pickle(self, job_id: str, path: Path) -> None:
        self._result_pickles[job_id] = path

    def _make_command(self) -> list[str] | None:
        if not self._registered - self._finished:
            return None
        # No --jobs: squeue fails outright when any listed id is already purged.
        # Not through beam_hpc.slurm.client: submitit's InfoWatcher.update() runs the command this
        # returns itself (throttled, with its own error handling) and hands the text to read_info;
        # running it here instead would mean replacing update(), i.e. changing submitit's behaviour.
        return ["squeue", "--noheader", "--states=all", f"--user={getpass.getuser()}",
                "--format=%i|%T|%N"]

    def get_state(self, job_id: str, mode: str = "standard") -> str:
        return self.get_info(job_id, mode=mode).get("State") or JobState.UNKNOWN.value

    def read_info(self, string: bytes | str) -> dict[str, dict[str, str]]:
        if isinstance(string, bytes):
            string = string.decode()
        rows: dict[str, list[tuple[str, str]]] = {}
        for line in string.splitlines():
            fields = line.strip().split("|")
            if len(fields) != 3:
                continue
            raw_id, state, nodes = fields
            job_id = raw_id.split("+", 1)[0]  # het component "7+1" belongs to job 7
            rows.setdefault(job_id, []).append((state, nodes))
        info = {job_id: {"JobID": job_id, "State": aggregate_state(s for s, _ in comps),
                         "NodeList": ",".join(n for _, n in comps if n)}
                for job_id, comps in rows.items()}
        self._seen.update(j for j in info if j in self._registered)
        now = time.monotonic()
        for job_id in self._registered - self._finished - set(info):
            pickle = self._result_pickles.get(job_id)
            outcome = _result_outcome(pickle) if pickle is not None else None
            if outcome is not None:
                info[job_id] = {"JobID": job_id, "State": (JobState.COMPLETED if outcome == "success"
                                                           else JobState.FAILED).value, "NodeList": ""}
            elif job_id in self._seen or now - self._registered_at.get(job_id, now) > \
                    self.vanish_grace_s:
                info[job_id] = {"JobID": job_id, "State": VANISHED, "NodeList": ""}
        return info


class HetSlurmJob(slurm.SlurmJob[core.R]):
    """A submitit Slurm job whose state comes from squeue (see HetSlurmInfoWatcher)."""

    watcher = HetSlurmInfoWatcher(delay_s=60)

    def _register_in_watcher(self) -> None:
        super()._register_in_watcher()
        if not self._tasks[0]:
            task0 = utils.JobPaths(self.paths.folder, job_id=self.job_id, task_id=0)
            self.watcher.register_result_pickle(self.job_id, task0.result_pickle)


class HetSlurmJobEnvironment(slurm.SlurmJobEnvironment):
    """Inside a task: submitit's Slurm environment plus where the task sits in the hetjob.

    Global rank, job id and paths are submitit's (SLURM_PROCID, leader SLURM_JOB_ID). The het
    group is found from the per-group task counts (SLURM_NTASKS_HET_GROUP_k) and the node index
    from the group's node list, so both hold however tasks are spread.
    """

    @classmethod
    def name(cls) -> str:
        return CLUSTER_NAME

    def _requeue(self, countdown: int) -> None:
        """submitit's preemption path requeues from inside the job; its own ``scontrol requeue``
        call can die of the SIGTERM that very requeue sends, and the job is then recorded as
        failed although Slurm requeued it. beam-hpc's client survives that signal. The line goes
        to submitit's logger, the one a submitit task configures, as submitit's own does."""
        client.requeue(self.job_id, timeout=60)
        logger.get_logger().info(f"Requeued job {self.job_id} ({countdown} remaining timeouts)")

    @property
    def het_size(self) -> int:
        """Number of het groups (1 for an ordinary job)."""
        return SlurmEnvironment.current().het_size

    def _group_task_counts(self) -> list[int]:
        if self.het_size == 1:
            return [self.num_tasks]
        env = SlurmEnvironment.current()
        counts = [env.ntasks(g) for g in range(self.het_size)]
        if any(c is None for c in counts):
            raise RuntimeError(f"Slurm gave no task count for some het group ({counts}); run inside the het job")
        return [int(c) for c in counts if c is not None]

    @property
    def het_group(self) -> int:
        """Index of the het group (component) this task runs in."""
        rank, start = self.global_rank, 0
        for group, count in enumerate(self._group_task_counts()):
            if rank < start + count:
                return group
            start += count
        raise RuntimeError(f"task {rank} is beyond the het groups' task counts "
                           f"{self._group_task_counts()}")

    @property
    def het_group_rank(self) -> int:
        """Rank of this task within its het group."""
        return self.global_rank - sum(self._group_task_counts()[:self.het_group])

    @property
    def het_group_hostnames(self) -> list[str]:
        """Slurm node names of this task's het group, in allocation order."""
        if self.het_size == 1:
            return list(self.hostnames)
        return slurm._parse_node_list(SlurmEnvironment.current().nodelist(self.het_group))

    @property
    def het_group_node(self) -> int:
        """Index of this task's node within its het group's node list."""
        node = os.environ.get("SLURMD_NODENAME", self.hostname)
        return self.het_group_hostnames.index(node)


class HetSlurmExecutor(slurm.SlurmExecutor):
    """submitit's SlurmExecutor plus heterogeneous components and squeue-based job states.

    Parameters are SlurmExecutor's plus `het_components` (list of dicts, keys in
    HET_COMPONENT_KEYS). Without `het_components` it submits an ordinary job, still with squeue
    states. Job arrays are refused: Slurm has no heterogeneous job arrays.
    """

    job_class = HetSlurmJob

    @classmethod
    def name(cls) -> str:
        return CLUSTER_NAME

    @classmethod
    def affinity(cls) -> int:
        # 1, below slurm's 2: AutoExecutor(folder) without cluster= keeps choosing "slurm".
        return -1 if shutil.which("srun") is None else 1

    @classmethod
    def _valid_parameters(cls) -> set[str]:
        return super()._valid_parameters() | {"het_components"}

    def _internal_update_parameters(self, **kwargs: tp.Any) -> None:
        components = kwargs.pop("het_components", None)
        if components is not None:
            components = validate_het_components(components)
        super()._internal_update_parameters(**kwargs)
        if components is not None:
            self.parameters["het_components"] = components

    def _internal_process_submissions(
        self, delayed_submissions: list[utils.DelayedSubmission]
    ) -> list[core.Job[tp.Any]]:
        if len(delayed_submissions) > 1:
            raise ValueError(f"{CLUSTER_NAME}: job arrays (executor.batch / map_array) are not "
                             "supported because Slurm has no heterogeneous job arrays; submit "
                             "jobs one at a time")
        return super()._internal_process_submissions(delayed_submissions)

    def _make_submission_file_text(self, command: str, uid: str) -> str:
        return make_het_sbatch_text(command, self.folder, self.parameters)

    def _num_tasks(self) -> int:
        components = self.parameters.get("het_components") or []
        tasks_per_node = max(1, self.parameters.get("ntasks_per_node") or 1)
        first = self.parameters.get("nodes", 1) * tasks_per_node
        return first + sum(c["nodes"] * c["ntasks_per_node"] for c in components)
