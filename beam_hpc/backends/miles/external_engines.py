"""SGLang engines in a rollout-only Slurm job, registered in the run directory, and the rule that
decides whether a Miles segment may attach them: only where Miles's own code starts attached engines.

An extra job starts ``python -m sglang.launch_server`` per engine (:func:`engine_argv`: the run's
model, TP from the recipe's rollout engine size, ports from the job's own band, :func:`engine_ports`)
and records the addresses in ``RUN/elastic/engines/<job_id>.json`` (:func:`register`).

Where Miles stands (radixark/miles, main read at 31f1ca961; miles-rl 0.0.2 from PyPI), facts that
:func:`refusal` encodes and ``tests/backends/miles/test_miles_placement.py`` checks on Ray:

- ``--rollout-external`` (store_true) and ``--rollout-external-engine-addrs`` (nargs "+") are
  ``miles/utils/arguments.py:823-835``. Engine ``rank`` reaches ``addrs[rank]``
  (``miles/ray/rollout/addr_allocator.py:118``).
- Miles main lays the placement group out as ``(actor GPUs, actor GPUs)`` whenever
  ``rollout_external`` is set, before it looks at ``--colocate`` (``miles/ray/placement_group.py:97-99``,
  since #1735, dec268f70), so the rollout's slice of bundles is empty; ``ServerGroup.start_engines``
  then indexes it for every engine (``miles/ray/rollout/server_group.py:90-91``,
  ``reordered_gpu_ids[gpu_index]``): IndexError before any engine is reached, colocated or not.
  Miles's only test of the path (``tests/test_external_rollout.py``) is colocated and marks
  non-colocated as a TODO; at 31f1ca961 it meets the same empty slice.
- miles-rl 0.0.2 (before #1735) ignores ``rollout_external`` in its layout
  (``miles/ray/placement_group.py:82-122`` there): a non-colocated run reserves the rollout GPUs in
  the trainer's own placement group and places one 0.2-GPU proxy actor per engine on them; a
  colocated run puts them on the trainer's bundles.
- A colocated run sends weights to its engines as CUDA IPC handles
  (``miles/backends/megatron_utils/actor.py:253-254``: ``colocate`` -> ``UpdateWeightFromTensor``), which only
  a process on the trainer's own GPUs can open: Miles's external test starts its engine on those GPUs.
  An extra job's engines are on other nodes.

So no Miles configuration today starts the engines an extra job brings: ``beam-hpc rollout add`` on
a Miles run exits 2 with that line (``beam_hpc.cli.rollout``), and a segment that finds engines
registered (by an older beam-hpc) leaves them out with the line in its log (:func:`attach`).
:func:`attach_live` is the segment-start half that would run once Miles's layout gives an external
rollout its bundles: the flags in the shape Miles's parser reads them (its real parser checks them
in ``test_external_engines_real.py``), live engines only.

The engines' own settings mirror what Miles passes the engines it launches itself, and the ones it
compares at attach (31f1ca961 ``sglang_engine._compute_server_args``): among them the seed,
``seed + rank`` (``sglang_engine.py:718``), which :func:`engine_argv` gives each engine by its rank.
"""

from __future__ import annotations

import json
import os
import time
import urllib.request
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from beam_hpc.backends.miles.architecture import flag_values
from beam_hpc.backends.miles.args import LAUNCHER_MODULE
from beam_hpc.config.site import Site
from beam_hpc.errors import InputError
from beam_hpc.files import locked, write_json_atomic
from beam_hpc.logging_setup import module_logger
from beam_hpc.plan.plan import Plan
from beam_hpc.plan.ports import SGLANG_ENGINE, band_port

logger = module_logger(__name__)

ENGINES_DIR = ("elastic", "engines")
LOCK_FILE = ".lock"  # serializes the nodes of one job registering into its record
SERVER_MODULE = "sglang.launch_server"
HEALTH_PATH = "/health"
HEALTH_TIMEOUT_S = 3.0
# Miles flags whose values carry over to its engines as SGLang's own flags (``--sglang-X`` -> ``--X``),
# except the ones that configure Miles's router or client rather than a server.
MILES_ONLY_SGLANG_FLAGS = frozenset({"--sglang-server-concurrency", "--sglang-config", "--sglang-router-ip",
                                     "--sglang-router-port", "--sglang-router-policy",
                                     "--sglang-router-request-timeout-secs"})
# What segment start adds or sets in the Miles argv (beam_hpc.backends.miles.flags lists them as owned).
ATTACH_FLAGS = ("--rollout-external", "--rollout-external-engine-addrs", "--worker-urls")


@dataclass(frozen=True)
class Engine:
    """One SGLang server of an extra job: where Miles reaches it (``host:port``), how many GPUs it
    spans (``tp``) and which job registered it (empty before it is registered)."""

    host: str
    port: int
    tp: int
    job_id: str = ""

    @property
    def addr(self) -> str:
        return f"{self.host}:{self.port}"

    @property
    def url(self) -> str:
        return f"http://{self.addr}"


# -- the engines' command and ports ---------------------------------------------------------------


# Why a Miles run takes no extra engines (radixark/miles@31f1ca961; the module docstring has the facts).
MILES_LAYOUT = ("with --rollout-external, Miles (radixark/miles@31f1ca96) gives its rollout an empty slice of the "
                "trainer's placement group (miles/ray/placement_group.py:97-99) and then indexes it for every engine "
                "(miles/ray/rollout/server_group.py:90-91): IndexError before any engine is reached")
NOT_COLOCATED = ("backend: miles: Miles cannot start engines it did not launch on a run with its own rollout group: "
                 + MILES_LAYOUT + "; give the run more rollout nodes (topology.rollout.nodes) and resubmit it instead")
COLOCATED = ("training.colocated: true: Miles cannot start engines on other nodes for a colocated run: "
             + MILES_LAYOUT + "; and a colocated run updates its engines' weights by CUDA IPC "
             "(miles/backends/megatron_utils/actor.py:253-254), which only the trainer's own GPUs can take; give the "
             "run more trainer nodes (topology.trainer.nodes) and resubmit it instead")


def refusal(plan: Plan) -> str | None:
    """Why this run cannot attach extra engines (one line naming the field and the Miles code line),
    or None. Every Miles run today: see the module docstring."""
    if plan.recipe.backend != "miles":
        return None
    t = plan.recipe.training
    if t.colocated:
        return COLOCATED
    if t.mode == "lora":
        return ("training.mode: lora: attached engines are started without the run's adapter settings; "
                "extra engines serve full-weight runs only")
    return NOT_COLOCATED


def gpus_per_engine(plan: Plan) -> int:
    """SGLang TP of each engine: what the driver tells Miles (``--rollout-num-gpus-per-engine``)."""
    value = flag_values(list(plan.driver_argv)).get("--rollout-num-gpus-per-engine")
    return int(value) if value else plan.recipe.topology.rollout.gpus_per_engine


def engine_ports(site: Site, job_id: int, n: int) -> list[int]:
    """``n`` distinct server ports for extra job ``job_id`` (node ``k`` of the job takes the ``k``-th
    run of its engines), from slots ``job_id * gpus_per_node + i`` of the SGLang band of the site's
    port plan (``beam_hpc.plan.ports``), a band no Ray or weight-sync port of any job uses, so the
    run's own ports never collide with its extra jobs'. Distinct across the job's nodes, so nodes
    that share an address (a one-host test cluster) do not clash either; two jobs share a port only
    when their ids are ``port_span / gpus_per_node`` apart (250 with the defaults), or closer than
    the first one's node count."""
    per_node = max(site.gpus_per_node, 1)
    if not 0 < n <= site.ray.port_span:
        raise InputError(f"engine ports: {n} is not between 1 and site ray.port_span ({site.ray.port_span}); "
                         "raise ray.port_span for this many engines in one job")
    ports = [band_port(site.ray, SGLANG_ENGINE, job_id * per_node + i) for i in range(n)]
    if max(ports) > 65535:
        raise InputError(f"site ray.gcs_port_base: {site.ray.gcs_port_base} with ray.port_span {site.ray.port_span} "
                         f"puts SGLang engine ports at {max(ports)} (> 65535); lower ray.gcs_port_base or ray.port_span")
    return ports


def engine_argv(plan: Plan, *, host: str, port: int, gpu_ids: list[int], rank: int) -> list[str]:
    """``python -m sglang.launch_server ...`` for engine ``rank`` on ``gpu_ids`` (consecutive, one node).

    The values Miles compares with ``/get_server_info`` when it attaches an engine (TP, host, port,
    one node, GPU step 1, memory saver off as in a dedicated pool) are set as Miles would set them;
    so are the ones it passes its own engines without comparing (model, remote code, no warm-up,
    draft-weight backup, metrics) and every ``--sglang-*`` flag of the driver, as SGLang's own flag.
    The seed is Miles's, ``seed + rank`` (31f1ca961 ``sglang_engine.py:718``): ``rank`` is the
    engine's slot in its job's port band (:func:`engine_rank`), distinct wherever the ports are.

    Access: the server binds ``host``, the node's own address on the site's network, never every
    interface, and gets no ``--api-key``. A key would lock Miles out: SGLang (as shipped in
    miles-rl 0.0.2, ``srt/utils/auth.py``) then wants it on every endpoint but the health ones, and
    Miles calls ``/get_server_info`` of an attached engine with no key at all (31f1ca961
    ``sglang_engine.py:225-228``; its health wait sends ``api_key=None``, ``:238-242``), as it
    sends none with its weight updates (``_make_request``). Reaching an engine therefore takes a
    process inside the cluster's network, as reaching the run's own Ray and NCCL ports does.
    """
    why = refusal(plan)
    if why is not None and why != NOT_COLOCATED:  # settings no engine of this run could be started with
        raise InputError(why)
    if rank < 0:
        raise InputError(f"rank: {rank} is not an engine rank; give 0 or more")
    tp = gpus_per_engine(plan)
    if len(gpu_ids) != tp or gpu_ids != list(range(gpu_ids[0], gpu_ids[0] + tp)) or gpu_ids[0] < 0:
        raise InputError(f"gpu_ids: {gpu_ids} are not {tp} consecutive GPUs (topology.rollout.gpus_per_engine)")
    if tp > plan.site.gpus_per_node:
        raise InputError(f"topology.rollout.gpus_per_engine: {tp} spans nodes (site gpus_per_node "
                         f"{plan.site.gpus_per_node}); extra engines are one node each")
    argv = [plan.node_python, "-m", SERVER_MODULE,
            "--model-path", plan.recipe.model.path, "--trust-remote-code",
            "--host", host, "--port", str(port),
            "--tp-size", str(tp), "--base-gpu-id", str(gpu_ids[0]), "--gpu-id-step", "1",
            "--random-seed", str(plan.recipe.seed + rank),
            "--skip-server-warmup", "--enable-draft-weights-cpu-backup", "--enable-metrics"]
    return argv + _sglang_flags(list(plan.driver_argv))


def engine_rank(site: Site, job_id: int, k: int) -> int:
    """Engine ``k`` of extra job ``job_id``'s rank: its slot in the SGLang band (:func:`engine_ports`
    takes the same slot), so two engines of the run share a seed only where they would share a port."""
    return job_id * max(site.gpus_per_node, 1) + k


def _sglang_flags(driver_argv: list[str]) -> list[str]:
    """The Miles argv's ``--sglang-X [values]`` as ``--X [values]`` (what Miles hands its engines)."""
    miles = driver_argv[driver_argv.index("--") + 2:] if "--" in driver_argv else []
    out: list[str] = []
    keep = False
    for tok in miles:
        if tok.startswith("--"):
            keep = tok.startswith("--sglang-") and tok not in MILES_ONLY_SGLANG_FLAGS
            if keep:
                out.append("--" + tok[len("--sglang-"):])
        elif keep:
            out.append(tok)
    return out


# -- registration ---------------------------------------------------------------------------------


def engines_dir(run_dir: str | Path) -> Path:
    return Path(run_dir).joinpath(*ENGINES_DIR)


def register(run_dir: str | Path, job_id: int | str, engines: Sequence[Engine | Mapping[str, object]]) -> Path:
    """Record engines of extra job ``job_id`` (``Engine`` or ``{"host", "port", "tp"}``), atomically,
    mode 0600 in a 0700 directory. Each node of the job registers its own: the job's record keeps
    the engines other nodes registered and replaces those at the same address."""
    d = engines_dir(run_dir)
    d.mkdir(parents=True, exist_ok=True)
    os.chmod(d, 0o700)
    path = d / f"{job_id}.json"
    new = [e if isinstance(e, Engine) else Engine(str(e["host"]), int(str(e["port"])), int(str(e["tp"])))
           for e in engines]
    with locked(d / LOCK_FILE, mode=0o600):
        kept = [e for e in _read(path) if e.addr not in {n.addr for n in new}] if path.exists() else []
        record = {"job_id": str(job_id), "time": time.time(),
                  "engines": [{"host": e.host, "port": e.port, "tp": e.tp} for e in [*kept, *new]]}
        write_json_atomic(path, record, mode=0o600)
    return path


def deregister(run_dir: str | Path, job_id: int | str) -> bool:
    """Remove extra job ``job_id``'s record; whether there was one."""
    try:
        (engines_dir(run_dir) / f"{job_id}.json").unlink()
    except FileNotFoundError:
        return False
    return True


def registered(run_dir: str | Path) -> list[Engine]:
    """Every registered engine, by job id then order; an unreadable record is skipped with a log line."""
    d = engines_dir(run_dir)
    out: list[Engine] = []
    for path in sorted(d.glob("*.json"), key=lambda p: (len(p.stem), p.stem)) if d.is_dir() else []:
        try:
            out += _read(path)
        except (OSError, ValueError, KeyError, TypeError) as err:
            logger.warning("engine record %s left out: unreadable (%s)", path, err)
    return out


def _read(path: Path) -> list[Engine]:
    record = json.loads(path.read_text())
    return [Engine(str(e["host"]), int(e["port"]), int(e["tp"]), str(record["job_id"])) for e in record["engines"]]


# -- segment start ----------------------------------------------------------------------------------


def healthy(engine: Engine, timeout_s: float = HEALTH_TIMEOUT_S) -> bool:
    """Whether the engine answers ``GET /health`` with 200 (what SGLang serves once it is up)."""
    try:
        with urllib.request.urlopen(engine.url + HEALTH_PATH, timeout=timeout_s) as resp:  # noqa: S310 - http only
            return resp.status == 200
    except OSError:
        return False


def _job_running(job_id: str) -> bool:
    from beam_hpc.slurm.client import JobState, SlurmError, job_state

    try:
        return job_state(job_id) == JobState.RUNNING
    except SlurmError as err:
        logger.warning("Slurm did not answer for extra job %s (%s)", job_id, err.last_line())
        return False


def live(engines: Sequence[Engine], *, running: Callable[[str], bool] = _job_running,
         probe: Callable[[Engine], bool] = healthy) -> list[Engine]:
    """The engines whose job Slurm says is running and that answer; a line in the log for each other."""
    states = {job: running(job) for job in dict.fromkeys(e.job_id for e in engines)}
    out = []
    for e in engines:
        if not states[e.job_id]:
            logger.warning("engine %s of extra job %s left out: the job is no longer running", e.addr, e.job_id)
        elif not probe(e):
            logger.warning("engine %s of extra job %s left out: no answer on %s", e.addr, e.job_id, HEALTH_PATH)
        else:
            out.append(e)
    return out


def attach_argv(argv: list[str], engines: Sequence[Engine]) -> list[str]:
    """The driver argv with ``engines`` attached: ``--rollout-num-gpus`` set to their GPUs, then
    ``--rollout-external --rollout-external-engine-addrs ... --worker-urls ...`` (Miles's own router
    starts with them) and ``--use-fault-tolerance`` (Miles's health monitor watches them)."""
    if not engines:
        return list(argv)
    out = _set_flag(list(argv), "--rollout-num-gpus", str(sum(e.tp for e in engines)))
    out += ["--rollout-external", "--rollout-external-engine-addrs", *(e.addr for e in engines),
            "--worker-urls", *(e.url for e in engines)]
    if "--use-fault-tolerance" not in out:
        out.append("--use-fault-tolerance")
    return out


def attach(plan: Plan, argv: list[str], *, running: Callable[[str], bool] = _job_running,
           probe: Callable[[Engine], bool] = healthy) -> list[str]:
    """At segment start: the driver argv, with the live registered engines attached where Miles
    starts them (:func:`refusal`: nowhere today, so each segment that finds engines registered
    says in its log why it leaves them out and runs with the run's own rollout group)."""
    if plan.recipe.backend != "miles" or LAUNCHER_MODULE not in argv or "--" not in argv:
        return list(argv)
    engines = registered(plan.output_dir)
    if not engines:
        return list(argv)
    why = refusal(plan)
    if why is not None:
        logger.warning("%d registered engines left out: %s", len(engines), why)
        return list(argv)
    return attach_live(plan, argv, engines, running=running, probe=probe)


def attach_live(plan: Plan, argv: list[str], engines: Sequence[Engine], *,
                running: Callable[[str], bool] = _job_running,
                probe: Callable[[Engine], bool] = healthy) -> list[str]:
    """``engines`` of the run's TP whose job runs and that answer, attached to ``argv`` when they
    bring at least the run's own rollout GPUs (Miles launches none of its own once given
    ``--rollout-external``, and fixes the set for its process); else ``argv``. Each engine left out
    gets a line in the log."""
    tp = gpus_per_engine(plan)
    wrong = [e for e in engines if e.tp != tp]
    for e in wrong:
        logger.warning("engine %s of extra job %s left out: TP %d, the run's engines have %d", e.addr, e.job_id, e.tp, tp)
    engines = live([e for e in engines if e.tp == tp], running=running, probe=probe)
    own = flag_values(argv).get("--rollout-num-gpus")
    own_gpus = int(own) if own else 0
    attached = sum(e.tp for e in engines)
    if engines and attached < own_gpus:
        logger.warning("%d live extra engines (%d GPUs) left out: with --rollout-external Miles launches none of "
                       "its own, and they hold fewer GPUs than the run's rollout group (%d)",
                       len(engines), attached, own_gpus)
        return list(argv)
    if engines:
        logger.info("attaching %d extra engines (%d GPUs) in place of the run's rollout group: %s",
                    len(engines), attached, " ".join(e.addr for e in engines))
    return attach_argv(argv, engines)


def _set_flag(argv: list[str], flag: str, value: str) -> list[str]:
    """``flag`` given ``value``: in its place where the argv has it (``--flag v``), else appended."""
    if flag not in argv:
        return [*argv, flag, value]
    i = argv.index(flag)
    had_value = i + 1 < len(argv) and not argv[i + 1].startswith("--")
    return [*argv[: i + 1], value, *argv[i + 1 + had_value:]]
