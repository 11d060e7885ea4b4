"""Fixed units of rollout work and the driver's queue of them, with leases.

A rollout's prompts are cut into units of ``unit_prompts`` prompts (their groups whole), a size set
by the recipe and never by the number of workers; a unit names the exact policy version it must be
generated with, and its samples are seeded by (run seed, purpose, rollout id, first prompt index).
So any worker computes a unit bit for bit as any other would, and who served it changes nothing.

The queue hands units to the segment's own workers and to outside workers alike. A lease belongs
to a worker; a worker that deregisters, or stops heartbeating within the deadline, has its units
put back. The first result for a unit from a worker holding its lease is accepted; any later one
is counted as a duplicate and dropped, and one from a worker without the lease is refused. The segment's own workers may also take a unit an outside worker holds once nothing else
is left, so the driver never waits on an outside worker. Pure Python, thread-safe, no I/O.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

# 4 prompts a unit: on the tiny recipe (32 x 8) units of 1 prompt made a rollout's generation 2.3x
# slower than one batch, units of 4 only 1.16x, and a rollout still splits into 8 shares.
DEFAULT_UNIT_PROMPTS = 4
# The per-sample lists a unit's result holds (rollout_worker.compute_unit), one entry a sample
# (``old_logp``: none for an evaluation unit). The driver merges these and only these.
SAMPLE_LISTS = ("prompt_ids", "response_ids", "response_text", "label", "old_logp", "reward", "correct", "pred",
                "penalty")


@dataclass(frozen=True)
class Unit:
    """One unit: ``prompts`` (token ids) from prompt index ``first_prompt`` of a rollout, each
    answered ``samples_per_prompt`` times with the policy at ``version``."""

    purpose: str  # "train" or "eval"
    rollout_id: int
    index: int  # the unit's place in its rollout
    first_prompt: int
    prompts: list[list[int]]
    labels: list[str]
    samples_per_prompt: int
    train: bool
    version: int

    @property
    def key(self) -> str:
        return unit_key(self.purpose, self.rollout_id, self.index)

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> Unit:
        return cls(**d)


def unit_key(purpose: str, rollout_id: int, index: int) -> str:
    return f"{purpose}:{rollout_id}:{index}"


def seed_parts(run_seed: int, unit: Unit) -> tuple[object, ...]:
    """What a unit's sampling noise is drawn from: nothing about the worker or the split."""
    return (run_seed, unit.purpose, unit.rollout_id, "prompt", unit.first_prompt)


def cut(purpose: str, rollout_id: int, prompts: list[list[int]], labels: list[str], *, samples_per_prompt: int,
        train: bool, version: int, unit_prompts: int) -> list[Unit]:
    """The units of one rollout (or evaluation): consecutive slices of ``unit_prompts`` prompts."""
    if unit_prompts < 1:
        raise ValueError(f"unit_prompts must be >= 1, got {unit_prompts}")
    return [
        Unit(purpose, rollout_id, i, lo, prompts[lo:lo + unit_prompts], labels[lo:lo + unit_prompts],
             samples_per_prompt, train, version)
        for i, lo in enumerate(range(0, len(prompts), unit_prompts))
    ]


def within_staleness(version: int, current: int, max_staleness: int) -> bool:
    """May a unit of policy ``version`` be served while the trainer's is ``current``: exactly the
    current one in a sync run (``max_staleness`` 0), at most that many behind otherwise."""
    return 0 <= current - version <= max_staleness


@dataclass
class WorkerState:
    outside: bool
    last_seen: float
    units: int = 0  # results accepted from it


@dataclass
class _Entry:
    unit: Unit
    holders: list[str] = field(default_factory=list)  # workers that hold a lease on it now
    result: dict[str, Any] | None = None
    served_by: str | None = None


class UnitQueue:
    """Units waiting, leased and done, keyed by :attr:`Unit.key`; see the module docstring.

    ``lease_s``: how long an outside worker may go without a heartbeat (any request counts) before
    its units go back. The segment's own workers never expire (if one dies, the segment fails).
    """

    def __init__(self, lease_s: float = 30.0, clock: Callable[[], float] = time.monotonic) -> None:
        self.lease_s = lease_s
        self.clock = clock
        self.cond = threading.Condition()
        self.changes = 0  # counts what a feeder waits for: see wait_for_change
        self.entries: dict[str, _Entry] = {}
        self.waiting: list[str] = []  # keys in the order they are handed out
        self.workers: dict[str, WorkerState] = {}
        self.finished: set[str] = set()  # keys already collected
        self.duplicates = 0
        self.reissued = 0  # units put back because their holder left or went silent

    # -- workers ------------------------------------------------------------------------------

    def register(self, worker: str, *, outside: bool) -> None:
        with self.cond:
            if worker in self.workers:
                self._release(worker)  # a worker that registers again has lost what it held
            self.workers[worker] = WorkerState(outside, self.clock())
            self._changed()

    def heartbeat(self, worker: str) -> bool:
        """False if the worker is not registered (it must register again)."""
        with self.cond:
            w = self.workers.get(worker)
            if w is None:
                return False
            w.last_seen = self.clock()
            return True

    def deregister(self, worker: str) -> list[str]:
        """Forget the worker; its units in flight go back. Returns their keys."""
        with self.cond:
            back = self._release(worker)
            self.workers.pop(worker, None)
            return back

    def give_back(self, worker: str, keys: list[str]) -> list[str]:
        with self.cond:
            return [k for k in keys if self._drop_holder(k, worker)]

    def outside_workers(self) -> list[str]:
        with self.cond:
            return [name for name, w in self.workers.items() if w.outside]

    def expire(self) -> list[str]:
        """Deregister every outside worker silent for longer than ``lease_s``; their names."""
        with self.cond:
            now = self.clock()
            gone = [n for n, w in self.workers.items() if w.outside and now - w.last_seen > self.lease_s]
        for n in gone:
            self.deregister(n)
        return gone

    def _release(self, worker: str) -> list[str]:
        return [k for k, e in self.entries.items() if worker in e.holders and self._drop_holder(k, worker)]

    def _drop_holder(self, key: str, worker: str) -> bool:
        e = self.entries.get(key)
        if e is None or worker not in e.holders:
            return False
        e.holders.remove(worker)
        if e.result is None and not e.holders:
            self.waiting.insert(0, key)  # first in line again
            self.reissued += 1
            self._changed()
        return True

    # -- units --------------------------------------------------------------------------------

    def add(self, units: list[Unit]) -> list[str]:
        with self.cond:
            keys = []
            for u in units:
                if u.key in self.entries:
                    raise ValueError(f"unit {u.key} is queued already")
                self.entries[u.key] = _Entry(u)
                self.waiting.append(u.key)
                keys.append(u.key)
            self._changed()
            return keys

    def lease(self, worker: str, accept: Callable[[Unit], bool] | None = None, *, steal: bool = False) -> Unit | None:
        """The next waiting unit ``accept`` takes (default: any), leased to ``worker``; with
        ``steal`` (the segment's own workers), else a unit only outside workers hold."""
        with self.cond:
            w = self.workers.get(worker)
            if w is None:
                return None
            w.last_seen = self.clock()
            for i, k in enumerate(self.waiting):
                e = self.entries[k]
                if accept is None or accept(e.unit):
                    del self.waiting[i]
                    e.holders.append(worker)
                    return e.unit
            if steal:
                for e in self.entries.values():
                    if (e.result is None and e.holders and worker not in e.holders
                            and all(self.workers.get(h, WorkerState(True, 0)).outside for h in e.holders)):
                        e.holders.append(worker)
                        return e.unit
            return None

    def held_by(self, worker: str, key: str) -> Unit | None:
        """The unit ``key`` if ``worker`` holds a lease on it and it has no result yet, else None."""
        with self.cond:
            e = self.entries.get(key)
            return e.unit if e is not None and e.result is None and worker in e.holders else None

    def complete(self, worker: str, key: str, result: dict[str, Any] | None) -> str:
        """``accepted`` (the first result for the unit, from a worker holding its lease),
        ``duplicate`` (dropped: it had one already), ``unknown`` (no such unit: a finished
        rollout's, or another segment's) or ``not-leased`` (dropped: ``worker`` holds no lease on
        it, or ``result`` is None, meaning it was never checked against the unit). The result is
        kept with the unit's own ``version``: the version it was leased at, whatever it says."""
        with self.cond:
            e = self.entries.get(key)
            if e is None:
                if key in self.finished:
                    self.duplicates += 1
                    return "duplicate"
                return "unknown"
            held = worker in e.holders
            if held:
                e.holders.remove(worker)
            if e.result is not None:
                self.duplicates += 1
                return "duplicate"
            if not held or result is None:
                if held:  # an unchecked result: the lease is kept, as if it had not been sent
                    e.holders.append(worker)
                return "not-leased"
            if key in self.waiting:
                self.waiting.remove(key)
            e.result, e.served_by = {**result, "version": e.unit.version}, worker
            if worker in self.workers:
                self.workers[worker].units += 1
                self.workers[worker].last_seen = self.clock()
            self._changed()
            return "accepted"

    def _changed(self) -> None:
        """(Holding ``cond``.) Something a feeder could act on happened; wake every waiter."""
        self.changes += 1
        self.cond.notify_all()

    def poke(self) -> None:
        """Wake whoever waits on the queue: a feeder that is being stopped, an outside worker's
        lease waiting for a version that is now published."""
        with self.cond:
            self._changed()

    def wait_for_change(self, seen: int, timeout: float) -> int:
        """Wait up to ``timeout`` s for a change after ``seen`` (a value of :attr:`changes`): a unit
        added, put back or completed, a worker registered. Returns :attr:`changes` now. A feeder
        reads :attr:`changes` before it leases, so a unit added while it leased is not slept on."""
        with self.cond:
            self.cond.wait_for(lambda: self.changes != seen, timeout)
            return self.changes

    def done(self, keys: list[str]) -> bool:
        with self.cond:
            return all(self.entries[k].result is not None for k in keys)

    def wait(self, keys: list[str], timeout: float) -> bool:
        """Wait up to ``timeout`` s for every one of ``keys`` to have its result."""
        with self.cond:
            return self.cond.wait_for(lambda: all(self.entries[k].result is not None for k in keys), timeout)

    def collect(self, keys: list[str]) -> list[dict[str, Any]]:
        """The results of ``keys`` in order (each with ``served_by``), forgetting those units: a
        late result for one of them is then a ``duplicate``, never counted twice."""
        with self.cond:
            out = []
            for k in keys:
                e = self.entries.pop(k)
                self.finished.add(k)
                assert e.result is not None, k
                out.append({**e.result, "served_by": e.served_by})
            return out

    def versions_wanted(self) -> set[int]:
        """The policy versions of the units waiting or held now."""
        with self.cond:
            return {e.unit.version for e in self.entries.values() if e.result is None}

    def stats(self) -> dict[str, Any]:
        with self.cond:
            return {"duplicates": self.duplicates, "reissued": self.reissued,
                    "served": {n: w.units for n, w in self.workers.items()}}
