"""Contract double of ``miles/ray/rollout/server_group.py`` + ``server_engine.py`` (radixark/miles@31f1ca961), tests only.

Written for beam-hpc from the facts of Miles's modules, not copied. What is kept:

- one slot per engine (``all_engines``), each stopped, allocated (actor created, not yet
  initialised) or alive (``ServerEngine``'s three states); ``engines`` are the node-0 slots,
  ``nodes_per_engine = max(1, num_gpus_per_engine // num_gpus_per_node)``;
- ``start_engines(start_indices)`` creates an ``SGLangEngine`` actor for each *stopped* slot of
  ``start_indices``, of 0.2 GPU / 0.2 CPU, on the bundle ``reordered_bundle_indices[i * gpus]`` of the
  rollout slice of Miles's placement group, with base GPU ``reordered_gpu_ids[i * gpus]``
  (``server_group.py:72-138``): the same bundle every time a slot is started, so a restarted
  engine lands where the dead one was. It returns the init calls without waiting on them and sets
  ``has_new_engines``;
- ``stop_engines(indices)``: for each allocated slot ``ray.get(shutdown)`` then ``ray.kill``, both in
  one ``try`` whose failure is only logged (an actor whose node is gone fails ``shutdown``, so it is
  never ``ray.kill``-ed), and the slot is stopped in every case (``server_group.py:183-197``);
- ``recover()`` starts every stopped slot, waits on all their init calls, with no time limit
  (``server_group.py:199-229``, ``asyncio.gather``), then marks them alive. An engine whose bundle
  cannot be placed (its node gone, no other node with a free GPU for the bundle) is an actor Ray
  never creates, so ``recover`` never returns: Miles blocks there, it neither fails nor goes on
  with fewer engines. This double does not simulate that: it is real Ray doing what Ray does.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

logger = logging.getLogger(__name__)

STOPPED, ALLOCATED, ALIVE = "stopped", "allocated", "alive"


@dataclass
class EngineSlot:
    """``ServerEngine``: a state and, once allocated, the actor handle; ``info`` is the double's record."""

    state: str = STOPPED
    actor: Any = None
    info: dict[str, Any] = field(default_factory=dict)

    @property
    def is_allocated(self) -> bool:
        return self.state in (ALLOCATED, ALIVE)


@dataclass
class ServerGroup:
    args: Any
    pg: tuple  # (placement_group, reordered_bundle_indices, reordered_gpu_ids): the rollout slice
    num_gpus_per_engine: int
    all_engines: list[EngineSlot] = field(default_factory=list)
    has_new_engines: bool = False

    def __post_init__(self) -> None:
        if not self.all_engines:
            n = len(self.pg[1]) // min(self.num_gpus_per_engine, self.args.num_gpus_per_node)
            self.all_engines = [EngineSlot() for _ in range(n)]

    @property
    def nodes_per_engine(self) -> int:
        return max(1, self.num_gpus_per_engine // self.args.num_gpus_per_node)

    @property
    def engines(self) -> list[EngineSlot]:
        return self.all_engines[:: self.nodes_per_engine]

    def start_engines(self, start_indices: list[int] | None = None) -> tuple[list, list[int]]:
        import ray
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        from miles.backends.sglang_utils.sglang_engine import SGLangEngine

        pg, bundle_indices, gpu_ids = self.pg
        per_engine = min(self.num_gpus_per_engine, self.args.num_gpus_per_node)
        actor_class = ray.remote(SGLangEngine)
        handles, started = [], []
        for i, slot in enumerate(self.all_engines):
            if (start_indices is not None and i not in start_indices) or slot.is_allocated:
                continue
            gpu_index = i * per_engine
            actor = actor_class.options(
                num_cpus=0.2, num_gpus=0.2,
                scheduling_strategy=PlacementGroupSchedulingStrategy(
                    placement_group=pg, placement_group_capture_child_tasks=True,
                    placement_group_bundle_index=bundle_indices[gpu_index]),
            ).remote(self.args, rank=i, base_gpu_id=int(gpu_ids[gpu_index]), num_gpus_per_engine=self.num_gpus_per_engine)
            slot.state, slot.actor = ALLOCATED, actor
            slot.info = {"bundle": int(bundle_indices[gpu_index])}
            handles.append(actor.init.remote())
            started.append(i)
        self.has_new_engines |= bool(started)
        return handles, started

    def stop_engines(self, engine_indices: list[int]) -> None:
        import ray

        for i in engine_indices:
            slot = self.all_engines[i]
            if slot.is_allocated:
                try:
                    ray.get(slot.actor.shutdown.remote())
                    ray.kill(slot.actor)
                except Exception as e:  # Miles logs and goes on: the slot is stopped either way
                    logger.warning("Fail to kill engine at index %d (e: %s)", i, e)
            slot.state, slot.actor = STOPPED, None

    def recover(self) -> list[int]:
        """Start every stopped slot again on its own bundle and wait for all of them (no limit)."""
        import ray

        stopped = [i for i, slot in enumerate(self.all_engines) if not slot.is_allocated]
        handles, started = self.start_engines(start_indices=stopped)
        for i, info in zip(started, ray.get(handles), strict=True):
            self.all_engines[i].info.update(info)
        assert len(started) == len(stopped), "curr_num_new_engines does not match start_indices length"
        for i in started:
            self.all_engines[i].state = ALIVE
        return started
