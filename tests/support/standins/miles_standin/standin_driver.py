"""Contract double of Miles's training driver loop (``train.py`` / ``train_async.py``), tests only.

Miles cannot run on these machines (GPU image, SGLang, Megatron on CUDA), so the launch path is
tested against this double of what beam-hpc relies on, written from Miles's documented behaviour
(radixark/miles@31f1ca961, read for facts only):

- its flags: the topology flags, ``--load`` / ``--save`` / ``--save-interval``,
  ``--save-trigger-sentinel``, ``--num-rollout``, ``--rollout-batch-size``, ``--ref-load``,
  ``--dump-details`` (unknown flags are accepted, as they would be by Miles's full parser);
- resume: if ``--load`` holds ``latest_checkpointed_iteration.txt`` naming rollout ``k``, training
  starts at ``k + 1`` and the data cursor comes from ``rollout/global_dataset_state_dict_k.pt``;
  otherwise it starts at 0 from ``--ref-load``;
- saves happen only at a rollout boundary, after the rollout's training and before its weight
  update (``train.py`` and ``train_async.py``: the sentinel is looked for between
  ``actor_model.train`` and ``actor_model.update_weights``, so a save lands even when the update
  would then wait for an engine that cannot come back): every ``--save-interval`` rollouts
  (``(rollout_id + 1) % interval == 0``), whenever the sentinel file exists (it is removed after
  the checkpoint is written), and after the last rollout; a save writes the data cursor, the
  Megatron iteration directory ``iter_<7 digits>``, and the tracker file last;
- it stops after rollout ``num_rollout - 1``;
- metrics: with ``--use-tensorboard`` it writes TensorBoard scalars to ``TENSORBOARD_DIR`` under the
  names Miles writes, step = the rollout id (facts from miles-rl 0.0.2 ``miles/ray/rollout.py``
  ``_log_rollout_data`` / ``_log_eval_rollout_data``, ``miles/utils/train_metric_utils.py``
  ``log_perf_data_raw``, ``miles/backends/training_utils/log_utils.py`` ``log_rollout_data``):
  per rollout ``rollout/raw_reward``, ``rollout/response_len/{mean,median,max,min}``,
  ``perf/rollout_time``, ``perf/train_wait_time``, ``perf/train_time``, ``perf/step_time``, and
  ``perf/save_model_time`` with the step *after* a save (Miles's timer is logged and reset at the
  end of each step's training, so a run's last save is never logged); every ``--eval-interval``
  rollouts ``eval/<name>``, ``eval/<name>/response_len/{...}`` and, with ``--log-reward-category``,
  ``eval/<name>/error_cat/<value>``. tests/backends/miles/test_miles_metrics.py checks these names against the tags
  miles-rl's own logging code writes.

Rollout engines (under a Ray cluster, not colocated, with rollout GPUs): as Miles's rollout manager,
it starts one SGLang engine per ``--rollout-num-gpus-per-engine`` GPUs of the rollout slice of its
placement group (a Ray actor that runs the SGLang stand-in, ``tests/support/standins/sglang_standin``),
sends each rollout's ``--rollout-batch-size x --n-samples-per-prompt`` requests to them, and after each
rollout's training pushes the new weight version to every engine. With ``--use-fault-tolerance`` a
health monitor checks the engines, kills one that fails its check, and the next weight update starts
it again on the same placement-group bundle, as Miles main does: the facts, with Miles's file and
line numbers, are in ``miles/utils/health_monitor.py`` of this double (the monitor), with
``miles/ray/rollout/server_group.py``, ``rollout_manager.py`` and
``miles/backends/sglang_utils/sglang_engine.py``. Each engine start, kill and recovery is an event
in the record's ``engine_events``, and each rollout's answers (which engine served how many
requests, the weight versions they carried, the retries) in ``generated``.

What it does instead of training: each rollout is a short sleep (``BEAM_STANDIN_ROLLOUT_S``, default
0.5 s, a knob of this double only). Checkpoint contents come from ``tests/support/builders/miles/megatron_ckpt.py``
(small real megatron-core torch_dist checkpoints), so that what a resume checks with megatron-core
is what Miles would have left. Everything it saw is recorded, atomically after every event, in
``<--dump-details>/standin-<start rollout>.json`` (one file per launch: a resumed segment writes
its own) and the latest launch also in ``standin.json``: argv, the address variables (``env``) and
the rest of the launch-relevant environment (``environ``),
the placement it observed, where it loaded from, each save and why.

The names (tracker file, ``iter_%07d``, the dataset-state file) are Megatron's and Miles's, written
out here on purpose rather than taken from beam-hpc, so that the test compares two independent
descriptions of the layout.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

TRACKER = "latest_checkpointed_iteration.txt"
# What Miles reads to find the head and the network (the launcher sets these for the driver).
ADDRESS_ENV = ("MASTER_ADDR", "MILES_HOST_IP", "NCCL_SOCKET_IFNAME", "GLOO_SOCKET_IFNAME",
               "NVSHMEM_BOOTSTRAP_UID_SOCK_IFNAME")
# The rest of the launch-relevant environment, recorded as "environ".
ENV_PREFIXES = ("MASTER_", "MILES_", "NCCL_", "GLOO_", "NVSHMEM_", "RAY_", "TENSORBOARD_", "PYTHONUNBUFFERED",
                "CUDA_", "BEAM_", "SLURM_JOB_ID")
ROLLOUT_S_VAR = "BEAM_STANDIN_ROLLOUT_S"


def parse(argv: list[str]) -> argparse.Namespace:
    """The Miles flags this double acts on; everything else is accepted and ignored."""
    p = argparse.ArgumentParser(prog="miles-standin")
    p.add_argument("--actor-num-nodes", type=int, required=True)
    p.add_argument("--actor-num-gpus-per-node", type=int, required=True)
    p.add_argument("--rollout-num-gpus", type=int, default=0)
    p.add_argument("--colocate", action="store_true")
    p.add_argument("--rollout-num-gpus-per-engine", type=int, default=1)
    p.add_argument("--rollout-external", action="store_true")  # arguments.py:823-835 at 31f1ca961
    p.add_argument("--rollout-external-engine-addrs", nargs="+", default=None)
    p.add_argument("--fully-async", action="store_true")
    p.add_argument("--dump-details", required=True)
    p.add_argument("--save", default=None)
    p.add_argument("--load", default=None)
    p.add_argument("--ref-load", default=None)
    p.add_argument("--save-interval", type=int, default=None)
    p.add_argument("--save-trigger-sentinel", default=None)
    p.add_argument("--num-rollout", type=int, default=None)
    p.add_argument("--rollout-batch-size", type=int, default=1)
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--use-tensorboard", action="store_true")
    p.add_argument("--eval-interval", type=int, default=None)
    p.add_argument("--eval-prompt-data", nargs="+", default=None)
    p.add_argument("--log-reward-category", default=None)
    # rollout engines and Miles's fault tolerance (arguments.py:917-960 at 31f1ca961; defaults are Miles's)
    p.add_argument("--hf-checkpoint", default=None)
    p.add_argument("--num-gpus-per-node", type=int, default=8)
    p.add_argument("--n-samples-per-prompt", type=int, default=1)
    p.add_argument("--use-fault-tolerance", action="store_true")
    p.add_argument("--ft-components", nargs="+", default=None, choices=("rollout", "train"))
    p.add_argument("--rollout-health-check-interval", type=float, default=30.0)
    p.add_argument("--rollout-health-check-timeout", type=float, default=30.0)
    p.add_argument("--rollout-health-check-first-wait", type=float, default=0.0)
    args, _unknown = p.parse_known_args(argv)
    return args


class Record:
    """What this launch saw and did, rewritten atomically after each event."""

    def __init__(self, args: argparse.Namespace, entry: str) -> None:
        self.dir = Path(args.dump_details)
        self.data: dict[str, Any] = {
            "entry": entry,
            "argv": list(sys.argv),
            "env": {k: os.environ[k] for k in ADDRESS_ENV if k in os.environ},
            "environ": {k: v for k, v in sorted(os.environ.items()) if k.startswith(ENV_PREFIXES)},
            "pid": os.getpid(),
            "saves": [],
            "rollouts": [],
            "engine_events": [],
            "generated": [],
        }
        self.lock = threading.RLock()  # the health monitor's thread writes events too

    def event(self, what: str, **fields: Any) -> None:
        with self.lock:
            self.data["engine_events"].append({"event": what, "t": round(time.time(), 3),
                                               "rollout_id": self.data.get("current_rollout"), **fields})
            self.flush()

    def update(self, **fields: Any) -> None:
        with self.lock:
            self.data.update(fields)
            self.flush()

    def flush(self) -> None:
        with self.lock:
            self._write(json.dumps(self.data, indent=1))

    def _write(self, text: str) -> None:
        self.dir.mkdir(parents=True, exist_ok=True)
        names = ["standin.json"]
        if "start_rollout_id" in self.data:
            names.append(f"standin-{self.data['start_rollout_id']}.json")
        for name in names:
            tmp = self.dir / f".{name}.{os.getpid()}.tmp"
            tmp.write_text(text)
            os.replace(tmp, self.dir / name)


# -- placement (only under a Ray cluster, as beam-hpc's launcher provides) -----------------------
def _where(env_names: list[str]) -> tuple[str, list, dict]:
    import ray

    return ray.util.get_node_ip_address(), ray.get_gpu_ids(), {k: os.environ.get(k) for k in env_names}


def engine_base_gpus(args: Any, pgs: dict) -> list[int]:
    """Each rollout engine's base GPU as Miles's server group takes it from the rollout slice of the
    placement group (31f1ca961 ``server_group.py:90-91``, miles-rl 0.0.2 ``rollout.py:121-122``:
    ``reordered_gpu_ids[gpu_offset + i * num_gpu_per_engine]``): an empty slice is an IndexError."""
    per_engine = args.rollout_num_gpus_per_engine  # Miles: min(that, GPUs per node); one-node engines here
    _, _, rollout_gpu_ids = pgs["rollout"]
    return [int(rollout_gpu_ids[i * per_engine]) for i in range(args.rollout_num_gpus // per_engine)]


def probe_placement(args: argparse.Namespace, pgs: dict) -> dict:
    """Report where a GPU task on each bundle of Miles's placement group really runs (0.4 GPU, as
    Miles's train actors ask); the placement group is left to the process's end."""
    import ray
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    where = ray.remote(num_gpus=0.4, num_cpus=0.4)(_where)
    engine_gpus = engine_base_gpus(args, pgs)
    env_names = ["TENSORBOARD_DIR", "BEAM_REWARD_OVERLONG_BUFFER", "MILES_HOST_IP"]
    report: dict[str, list] = {}
    for role in ("actor", "rollout"):
        pg, indices, gpu_ids = pgs[role]
        n = args.actor_num_nodes * args.actor_num_gpus_per_node if role == "actor" else len(indices)
        refs = [where.options(scheduling_strategy=PlacementGroupSchedulingStrategy(
            placement_group=pg, placement_group_bundle_index=b)).remote(env_names) for b in indices[:n]]
        report[role] = [{"node": ip, "gpus": gpus, "expected_gpu": gpu_ids[i], "worker_env": env}
                        for i, (ip, gpus, env) in enumerate(ray.get(refs))]
    return {**report, "engine_base_gpus": engine_gpus}


# -- checkpoints in Miles's layout ---------------------------------------------------------------
def _atomic_write(path: Path, data: bytes) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_bytes(data)
    os.replace(tmp, path)


def latest(load: str | None) -> int | None:
    if not load:
        return None
    try:
        text = (Path(load) / TRACKER).read_text().strip()
    except FileNotFoundError:
        return None
    return int(text) if text.isdigit() else None


def _dataset_state(load: str, rollout_id: int) -> Path:
    return Path(load) / "rollout" / f"global_dataset_state_dict_{rollout_id}.pt"


def _write_iteration(save: Path, rollout_id: int, seed: int) -> None:
    """The Megatron iteration directory, written by megatron-core itself (tests/support/builders/miles/megatron_ckpt.py);
    the data cursor is this double's own (written before), the tracker comes after."""
    tests_dir = str(Path(__file__).resolve().parents[2] / "builders" / "miles")
    if tests_dir not in sys.path:
        sys.path.append(tests_dir)
    from megatron_ckpt import write_torch_dist_checkpoint

    write_torch_dist_checkpoint(save, rollout_id, seed, dataset_state=False)


def save_checkpoint(args: argparse.Namespace, rollout_id: int) -> None:
    """Data cursor, iteration directory, then the tracker (last: it is what makes it count)."""
    import io

    import torch

    save = Path(args.save)
    buf = io.BytesIO()
    torch.save({"sample_offset": (rollout_id + 1) * args.rollout_batch_size, "epoch_id": 0,
                "sample_group_index": 0, "sample_index": 0, "metadata": {}}, buf)
    _atomic_write(_dataset_state(str(save), rollout_id), buf.getvalue())
    _write_iteration(save, rollout_id, args.seed)
    _atomic_write(save / TRACKER, f"{rollout_id}\n".encode())


# -- metrics under Miles's names -------------------------------------------------------------------
class Metrics:
    """Miles's TensorBoard scalars for this double's pretend rollouts (the values are the double's
    own; the names and steps are Miles's)."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.writer = None
        if args.use_tensorboard and os.environ.get("TENSORBOARD_DIR"):
            from torch.utils.tensorboard import SummaryWriter

            self.writer = SummaryWriter(os.environ["TENSORBOARD_DIR"])
        data = args.eval_prompt_data or []
        self.eval_names = data[0::2]  # --eval-prompt-data name1 path1 name2 path2 ...
        self.eval_interval = args.eval_interval
        self.category = args.log_reward_category
        self.save_s: float | None = None  # the timer Miles logs with the next step

    def _log(self, values: dict[str, float], step: int) -> None:
        for tag, value in values.items():
            self.writer.add_scalar(tag, value, step)
        self.writer.flush()

    @staticmethod
    def _lengths(prefix: str, lengths: list[int]) -> dict[str, float]:
        lengths = sorted(lengths)
        mid = len(lengths) // 2
        median = lengths[mid] if len(lengths) % 2 else (lengths[mid - 1] + lengths[mid]) / 2
        return {f"{prefix}response_len/mean": sum(lengths) / len(lengths), f"{prefix}response_len/median": median,
                f"{prefix}response_len/max": lengths[-1], f"{prefix}response_len/min": lengths[0]}

    def rollout(self, rollout_id: int, step_s: float) -> None:
        if self.writer is None:
            return
        lengths = [10 + rollout_id, 20 + rollout_id]
        self._log({**self._lengths("rollout/", lengths), "perf/rollout_time": step_s * 0.8}, rollout_id)
        self._log({"rollout/raw_reward": -1.0 + 0.1 * rollout_id}, rollout_id)
        perf = {"perf/train_wait_time": step_s * 0.8, "perf/train_time": step_s * 0.2}
        perf["perf/step_time"] = perf["perf/train_wait_time"] + perf["perf/train_time"]
        if self.save_s is not None:
            perf["perf/save_model_time"], self.save_s = self.save_s, None
        self._log(perf, rollout_id)
        if self.eval_interval and (rollout_id + 1) % self.eval_interval == 0:
            for name in self.eval_names:
                values = {f"eval/{name}": 0.5, **self._lengths(f"eval/{name}/", lengths)}
                if self.category:
                    values.update({f"eval/{name}/error_cat/correct": 0.25, f"eval/{name}/error_cat/wrong": 0.75})
                self._log(values, rollout_id)

    def saved(self, seconds: float) -> None:
        self.save_s = (self.save_s or 0.0) + seconds


# -- the loop -------------------------------------------------------------------------------------
def run(argv: list[str], entry: str, create_placement_groups: Callable[[Any], dict] | None = None) -> None:
    """One launch: place (under Ray), resume, roll out, save as Miles would, stop at num_rollout."""
    args = parse(argv)
    if entry == "train_async.py":
        assert not args.colocate, "Colocation is not supported for async training."  # Miles's own check
    else:
        assert not args.fully_async, "train.py does not run --fully-async"
    record = Record(args, entry)
    k = latest(args.load)
    if k is None:
        start, loaded = 0, {"from": "ref_load", "path": args.ref_load}
    else:
        import torch

        state = torch.load(_dataset_state(args.load, k), weights_only=True)
        start, loaded = k + 1, {"from": "load", "path": args.load, "iteration": k,
                                "sample_offset": state["sample_offset"]}
    record.update(start_rollout_id=start, loaded=loaded)
    import ray

    manager = None
    if create_placement_groups is not None and ray.is_initialized():
        pgs = create_placement_groups(args)
        record.update(**probe_placement(args, pgs))
        if not args.colocate and pgs["rollout"][1]:  # Miles: create_rollout_manager(args, pgs["rollout"])
            from miles.ray.rollout.rollout_manager import RolloutManager

            manager = RolloutManager(args, pgs["rollout"], record.event)
            manager.update_weights(str(start))  # Miles's first weight update, before the first rollout
    pace = float(os.environ.get(ROLLOUT_S_VAR, "0.5"))
    sentinel = Path(args.save_trigger_sentinel) if args.save_trigger_sentinel else None
    num_rollout = args.num_rollout if args.num_rollout is not None else start + 1
    metrics = Metrics(args)
    import standin_wandb  # W&B as Miles writes it: a primary here, secondaries in their own processes

    writers = standin_wandb.start(argv)
    for rollout_id in range(start, num_rollout):
        t0 = time.monotonic()
        record.update(current_rollout=rollout_id)
        if manager is not None:
            generated = manager.generate(rollout_id)
            generated["generate_s"] = round(time.monotonic() - t0, 3)
            with record.lock:
                record.data["generated"].append(generated)
        time.sleep(pace)  # "train"
        metrics.rollout(rollout_id, time.monotonic() - t0)
        if writers is not None:
            writers.rollout(rollout_id)
        with record.lock:
            record.data["rollouts"].append(rollout_id)
        why = []
        if args.save_interval and (rollout_id + 1) % args.save_interval == 0:
            why.append("interval")
        requested = sentinel is not None and sentinel.exists()
        if requested:
            why.append("sentinel")
        if rollout_id == num_rollout - 1:
            why.append("final")
        if why and args.save:
            t0 = time.monotonic()
            save_checkpoint(args, rollout_id)
            seconds = time.monotonic() - t0
            metrics.saved(seconds)
            with record.lock:
                record.data["saves"].append({"rollout_id": rollout_id, "why": why, "seconds": round(seconds, 3)})
        # the record lands before the sentinel goes: beam-hpc stops the driver as soon as it sees the
        # sentinel gone and the checkpoint complete, and the tests read this record afterwards
        record.flush()
        if requested and args.save:
            sentinel.unlink(missing_ok=True)  # Miles: "a checkpoint is saved and the file is removed"
        if manager is not None:  # then the weight update (with fault tolerance: the recovery first)
            t1 = time.monotonic()
            manager.update_weights(str(rollout_id + 1))
            generated["update_s"] = round(time.monotonic() - t1, 3)
            record.flush()
    if writers is not None:
        writers.close()
    if manager is not None:
        manager.dispose()
    record.update(finished=True)
