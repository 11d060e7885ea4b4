"""The driver's side of elastic rollouts: the unit queue fed to the segment's own Ray workers, the
service outside workers join through, and the policy versions they need.

A feeder thread leases units to the segment's workers (one at a time each, so an outside worker
always finds work) and hands their results back; when nothing waits, an idle own worker takes a
unit an outside worker still holds, so the driver never waits on one. While an outside worker is
registered, the feeder publishes every version a queued unit names (``beam_hpc.backends.reference.rollouts.policy_store``);
an outside worker is offered a unit only once its version is published and within the staleness the
run allows (0 in a ``--no-async-training`` run, 1 otherwise: rollout k+1 is generated with W_k).
An outside worker's result is checked against its unit before the queue takes it
(:class:`ResultCheck`): shapes and lengths, token ids within the vocabulary, log-probs finite, and
the texts and rewards recomputed here from the tokens, so a worker cannot make the trainer train on
misaligned samples or on a reward it made up. A result that fails is refused and its unit served again.

A segment's own worker whose actor dies is not fatal: its leased unit goes back to the head of the
queue and the workers left (and outside ones) serve it, so the rollout comes out bit for bit as it
would have (a unit's samples are a function of the run's seed, the unit and its version, never of
who computes it), and nothing is trained twice. Where the worker's node is still up (its process
died: killed, out of memory, a crash), a new worker is started in its place, on the slot the dead
one freed, and joins once it has loaded the model and the weights of every version a unit may
still ask for; it is never fed a unit before (:meth:`UnitService._restart_in_place`). Where the node
is gone (the raylet or the node step gone, the node DOWN), the worker is dropped, and the job asks
for a replacement (beam_hpc.job.runner). Two cases end the segment: the ``nccl`` weight transport
(the lost worker was a rank of the trainer's broadcast group, whose next collective would wait on
it for ever) and the loss of every rollout worker with no outside worker registered and none
being restarted.
"""

from __future__ import annotations

import json
import logging
import math
import os
import threading
import time
from pathlib import Path
from typing import Any, Protocol

from beam_hpc.backends.reference.model.policy import load_tokenizer, threads_of
from beam_hpc.backends.reference.rollouts import policy_store, rendezvous
from beam_hpc.backends.reference.rollouts.unit_server import ElasticServer, ResultRefused, Service
from beam_hpc.backends.reference.rollouts.units import Unit, UnitQueue, within_staleness
from beam_hpc.errors import RuntimeFailure
from beam_hpc.node.ray_node import driver_job
from beam_hpc.plan.ports import ELASTIC, band_port

log = logging.getLogger(__name__)

OWN_PREFIX = "segment:"
KEEP_REFS = 3  # versions whose weights stay reachable for publishing
# metrics of every rollout (dumps/metrics.jsonl, TensorBoard)
UNITS = "elastic/units"
UNITS_OUTSIDE = "elastic/units_outside"
DUPLICATES = "elastic/duplicates"
REISSUED = "elastic/reissued"
WORKERS_LOST = "elastic/workers_lost"
WORKERS_RESTARTED = "elastic/workers_restarted"
OUTSIDE_WORKERS = "elastic/outside_workers"
# A worker that dies again at every start (its model does not fit the node, say) stays lost after
# this many restarts in a segment; one that has not loaded within the wait is given up on.
MAX_RESTARTS = 3
RESTART_WAIT_S = 600.0
# How often the feeder looks again while it has nothing to wake it: while outside workers are
# registered it polls (their heartbeats, versions to publish, units to steal back); otherwise it
# sleeps until a unit is added or completed, or a result comes (a live driver that polled every
# 20 ms spent about 2.5% of a core doing it, for the whole of every segment).
POLL_S = 0.05
IDLE_WAIT_S = 1.0


class Loop(Protocol):
    """What the service reads of the driver's loop (beam_hpc.backends.reference.loop.driver.Loop)."""

    plan: Any
    recipe: Any
    workers: list[Any]
    model_path: str
    asynchronous: bool
    lease_s: float
    version_now: int
    options: Any  # LoopOptions: weight_sync

    def new_worker(self, index: int) -> Any:
        """A new rollout worker actor in slot ``index``, its weight receiver made, no weights yet."""
        ...


class UnitServiceError(RuntimeFailure):
    """A rollout worker failed a unit; the message carries its error."""


def own_name(index: int) -> str:
    return f"{OWN_PREFIX}{index}"


class ResultCheck:
    """The driver's check of an outside worker's unit result (``Service``'s ``check``).

    What the driver knows itself it takes from the unit, never from the result: the prompts, the
    labels, the version (the lease's). What it can recompute from the tokens it recomputes with the
    code the workers use (``rollout_worker.compute_unit``): the texts (its own tokenizer) and the
    scores (:func:`beam_hpc.reward.scoring.score_response`, the run's budget and penalty). What it
    cannot (the tokens themselves, the behaviour log-probs) it checks for shape: one response per
    sample of at most the unit's token budget, ids within the model's vocabulary, one finite
    log-prob <= 0 per response token for a training unit and none for an evaluation unit.
    """

    def __init__(self, recipe: Any, tokenizer: Any, vocab_size: int) -> None:
        self.recipe, self.tok, self.vocab_size = recipe, tokenizer, vocab_size

    @classmethod
    def for_model(cls, recipe: Any, model_path: str) -> ResultCheck:
        tok = load_tokenizer(model_path)
        vocab = int(tok.vocab_size)
        try:  # the model's embedding may be larger than the tokenizer's vocabulary (padded)
            vocab = max(vocab, int(json.loads((Path(model_path) / "config.json").read_text())["vocab_size"]))
        except (OSError, ValueError, KeyError, TypeError):
            pass
        return cls(recipe, tok, vocab)

    def __call__(self, unit: Unit, result: dict[str, Any]) -> dict[str, Any]:
        from beam_hpc.reward.scoring import score_response

        r = self.recipe
        n = len(unit.prompts) * unit.samples_per_prompt
        budget = r.tokens.max_response if unit.train else r.eval_max_response
        responses = result.get("response_ids")
        if not isinstance(responses, list) or len(responses) != n:
            raise ResultRefused(f"response_ids: {_len_of(responses)}; unit {unit.key} has {n} samples")
        for i, resp in enumerate(responses):
            if not isinstance(resp, list) or len(resp) > budget:
                raise ResultRefused(f"response_ids[{i}]: {_len_of(resp)}; at most {budget} tokens")
            if not all(type(t) is int and 0 <= t < self.vocab_size for t in resp):
                raise ResultRefused(f"response_ids[{i}]: a token id outside 0..{self.vocab_size - 1}")
        logp = result.get("old_logp")
        if unit.train:
            if not isinstance(logp, list) or len(logp) != n:
                raise ResultRefused(f"old_logp: {_len_of(logp)}; one list per sample ({n}) for a training unit")
            for i, (lp, resp) in enumerate(zip(logp, responses, strict=True)):
                if (not isinstance(lp, list) or len(lp) != len(resp)
                        or not all(type(x) in (float, int) and math.isfinite(x) and x <= 0 for x in lp)):
                    raise ResultRefused(f"old_logp[{i}]: one finite log-probability <= 0 per response token "
                                        f"({len(resp)}) is required")
        elif logp != []:
            raise ResultRefused("old_logp: an evaluation unit has none")
        spent = result.get("generate_time_s", 0.0)
        if type(spent) not in (float, int) or not math.isfinite(spent) or spent < 0:
            spent = 0.0
        prompts = [p for p in unit.prompts for _ in range(unit.samples_per_prompt)]
        labels = [lab for lab in unit.labels for _ in range(unit.samples_per_prompt)]
        try:
            texts = [self.tok.decode(resp, skip_special_tokens=True) for resp in responses]
        except Exception as e:  # noqa: BLE001 (the tokenizer's own error types)
            raise ResultRefused(f"response_ids: not decodable ({e})") from e
        scores = [score_response(text, label, len(resp), max_response_tokens=budget, buffer_tokens=r.reward.overlong_buffer,
                                 factor=r.reward.overlong_factor, apply_penalty=unit.train)
                  for text, label, resp in zip(texts, labels, responses, strict=True)]
        checked = {"key": unit.key, "prompt_ids": prompts, "response_ids": responses, "response_text": texts,
                   "label": labels, "old_logp": logp, "reward": [s.reward for s in scores],
                   "correct": [bool(s.correct) for s in scores], "pred": [s.pred for s in scores],
                   "penalty": [s.penalty for s in scores], "version": unit.version, "generate_time_s": float(spent)}
        return checked


def _placement_of(path: Path, index: int) -> dict[str, Any]:
    """Where own worker ``index`` ran, from the segment's placement.json (empty if unreadable)."""
    try:
        rollout = json.loads(path.read_text()).get("rollout") or []
        return dict(rollout[index]) if index < len(rollout) else {}
    except (OSError, ValueError, TypeError, AttributeError):
        return {}


def _len_of(v: Any) -> str:
    return f"{len(v)} entries" if isinstance(v, list) else f"a {type(v).__name__}"


class UnitService:
    def __init__(self, loop: Loop, ray_address: str) -> None:
        import ray

        self.loop = loop
        self.run_dir = Path(loop.plan.output_dir)
        self.queue = UnitQueue(loop.lease_s)
        self.max_staleness = 1 if loop.asynchronous else 0
        self.refs: dict[int, Any] = {}
        self.published: set[int] = set()
        self.errors: list[BaseException] = []
        self.stopping = threading.Event()
        job = driver_job()  # the segment that started this driver (None: a test's or a developer's own run)
        self.segment = job.segment if job else f"local-{os.getpid()}"
        self.port = band_port(loop.plan.site.ray, ELASTIC, job.job_num) if job and ray_address != "local" else 0
        self.host = ray.util.get_node_ip_address()  # the driver's node: the trainer group's head
        self.secret = rendezvous.new_secret()
        self.server: ElasticServer | None = None
        self.feeder = threading.Thread(target=self._feed, name="unit-feeder", daemon=True)
        self.lost: dict[str, dict[str, Any]] = {}  # own workers whose actor died: name -> what is known
        # a push and a restart's swap of a worker are one step each: a restarted worker misses no version
        self.lock = threading.Lock()
        self.starting: dict[Any, tuple[int, Any, float]] = {}  # ready ref of a restarted worker -> (slot, actor, deadline)
        self.restarts: dict[str, int] = {}  # own worker -> restarts tried this segment (MAX_RESTARTS)
        self.restarted = 0  # restarted workers that joined this segment (the rollouts' metric)

    def start(self) -> UnitService:
        for i in range(len(self.loop.workers)):
            self.queue.register(own_name(i), outside=False)
        policy_store.prune(self.run_dir)  # an earlier segment's versions: this one publishes its own
        self.feeder.start()
        r = self.loop.recipe
        hello = {"recipe": r.model_dump(mode="json"), "model_path": self.loop.model_path, "unit_threads": threads_of(r),
                 "sync": not self.loop.asynchronous, "max_staleness": self.max_staleness, "lease_s": self.queue.lease_s}
        service = Service(self.queue, self.segment, hello, self._accept,
                          check=ResultCheck.for_model(r, self.loop.model_path))
        try:
            self.server = ElasticServer(service, self.secret, self.host, self.port).start()
        except (OSError, OverflowError) as e:  # the band's port is taken (or beyond 65535): any free one will do
            log.warning("rollout service: port %d on %s not available (%s); taking a free one", self.port, self.host, e)
            self.server = ElasticServer(service, self.secret, self.host, 0).start()
        rendezvous.write(self.run_dir, rendezvous.Rendezvous(
            segment=self.segment, address=self.host, port=self.server.port, secret=self.secret, run_seed=r.seed,
            sync=not self.loop.asynchronous, max_staleness=self.max_staleness,
            policy_dir=str(policy_store.policy_dir(self.run_dir))))
        log.info("rollout service for outside workers at %s:%d (segment %s)", self.host, self.server.port, self.segment)
        return self

    def live_workers(self) -> list[Any]:
        """The segment's own workers still alive (pushes and the close go to these only)."""
        return [w for i, w in enumerate(self.loop.workers) if own_name(i) not in self.lost]

    def _worker_lost(self, name: str, key: str, err: BaseException) -> None:
        """An own worker's actor died (``RayActorError``: its process, raylet or node is gone).
        Its units go back to the queue; the segment goes on with the workers left, unless the
        weight transport cannot (``nccl``) or no rollout capacity is left (raises)."""
        index = int(name.removeprefix(OWN_PREFIX))
        where = _placement_of(Path(self.loop.plan.paths.placement), index)
        first = str(err).strip().splitlines()[0][:300] if str(err).strip() else type(err).__name__
        self.lost[name] = {"worker": name, "node_ip": where.get("node_ip"), "node_id": where.get("node_id"),
                           "unit": key, "why": f"{type(err).__name__}: {first}", "time": time.time()}
        back = self.queue.deregister(name)
        log.warning("rollout worker %s lost (node %s): %s; units %s go back to the queue, %d own worker(s) left",
                    name, where.get("node_ip", "?"), first, ", ".join(back) or "none", len(self.live_workers()))
        if getattr(self.loop.options, "weight_sync", "object_store") == "nccl":
            raise UnitServiceError(f"rollout worker {name} lost on node {where.get('node_ip', '?')} and "
                                   "backend_options.weight_sync is nccl: the worker was a rank of the trainer's "
                                   "broadcast group, which cannot go on without it; the segment ends here")
        self._restart_in_place(index, name, where)
        self._check_capacity(name)

    def _check_capacity(self, name: str) -> None:
        """Raise when no rollout capacity is left or coming: no own worker alive or starting, and no
        outside worker registered (``name``: the worker lost last)."""
        if not self.live_workers() and not self.queue.outside_workers() and not self.starting:
            node = self.lost.get(name, {}).get("node_ip") or "?"
            raise UnitServiceError(f"every rollout worker is lost (last: {name} on node {node}) "
                                   "and no outside worker is registered: no rollout capacity left")

    def _restart_in_place(self, index: int, name: str, where: dict[str, Any]) -> None:
        """Start a new worker in the slot of ``name``, whose actor died while its node is up (so its
        process, not the node, is gone). Its ``where`` is awaited by the feeder (:meth:`_joined`),
        which swaps it in; a lost node's worker, or one restarted ``MAX_RESTARTS`` times, stays lost."""
        import ray

        node_id = where.get("node_id")
        alive = {n["NodeID"] for n in ray.nodes() if n.get("Alive")}
        if node_id is None or node_id not in alive:
            return
        if self.restarts.get(name, 0) >= MAX_RESTARTS:
            log.warning("rollout worker %s died %d times in this segment: not started again", name, MAX_RESTARTS)
            return
        self.restarts[name] = self.restarts.get(name, 0) + 1
        actor = self.loop.new_worker(index)
        self.starting[actor.where.remote()] = (index, actor, time.monotonic() + RESTART_WAIT_S)
        log.warning("rollout worker %s: its node %s is up; starting a new worker in its place (restart %d)",
                    name, where.get("node_ip", "?"), self.restarts[name])

    def _joined(self) -> None:
        """Swap in each restarted worker whose model has loaded (its ``where`` answered): it gets the
        weights of every version a unit may still ask for, after which the queue may lease to it. A
        worker that died while starting, or did not answer in time, stays lost."""
        import ray
        from ray.exceptions import RayActorError

        if not self.starting:
            return
        ready, _ = ray.wait(list(self.starting), num_returns=len(self.starting), timeout=0)
        for ref in list(self.starting):
            index, actor, deadline = self.starting[ref]
            name = own_name(index)
            if ref not in ready:
                if time.monotonic() > deadline:
                    del self.starting[ref]
                    ray.kill(actor)
                    log.warning("rollout worker %s: the new worker did not start within %.0f s; it stays lost",
                                name, RESTART_WAIT_S)
                    self._check_capacity(name)
                continue
            del self.starting[ref]
            try:
                where = ray.get(ref)
            except RayActorError as err:
                log.warning("rollout worker %s: the new worker died while starting: %s", name, err)
                self._check_capacity(name)
                continue
            with self.lock:  # no push between its weights and the swap
                # the versions pushes keep reachable (any a unit may want), held before it may be fed
                # a unit; handed over directly, as the trainer's pushes are counted by every receiver
                ray.get([actor.hold_weights.remote(v, self.refs[v]) for v in sorted(self.refs)])
                self.loop.workers[index] = actor
                del self.lost[name]
                self.restarted += 1
            self.queue.register(name, outside=False)
            log.warning("rollout worker %s started again on node %s (versions %s)", name, where.get("node_ip", "?"),
                        sorted(self.refs))

    def _accept(self, unit: Unit) -> bool:
        return unit.version in self.published and within_staleness(unit.version, self.loop.version_now, self.max_staleness)

    def deliver(self, version: int, delivery: Any, ref: Any) -> None:
        """Hand version ``version``'s weights (the trainer's ``delivery``) to every own worker alive,
        each call queued behind the actor's earlier ones, and keep ``ref`` (the same weights) for
        publishing to outside workers and for a restarted worker."""
        with self.lock:
            for w in self.live_workers():
                w.receive_weights.remote(delivery)
            if ref is not None:
                self.refs[version] = ref
            for old in sorted(self.refs)[:-KEEP_REFS]:
                del self.refs[old]

    def collect(self, keys: list[str]) -> list[dict[str, Any]]:
        while not self.queue.wait(keys, 0.5):
            if self.errors:
                raise UnitServiceError(f"rollout units failed: {self.errors[0]}") from self.errors[0]
            if not self.feeder.is_alive():
                raise UnitServiceError("the unit feeder stopped with units outstanding")
        return self.queue.collect(keys)

    def _publish(self) -> None:
        """Publish the versions queued units name, while an outside worker is registered."""
        import ray

        if not self.queue.outside_workers():
            return
        wanted = self.queue.versions_wanted() | {self.loop.version_now}
        for v in sorted(wanted - self.published):
            ref = self.refs.get(v)
            if ref is None:
                continue
            t0 = time.perf_counter()
            policy_store.publish(self.run_dir, v, ray.get(ref))
            self.published.add(v)
            gone = policy_store.prune(self.run_dir, min(wanted))
            self.published -= set(gone)
            log.info("policy version %d published for outside workers (%.3fs)", v, time.perf_counter() - t0)
            self.queue.poke()  # a lease waiting for a unit of this version may take one now

    def _feed(self) -> None:
        import ray
        from ray.exceptions import RayActorError

        inflight: dict[Any, tuple[str, str]] = {}
        busy: set[str] = set()
        last_expire = 0.0
        try:
            while not self.stopping.is_set():
                seen = self.queue.changes
                for i, w in enumerate(self.loop.workers):
                    name = own_name(i)
                    if name in busy or name in self.lost:
                        continue
                    u = self.queue.lease(name, steal=True)
                    if u is not None:
                        inflight[w.generate_unit.remote(u.to_json())] = (name, u.key)
                        busy.add(name)
                polling = bool(self.queue.outside_workers())
                if inflight:
                    # every own worker busy: nothing to lease until one of them returns
                    all_busy = len(busy) == len(self.loop.workers) - len(self.lost)
                    timeout = IDLE_WAIT_S if all_busy and not polling and not self.starting else POLL_S
                    ready, _ = ray.wait(list(inflight), num_returns=1, timeout=timeout)
                    for ref in ready:
                        name, key = inflight.pop(ref)
                        busy.discard(name)
                        try:
                            result = ray.get(ref)
                        except RayActorError as err:  # the actor is gone, not the unit at fault
                            self._worker_lost(name, key, err)
                            continue
                        self.queue.complete(name, key, result)
                else:
                    self.queue.wait_for_change(seen, POLL_S if polling or self.starting else IDLE_WAIT_S)
                self._joined()
                if time.monotonic() - last_expire > 1.0:
                    last_expire = time.monotonic()
                    for gone in self.queue.expire():
                        log.warning("outside worker %s silent for over %.0fs: its units go back to the queue",
                                    gone, self.queue.lease_s)
                self._publish()
        except Exception as e:  # noqa: BLE001 (handed to the loop, which raises it)
            log.exception("unit feeder failed")
            self.errors.append(e)

    def rollout_metrics(self, roll: dict[str, Any]) -> dict[str, float]:
        st = self.queue.stats()
        served = roll.get("unit_served_by", [])
        return {UNITS: float(len(served)), UNITS_OUTSIDE: float(sum(1 for s in served if not s.startswith(OWN_PREFIX))),
                DUPLICATES: float(st["duplicates"]), REISSUED: float(st["reissued"]), WORKERS_LOST: float(len(self.lost)),
                WORKERS_RESTARTED: float(self.restarted),
                OUTSIDE_WORKERS: float(len(self.queue.outside_workers()))}

    def close(self) -> None:
        """Stop serving: the rendezvous goes first, so no worker finds a service that is closing."""
        rendezvous.remove(self.run_dir, self.segment)
        self.stopping.set()
        self.queue.poke()
        if self.server is not None:
            self.server.close()
        self.feeder.join(timeout=10)
        if self.starting:  # restarted workers that never joined
            import ray

            for _, actor, _ in self.starting.values():
                ray.kill(actor)
            self.starting.clear()
