"""Contract double of Miles's rollout manager and weight-update step (radixark/miles@31f1ca961), tests only.

What it keeps of ``miles/ray/rollout/rollout_manager.py`` (and ``actor_group.update_weights``), written
from the facts in ``miles/utils/health_monitor.py``'s double (read that docstring first):

- one server group on the rollout slice of the placement group, every engine started and awaited
  at construction; with ``--use-fault-tolerance`` (and ``rollout`` in ``--ft-components``) one
  ``RolloutHealthMonitor`` for it, started paused;
- ``generate(rollout_id)`` resumes the monitor, then sends the rollout's
  ``rollout_batch_size x n_samples_per_prompt`` requests through the "router": the engines the
  group has registered (an engine is registered once started, dropped when stopped, as Miles's
  ``SGLangEngine.init`` / ``shutdown`` add and remove it at the router). A request that fails is
  sent again a second later, at most 60 times (``http_utils._post``); then the rollout fails;
- ``update_weights(version)``: with fault tolerance, pause the monitor and ``recover`` (restart
  every stopped engine on its own bundle, no time limit), except before the first rollout; wait up to
  600 s for every engine to be alive; if there are new engines, (re)connect the weight-update group
  (``destroy_weights_update_group`` on the engines it had, ``init_weights_update_group`` on all);
  then ``update_weights_from_distributed`` with the new ``weight_version`` to every engine.
  No tensor moves (the SGLang stand-in records names and sets the version).

Every engine start, kill and recovery goes to the driver's record through ``note``.
"""

from __future__ import annotations

import json
import logging
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from typing import Any

from miles.ray.rollout.server_group import ALIVE, ServerGroup
from miles.utils.health_monitor import RolloutHealthMonitor

logger = logging.getLogger(__name__)

MAX_RETRIES = 60  # http_utils._post
RETRY_SLEEP_S = 1.0
ALIVE_TIMEOUT_S = 600.0  # RolloutServer.wait_all_engines_alive
GROUP = "miles_weight_update"


def _post(url: str, body: dict[str, Any], timeout: float = 30.0) -> dict[str, Any]:
    request = urllib.request.Request(url, data=json.dumps(body).encode(), method="POST",
                                     headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=timeout) as response:
        return json.loads(response.read() or b"null")


def ft_components(args: Any) -> list[str]:
    """``_resolve_ft_components``: none without the flag, ``rollout`` when the flag is given alone."""
    if not args.use_fault_tolerance:
        return []
    return list(args.ft_components) if args.ft_components else ["rollout"]


class RolloutManager:
    def __init__(self, args: Any, pg: tuple, note: Callable[..., None]) -> None:
        import ray

        self.args, self.note = args, note
        self.group = ServerGroup(args, pg, args.rollout_num_gpus_per_engine)
        handles, started = self.group.start_engines()
        for i, info in zip(started, ray.get(handles), strict=True):
            self.group.all_engines[i].info.update(info)
            self.group.all_engines[i].state = ALIVE
            note("started", engine=i, **self.group.all_engines[i].info)
        self.rollout_id = -1
        self.connected: set[str] = set()
        self.cursor = 0
        self.monitors: list[RolloutHealthMonitor] = []
        if "rollout" in ft_components(args):
            monitor = RolloutHealthMonitor(self.group, args, on_kill=lambda i, why: note("killed", engine=i, why=why))
            monitor.start()
            self.monitors.append(monitor)

    def router(self) -> list[str]:
        return [slot.info["url"] for slot in self.group.all_engines if slot.is_allocated and "url" in slot.info]

    def generate(self, rollout_id: int) -> dict[str, Any]:
        """Every request of the rollout answered, through the router, with retries as Miles's."""
        self.rollout_id = rollout_id
        for monitor in self.monitors:
            monitor.resume()
        served: dict[str, int] = {}
        versions: set[str] = set()
        retries = 0
        for n in range(self.args.rollout_batch_size * self.args.n_samples_per_prompt):
            body = {"input_ids": [rollout_id, n], "sampling_params": {"max_new_tokens": 4}, "return_logprob": True}
            for attempt in range(MAX_RETRIES):
                urls = self.router()
                url = urls[self.cursor % len(urls)] if urls else None
                self.cursor += 1
                try:
                    if url is None:
                        raise urllib.error.URLError("no worker at the router")
                    answer = _post(f"{url}/generate", body)
                    break
                except OSError as e:
                    retries += 1
                    logger.info("Error: %s, retrying... (attempt %d/%d, url=%s)", e, attempt + 1, MAX_RETRIES, url)
                    time.sleep(RETRY_SLEEP_S)
            else:
                raise RuntimeError(f"Max retries ({MAX_RETRIES}) reached, failing... (rollout {rollout_id})")
            served[url] = served.get(url, 0) + 1
            versions.add(answer["meta_info"]["weight_version"])
        return {"rollout_id": rollout_id, "served": served, "weight_versions": sorted(versions), "retries": retries}

    def update_weights(self, version: str) -> None:
        for monitor in self.monitors:
            monitor.pause()
        if self.monitors and self.rollout_id != -1:
            recovered = self.group.recover()
            for i in recovered:
                self.note("recovered", engine=i, **self.group.all_engines[i].info)
        deadline = time.monotonic() + ALIVE_TIMEOUT_S
        while not all(slot.state == ALIVE for slot in self.group.all_engines):
            if time.monotonic() > deadline:
                raise TimeoutError(f"Timed out after {ALIVE_TIMEOUT_S}s waiting for engines to become ready")
            time.sleep(2)
        urls = self.router()
        if self.group.has_new_engines:
            for url in sorted(self.connected & set(urls)):
                _post(f"{url}/destroy_weights_update_group", {"group_name": GROUP})
            for rank, url in enumerate(urls):
                _post(f"{url}/init_weights_update_group", {"master_address": "127.0.0.1", "master_port": 1,
                                                           "rank_offset": rank + 1, "world_size": len(urls) + 1,
                                                           "group_name": GROUP})
            self.connected, self.group.has_new_engines = set(urls), False
        for url in urls:
            _post(f"{url}/update_weights_from_distributed", {"names": ["w"], "dtypes": ["bfloat16"], "shapes": [[1]],
                                                            "group_name": GROUP, "weight_version": version})

    def dispose(self) -> None:
        for monitor in self.monitors:
            monitor.stop()
        self.group.stop_engines(list(range(len(self.group.all_engines))))
