"""Contract double of ``miles/utils/health_monitor.py`` (radixark/miles@31f1ca961), tests only.

What Miles main does when a rollout engine dies, read at radixark/miles@31f1ca961a94cb860cec3b2dea34ec332bfa8f76
(2026-08-21), and what beam-hpc depends on. Written from those facts, not copied:

Flags (``miles/utils/arguments.py:917-960``, ``add_fault_tolerance_arguments``; the same four in
miles-rl 0.0.2 from PyPI, without ``--ft-components``):
- ``--use-fault-tolerance`` (store_true, default off); ``--ft-components`` (``rollout`` / ``train``,
  default when omitted: ``rollout``, ``_resolve_ft_components``, lines 2793-2801). The rollout
  machinery below runs only with ``use_fault_tolerance and "rollout" in ft_components``
  (``rollout_manager.py:115``, ``actor_group.py:124``); ``train`` is another mode (independent DP
  replicas, local checkpoints: ``miles_validate_args``, lines 2856-2870) that beam-hpc does not use;
- ``--rollout-health-check-interval`` (30.0 s), ``--rollout-health-check-timeout`` (30.0 s),
  ``--rollout-health-check-first-wait`` (0 s).

The monitor (``RolloutHealthMonitor``, one per server group, started by the rollout manager's
constructor, ``rollout_manager.py:114-124``):
- a daemon thread, created paused; ``resume()`` at the start of every generate and eval, ``pause()``
  at offload and at every weight update (``actor_group.update_weights``); after each resume it waits
  ``first-wait`` seconds, then checks every engine, then sleeps ``interval`` and checks again;
- a check is ``ray.get(engine.health_generate.remote(timeout=timeout))`` (an HTTP
  ``/health_generate`` with that timeout; the ``ray.get`` itself has none); a stopped slot is skipped;
- any exception kills the engine: ``server_group.stop_engines`` on the engine's node slots
  (``shutdown`` then ``ray.kill``, the slot stopped even when that fails). Nothing restarts it here:
  until the next weight update the group serves with the engines left (Miles's HTTP posts to its
  router are retried 60 times a second apart, ``http_utils._post``; the router routes to the
  workers it still has: ``shutdown`` removes the dead one).

Recovery (``actor_group.update_weights`` -> ``rollout_manager.recover_updatable_engines`` ->
``RolloutServer.recover`` -> ``ServerGroup.recover``, ``server_group.py:199-229``):
- before every weight update (not before the first rollout: ``rollout_id == -1`` returns), with the
  monitor paused, every stopped slot is started again: a new ``SGLangEngine`` actor on the *same*
  placement-group bundle and base GPU, init awaited with no time limit, then marked alive;
  ``has_new_engines`` makes the trainer connect the weight-update group to the new engines and the
  update carries the current weights to them; ``get_updatable_engines_and_lock`` then waits up to
  600 s for every engine to be alive (``rollout_server.py:292-301``) and raises ``TimeoutError``.
- When the engine cannot come back because its node is gone: the monitor's check raises
  (``RayActorError``), ``shutdown`` fails, the slot is stopped; the relaunch asks Ray for the same
  bundle of the same placement group, which Ray reschedules only onto a node with that bundle's
  resources free. In a Slurm allocation that lost the node there is none (Miles's placement group
  takes every GPU of the job), so the actor is never created and ``recover`` waits for ever: Miles
  does not go on with fewer engines past the next weight update, and does not fail either; it
  blocks. Nothing in Miles drops an engine slot for good (the mini FT controller's
  ``start_cell`` is the same ``ServerGroup.recover`` on the same bundles).
- Without ``--use-fault-tolerance`` nothing checks or restarts an engine: a dead one is still
  "alive" to Miles and the next weight update to it raises, failing the run.
"""

from __future__ import annotations

import logging
import threading
from typing import Any

from miles.ray.rollout.server_group import ServerGroup

logger = logging.getLogger(__name__)


class RolloutHealthMonitor:
    """Checks each engine of one server group in a thread; kills (stops) the ones that fail."""

    def __init__(self, server_group: ServerGroup, args: Any, on_kill: Any = None) -> None:
        self._group = server_group
        self._interval = args.rollout_health_check_interval
        self._timeout = args.rollout_health_check_timeout
        self._first_wait = args.rollout_health_check_first_wait
        self._need_first_wait = True
        self._stop = threading.Event()
        self._paused = threading.Event()
        self._paused.set()  # created paused, as Miles's
        self._thread: threading.Thread | None = None
        self._on_kill = on_kill  # the double's record of a kill (engine index, exception text)

    def start(self) -> bool:
        if not self._group.all_engines:
            return False
        if self._thread is None:
            self._thread = threading.Thread(target=self._loop, name="RolloutHealthMonitor", daemon=True)
            self._thread.start()
        return True

    def stop(self) -> None:
        if self._thread is None:
            return
        self._stop.set()
        self._paused.clear()
        self._thread.join(timeout=self._timeout + self._interval + 5)
        self._thread = None

    def pause(self) -> None:
        self._paused.set()

    def resume(self) -> None:
        self._need_first_wait = True
        self._paused.clear()

    def _loop(self) -> None:
        while not self._stop.is_set():
            while self._paused.is_set() and not self._stop.is_set():
                self._stop.wait(timeout=0.5)
            if self._stop.is_set():
                break
            if self._need_first_wait:
                if self._stop.wait(self._first_wait):
                    break
                if self._paused.is_set():
                    continue
                self._need_first_wait = False
            if not self._paused.is_set():
                for index, slot in enumerate(self._group.engines):
                    if self._stop.is_set() or self._paused.is_set():
                        break
                    self._check(index, slot)
            if self._stop.wait(self._interval):
                break

    def _check(self, index: int, slot: Any) -> None:
        import ray

        if not slot.is_allocated:
            return
        try:
            ray.get(slot.actor.health_generate.remote(timeout=self._timeout))
        except Exception as e:  # Miles: any failure, a timeout or a dead actor, kills the engine
            cause = getattr(e, "cause", None) or e  # a RayTaskError carries the actor's own exception
            why = f"{type(e).__name__}: {type(cause).__name__}: {(str(cause).splitlines() or [''])[-1][:200]}"
            logger.error("Health check failed for rollout engine %d (%s). Killing actor.", index, why)
            per = self._group.nodes_per_engine
            self._group.stop_engines(list(range(index * per, (index + 1) * per)))
            if self._on_kill is not None:
                self._on_kill(index, why)
