"""An outside rollout worker: joins a running run, serves its units, leaves cleanly.

``serve`` finds the run through ``RUN/elastic/rendezvous.json``, registers with the segment's
service, and then leases units one at a time: it loads the policy version the unit names from
``RUN/elastic/policy`` (checksum verified), computes the unit with the backend's own function and
the run's thread count (so bit for bit as the run's own workers would), and posts the result. With
no rendezvous it waits; when the segment changes it registers again. When ``stop`` is set it
abandons the unit in progress (checked before every token), deregisters giving that unit back,
and returns a :class:`ServeReport`; a version that fails its checksum is given back the same way
and raised. ``python -m beam_hpc.backends.reference.rollouts.outside_worker`` does the same until a stop signal (SIGTERM, SIGINT,
SIGUSR1 or SIGUSR2: :mod:`beam_hpc.node.signals`) and then exits 0 (1, with one line, on such a failure).
"""

from __future__ import annotations

import argparse
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from beam_hpc import fault_hooks
from beam_hpc.backends.reference.rollouts import policy_store, rendezvous
from beam_hpc.backends.reference.rollouts.unit_server import SESSION_FIELD, Client, ServiceError, valid_worker_name
from beam_hpc.backends.reference.rollouts.units import Unit
from beam_hpc.errors import EXIT_INPUT, BeamError, RuntimeFailure
from beam_hpc.logging_setup import log_to_stream, module_logger
from beam_hpc.node.signals import Stopper
from beam_hpc.plan.paths import PLAN_FILE

log = module_logger(__name__)  # also run as python -m

POLL_S = 0.5  # how often a worker without a segment looks for one
HEARTBEAT_S = 2.0


@dataclass
class ServeReport:
    worker_id: str
    units_served: int = 0  # results the run accepted
    rollouts: list[int] = field(default_factory=list)  # training rollouts it served a unit of
    versions: list[int] = field(default_factory=list)  # policy versions it served with
    samples: int = 0
    joined_at: float | None = None  # time.time() of its first accepted unit
    left_at: float = 0.0
    duplicates: int = 0  # results the run had already (another worker was faster)
    given_back: list[str] = field(default_factory=list)
    segments: list[str] = field(default_factory=list)


class WorkerError(RuntimeFailure):
    """The worker cannot serve this run (its model does not load here)."""


class Leaving(Exception):
    """Raised inside a unit's generation when the worker is asked to stop."""


class UnitRunner:
    """The policy as the run's workers hold it, switched to the version each unit names."""

    def __init__(self, run_dir: Path, threads: int) -> None:
        self.run_dir, self.threads = run_dir, threads
        self.key: tuple[str, str] | None = None
        self.model: Any = None
        self.version = -1

    def prepare(self, hello: dict[str, Any]) -> None:
        from beam_hpc.config.recipe import Recipe

        recipe = Recipe.model_validate(hello["recipe"])
        # what the model depends on: all but the fields a segment may change (num_rollout, output_dir)
        key = (hello["model_path"], recipe.model_dump_json(exclude={"num_rollout", "output_dir"}))
        self.recipe = recipe
        if key == self.key:
            return
        try:
            self._load(recipe, hello)
        except (OSError, ValueError) as e:
            raise WorkerError(f"cannot load the run's model from {hello['model_path']} on this node: {e}; "
                              "an extra job's nodes must see the run's model path") from e
        self.key, self.version = key, -1

    def _load(self, recipe: Any, hello: dict[str, Any]) -> None:
        from beam_hpc.backends.reference.model.policy import device_of, load_policy, load_tokenizer

        unit_threads = int(hello["unit_threads"])
        if unit_threads != self.threads:
            log.warning("the run computes every unit with %d torch thread(s); using that, not %d, so that units "
                        "come out bit for bit as the run's own", unit_threads, self.threads)
        fix_threads(unit_threads)
        self.recipe, self.device = recipe, device_of(recipe)
        self.tok = load_tokenizer(hello["model_path"])
        self.model = load_policy(recipe, hello["model_path"])
        self.model.eval()

    def prewarm(self) -> None:
        """Load the model the run's plan names before registering, so that a worker is ready the
        moment it joins (the segment's hello still decides: another model there is loaded then)."""
        import os

        from beam_hpc.backends.reference.model.policy import threads_of
        from beam_hpc.plan.plan import Plan

        try:
            recipe = Plan.load(self.run_dir / PLAN_FILE).recipe
        except (OSError, ValueError, BeamError) as e:
            raise WorkerError(f"{self.run_dir / PLAN_FILE}: not readable ({e})") from e
        self.prepare({"recipe": recipe.model_dump(mode="json"), "model_path": os.path.abspath(recipe.model.path),
                      "unit_threads": threads_of(recipe)})

    def compute(self, unit: Unit, interrupt: Callable[[], None]) -> dict[str, Any]:
        from beam_hpc.backends.reference.model.policy import load_trainable_state
        from beam_hpc.backends.reference.rollouts.rollout_worker import compute_unit

        if unit.version != self.version:
            load_trainable_state(self.model, policy_store.load_verified(self.run_dir, unit.version))
            self.version = unit.version
        return compute_unit(self.model, self.tok, self.recipe, self.device, unit, unit.version, interrupt)


def fix_threads(n: int) -> None:
    """The run's process set-up where it can be had: all of it in the main thread (it registers a
    signal), the thread count and deterministic kernels elsewhere."""
    import torch

    from beam_hpc.backends.reference.model.policy import setup_process

    if threading.current_thread() is threading.main_thread():
        setup_process(n)
    else:
        torch.set_num_threads(n)
        torch.use_deterministic_algorithms(True)


class _Session:
    """Registration with one segment, and its heartbeat thread."""

    def __init__(self, rv: rendezvous.Rendezvous, worker_id: str, stop: threading.Event) -> None:
        self.rv, self.worker_id = rv, worker_id
        self.client = Client(rv.url, rv.secret)
        self.hello = self.client.call("/register", worker=worker_id)
        self.segment = str(self.hello["segment"])
        self.session = str(self.hello.get(SESSION_FIELD, ""))  # every later request proves it is this registration
        self.ended = threading.Event()
        self.lost = False
        self.beat = threading.Thread(target=self._beat, args=(stop,), name="elastic-heartbeat", daemon=True)
        self.beat.start()

    def call(self, path: str, **payload: Any) -> dict[str, Any]:
        return self.client.call(path, worker=self.worker_id, segment=self.segment, session=self.session, **payload)

    def _beat(self, stop: threading.Event) -> None:
        while not (stop.wait(HEARTBEAT_S) or self.ended.is_set()):
            try:
                self.call("/heartbeat")
            except ServiceError:
                self.lost = True  # the segment forgot us (a lease deadline passed): register again
            except OSError:
                pass  # the loop notices a gone segment on its next request

    def end(self, give_back: list[str]) -> list[str]:
        self.ended.set()
        try:
            back: list[str] = self.call("/deregister", give_back=give_back).get("given_back", [])
            return back
        except (OSError, ServiceError) as e:
            log.info("deregistering from segment %s: %s (its lease deadline puts our units back)", self.segment, e)
            return []


def serve(run_dir: Path, *, worker_id: str, stop: threading.Event, threads: int = 1,
          on_event: Callable[[dict[str, Any]], None] | None = None) -> ServeReport:
    """Serve the run's units until ``stop`` is set, across segments; see the module docstring."""
    run_dir = Path(run_dir)
    report = ServeReport(worker_id)
    runner = UnitRunner(run_dir, threads)
    session: _Session | None = None
    inflight: str | None = None

    def emit(event: str, **extra: Any) -> None:
        if on_event is not None:
            on_event({"event": event, "time": time.time(), "worker": worker_id, **extra})

    delay = 0.0
    prewarmed = False

    def interrupt() -> None:
        if delay:
            stop.wait(delay)
        if stop.is_set():
            raise Leaving

    try:
        while not stop.is_set():
            rv = rendezvous.read(run_dir)
            if rv is None:  # between segments: the one we served is gone, so stop heartbeating to it
                if session is not None:
                    session.end([])
                    session = None
                stop.wait(POLL_S)
                continue
            if not prewarmed:  # the run's model exists once a segment has announced itself
                prewarmed = True
                try:
                    runner.prewarm()
                    log.info("ready to serve %s", run_dir)
                except WorkerError as e:
                    log.info("%s; loading the segment's model when registering instead", e)
                if stop.is_set():
                    break
            if session is None or session.rv != rv or session.lost:
                if session is not None:
                    session.end([])
                session = None
                try:
                    session = _Session(rv, worker_id, stop)
                except (OSError, ServiceError) as e:
                    log.info("segment %s not reachable yet: %s", rv.segment, e)
                    stop.wait(POLL_S)
                    continue
                runner.prepare(session.hello)
                if stop.is_set():
                    break
                report.segments.append(session.segment)
                log.info("registered with segment %s at %s", session.segment, rv.url)
                emit("joined", segment=session.segment)
            try:
                got = session.call("/lease")
                if "unit" not in got:
                    stop.wait(float(got.get("wait_s", POLL_S)))
                    continue
                unit = Unit.from_json(got["unit"])
                inflight = unit.key
                delay = fault_hooks.unit_token_delay(unit.rollout_id)
                log.info("serving unit %s at version %d", unit.key, unit.version)
                result = runner.compute(unit, interrupt)
                verdict = session.call("/result", key=unit.key, result=result)["verdict"]
                inflight = None
            except Leaving:
                break
            except policy_store.PolicyVersionMissing as e:  # the segment moved on under us
                log.info("%s; registering again", e)
                session.lost, inflight = True, None
                continue
            except ServiceError as e:
                log.info("segment %s: %s; registering again", session.segment, e)
                session.lost, inflight = True, None
                continue
            except OSError as e:
                log.info("segment %s stopped answering (%s); waiting for the next", session.segment, e)
                session.ended.set()
                session, inflight = None, None
                stop.wait(POLL_S)
                continue
            if verdict == "accepted":
                now = time.time()
                if report.joined_at is None:
                    report.joined_at = now
                report.units_served += 1
                report.samples += len(result["reward"])
                if unit.train and unit.rollout_id not in report.rollouts:
                    report.rollouts.append(unit.rollout_id)
                if unit.version not in report.versions:
                    report.versions.append(unit.version)
                emit("unit", key=unit.key, rollout=unit.rollout_id, purpose=unit.purpose, version=unit.version,
                     samples=len(result["reward"]), segment=session.segment)
            elif verdict == "duplicate":
                report.duplicates += 1
    finally:
        if session is not None:
            report.given_back = session.end([inflight] if inflight else [])
        report.left_at = time.time()
        emit("left", units_served=report.units_served, given_back=report.given_back)
        log.info("left: %d units served, gave back %s", report.units_served, report.given_back or "nothing")
    return report


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m beam_hpc.backends.reference.rollouts.outside_worker", description=__doc__.splitlines()[0])
    parser.add_argument("--run-dir", required=True, type=Path, help="the run directory to serve")
    parser.add_argument("--worker-id", required=True, help="a name for this worker, unique in the run")
    parser.add_argument("--threads", type=int, default=1, help="torch threads (the run's own count wins)")
    args = parser.parse_args(argv)
    if not (args.run_dir / PLAN_FILE).is_file():
        print(f"--run-dir: {args.run_dir} is not a run directory (no {PLAN_FILE}); give the --output-dir of a "
              "submitted run", file=sys.stderr, flush=True)
        return EXIT_INPUT
    if not valid_worker_name(args.worker_id):
        print(f"--worker-id: {args.worker_id!r}; use letters, digits and ._@+- (up to 128 characters, starting "
              "with a letter or digit)", file=sys.stderr, flush=True)
        return EXIT_INPUT
    if args.threads < 1:
        print(f"--threads: {args.threads}; give 1 or more", file=sys.stderr, flush=True)
        return EXIT_INPUT
    log_to_stream("stdout")
    stopper = Stopper()
    stopper.install()
    try:
        report = serve(args.run_dir, worker_id=args.worker_id, stop=stopper.event, threads=args.threads)
    except RuntimeFailure as e:  # a policy version that fails its checksum, a model that will not load
        print(f"worker {args.worker_id}: {e}", file=sys.stderr, flush=True)
        return 1
    print(f"worker {report.worker_id}: {report.units_served} units, {report.samples} samples, "
          f"rollouts {report.rollouts}, versions {report.versions}, gave back {report.given_back or 'nothing'}",
          flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
