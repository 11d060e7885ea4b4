"""The driver's side of elastic rollouts: the unit queue fed to the segment's own Ray workers, the
service outside workers join through, and the policy versions they need.

A feeder thread leases units to the segment's workers (one at a time each, so an outside worker
always finds work) and hands their results back; when nothing waits, an idle own worker takes a
unit an outside worker still holds, so the driver never waits on one. While an outside worker is
registered, the feeder publishes every version a queued unit names (``beam_hpc.backends.reference.policy_store``);
an outside worker is offered a unit only once its version is published and within the staleness the
run allows (0 in a ``--no-async-training`` run, 1 otherwise: rollout k+1 is generated with W_k).
"""

from __future__ import annotations

import logging
import os
import threading
import time
from pathlib import Path
from typing import Any, Protocol

from beam_hpc.backends.reference import policy_store, rendezvous
from beam_hpc.backends.reference.policy import threads_of
from beam_hpc.backends.reference.unit_server import ElasticServer, Service
from beam_hpc.backends.reference.units import Unit, UnitQueue, within_staleness
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
OUTSIDE_WORKERS = "elastic/outside_workers"
# How often the feeder looks again while it has nothing to wake it: while outside workers are
# registered it polls (their heartbeats, versions to publish, units to steal back); otherwise it
# sleeps until a unit is added or completed, or a result comes (a live driver that polled every
# 20 ms spent about 2.5% of a core doing it, for the whole of every segment).
POLL_S = 0.05
IDLE_WAIT_S = 1.0


class Loop(Protocol):
    """What the service reads of the driver's loop (beam_hpc.backends.reference.driver.Loop)."""

    plan: Any
    recipe: Any
    workers: list[Any]
    model_path: str
    asynchronous: bool
    lease_s: float
    version_now: int


class UnitServiceError(RuntimeFailure):
    """A rollout worker failed a unit; the message carries its error."""


def own_name(index: int) -> str:
    return f"{OWN_PREFIX}{index}"


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

    def start(self) -> UnitService:
        for i in range(len(self.loop.workers)):
            self.queue.register(own_name(i), outside=False)
        policy_store.prune(self.run_dir)  # an earlier segment's versions: this one publishes its own
        self.feeder.start()
        r = self.loop.recipe
        hello = {"recipe": r.model_dump(mode="json"), "model_path": self.loop.model_path, "unit_threads": threads_of(r),
                 "sync": not self.loop.asynchronous, "max_staleness": self.max_staleness, "lease_s": self.queue.lease_s}
        service = Service(self.queue, self.segment, hello, self._accept)
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

    def _accept(self, unit: Unit) -> bool:
        return unit.version in self.published and within_staleness(unit.version, self.loop.version_now, self.max_staleness)

    def pushed(self, version: int, ref: Any) -> None:
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

        inflight: dict[Any, tuple[str, str]] = {}
        busy: set[str] = set()
        last_expire = 0.0
        try:
            while not self.stopping.is_set():
                seen = self.queue.changes
                for i, w in enumerate(self.loop.workers):
                    name = own_name(i)
                    if name in busy:
                        continue
                    u = self.queue.lease(name, steal=True)
                    if u is not None:
                        inflight[w.generate_unit.remote(u.to_json())] = (name, u.key)
                        busy.add(name)
                polling = bool(self.queue.outside_workers())
                if inflight:
                    # every own worker busy: nothing to lease until one of them returns
                    all_busy = len(busy) == len(self.loop.workers)
                    timeout = IDLE_WAIT_S if all_busy and not polling else POLL_S
                    ready, _ = ray.wait(list(inflight), num_returns=1, timeout=timeout)
                    for ref in ready:
                        name, key = inflight.pop(ref)
                        busy.discard(name)
                        self.queue.complete(name, key, ray.get(ref))
                else:
                    self.queue.wait_for_change(seen, POLL_S if polling else IDLE_WAIT_S)
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
                DUPLICATES: float(st["duplicates"]), REISSUED: float(st["reissued"]),
                OUTSIDE_WORKERS: float(len(self.queue.outside_workers()))}

    def close(self) -> None:
        """Stop serving: the rendezvous goes first, so no worker finds a service that is closing."""
        rendezvous.remove(self.run_dir, self.segment)
        self.stopping.set()
        self.queue.poke()
        if self.server is not None:
            self.server.close()
        self.feeder.join(timeout=10)
