"""Weight transport, trainer -> rollout: both transports deliver the same bits, through real Ray.

The Ray tests run two real actors on the shared local Ray head, one holding the trainer group's
resource and one the rollout group's, and push a state dict of awkward tensors (mixed dtypes,
NaN and infinities, a 0-d and an empty tensor, one larger than a bucket) twice through each
transport. ``nccl`` runs as gloo here (no GPUs): the same code, with the backend chosen by device.
The fast tests check the byte layout and the errors without Ray.
"""

from __future__ import annotations

import os
import socket
import sys
from typing import Any

import pytest

from beam_hpc.backends.reference.rollouts import weight_sync as ws

BUCKET = 4096  # bytes: small, so one push spans several buckets


def awkward_state(seed: int) -> dict[str, Any]:
    import torch

    g = torch.Generator().manual_seed(seed)
    big = torch.randn(40, 33, generator=g)  # 5,280 bytes: a bucket of its own
    big[0, :4] = torch.tensor([float("nan"), float("inf"), -float("inf"), -0.0])
    return {
        "embed.weight": torch.randn(7, 5, generator=g),
        "layer.norm": torch.randn(13, generator=g).to(torch.bfloat16),
        "layer.half": torch.randn(3, 3, generator=g).to(torch.float16),
        "big": big,
        "scale": torch.tensor(seed + 0.5),
        "empty": torch.empty(0, 4),
        "steps": torch.randint(-(2**40), 2**40, (5,), generator=g),
        "mask": torch.rand(9, generator=g) > 0.5,
    }


def raw(t: Any) -> tuple[str, tuple[int, ...], bytes]:
    """dtype, shape and the exact bytes (NaN-safe: compares bits, not values)."""
    return str(t.dtype), tuple(t.shape), bytes(ws._as_bytes(t.cpu()).numpy().tobytes())


# -- fast: layout and errors -------------------------------------------------------------------------


def test_layout_aligns_every_tensor_and_gives_an_oversized_one_its_own_bucket() -> None:
    state = awkward_state(0)
    layout = ws.plan_layout(state, BUCKET)
    assert all(s.offset % ws.ALIGN_BYTES == 0 for s in layout.slots)
    big = next(s for s in layout.slots if s.name == "big")
    assert big.offset == 0 and layout.bucket_bytes[big.bucket] == big.nbytes > BUCKET
    assert [s.name for s in layout.slots] == list(state)
    assert layout.total_bytes == sum(t.numel() * t.element_size() for t in state.values())
    for s in layout.slots:  # slots inside their bucket, not overlapping the next one
        assert s.offset + s.nbytes <= layout.bucket_bytes[s.bucket]
    assert len(layout.bucket_bytes) == 3


def test_views_of_packed_bytes_give_back_the_tensors() -> None:
    import torch

    state = awkward_state(1)
    layout = ws.plan_layout(state, BUCKET)
    buckets = [torch.zeros(n, dtype=torch.uint8) for n in layout.bucket_bytes]
    for s in layout.slots:
        buckets[s.bucket][s.offset : s.offset + s.nbytes] = ws._as_bytes(state[s.name])
    for s in layout.slots:
        assert raw(ws._view(buckets[s.bucket], s)) == raw(state[s.name])


def test_receiver_refuses_a_delivery_out_of_order_or_of_the_other_kind() -> None:
    rx = ws.make_receiver("object_store")
    with pytest.raises(ws.WeightSyncError, match="arrived after 0"):
        rx.recv(ws.Delivery("object_store", version=3, seq=2))
    with pytest.raises(ws.WeightSyncError, match="'nccl' delivery reached a 'object_store' receiver"):
        rx.recv(ws.Delivery("nccl", version=1, seq=1))


def test_bad_construction_names_the_fix() -> None:
    with pytest.raises(ws.WeightSyncError, match="choose one of object_store, nccl"):
        ws.make_sender("shm")
    with pytest.raises(ws.WeightSyncError, match="needs rendezvous="):
        ws.make_receiver("nccl")
    with pytest.raises(ws.WeightSyncError, match="world_size"):
        ws.Rendezvous("10.0.0.1", 29500, world_size=1)
    with pytest.raises(ws.WeightSyncError, match="send before connect"):
        ws.make_sender("nccl", rendezvous=ws.Rendezvous("10.0.0.1", 29500, 2, "gloo")).send({}, 1)


def test_the_sync_port_is_the_band_after_rays_and_stays_a_port() -> None:
    from beam_hpc.config.site import RayPortSpec
    from beam_hpc.node.ray_node import PORT_KINDS, ray_ports

    spec = RayPortSpec(gcs_port_base=20000, port_span=2000)
    port = ws.weight_sync_port(spec, job_num=123457)
    assert port == 20000 + len(PORT_KINDS) * 2000 + 123457 % 2000
    assert port not in vars(ray_ports(spec, 123457)).values()
    assert ws.weight_sync_port(spec, 123458) == port + 1  # the next job, the next slot
    with pytest.raises(ws.WeightSyncError, match="lower ray.gcs_port_base or ray.port_span"):
        ws.weight_sync_port(RayPortSpec(gcs_port_base=60000, port_span=2000), 1)


def test_gloo_is_chosen_off_the_gpu() -> None:
    assert ws.backend_for("cpu") == "gloo" and ws.backend_for("cuda:1") == "nccl"


# -- slow: two real actors, one per group resource -----------------------------------------------------


class End:
    """One end of the transport inside a Ray actor (wrapped by ray.remote in the fixture)."""

    def __init__(self) -> None:
        self.tx: dict[str, Any] = {}
        self.rx: dict[str, Any] = {}

    def placed(self) -> dict[str, float]:
        import ray

        return {k: v for k, v in ray.get_runtime_context().get_assigned_resources().items() if k.startswith("beam_")}

    def rendezvous_here(self) -> tuple[str, int]:
        import ray

        ip = ray.util.get_node_ip_address()
        with socket.socket() as s:
            s.bind((ip, 0))
            return ip, s.getsockname()[1]

    def sender(self, kind: str, rv: Any) -> str:
        tx = ws.make_sender(kind, rendezvous=rv, bucket_bytes=BUCKET)
        if kind == "nccl":
            tx.connect()
        self.tx[kind] = tx
        return type(tx).__name__

    def receiver(self, kind: str, rv: Any) -> str:
        rx = ws.make_receiver(kind, rendezvous=rv, rank=1)
        if kind == "nccl":
            rx.connect()
        self.rx[kind] = rx
        return type(rx).__name__

    def send(self, kind: str, seed: int, version: int) -> Any:
        return self.tx[kind].send(awkward_state(seed), version)

    def recv(self, kind: str, delivery: Any) -> tuple[dict[str, Any], int, int]:
        state, version = self.rx[kind].recv(delivery)
        return {n: raw(t) for n, t in state.items()}, version, os.getpid()

    def close(self) -> None:
        for end in [*self.tx.values(), *self.rx.values()]:
            end.close()


@pytest.fixture(scope="module")
def ends(reference_ray: str) -> Any:
    import ray

    from beam_hpc.plan.ray_labels import GROUP_RESOURCE_PREFIX

    os.environ["RAY_AUTH_MODE"] = "disabled"  # the shared head runs without tokens
    if ray.is_initialized():
        ray.shutdown()
    ray.init(address=reference_ray, log_to_driver=False)
    # The actors' workers cannot import this test module: ship its functions by value.
    ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])
    actor = ray.remote(End)
    trainer = actor.options(num_cpus=0, resources={f"{GROUP_RESOURCE_PREFIX}trainer": 1}).remote()
    rollout = actor.options(num_cpus=0, resources={f"{GROUP_RESOURCE_PREFIX}rollout": 1}).remote()
    ip, port = ray.get(trainer.rendezvous_here.remote())
    rv = ws.Rendezvous(ip, port, world_size=2, backend=ws.backend_for("cpu"), timeout_s=120)
    made = ray.get([trainer.sender.remote("object_store", None), rollout.receiver.remote("object_store", None),
                    trainer.sender.remote("nccl", rv), rollout.receiver.remote("nccl", rv)], timeout=180)
    assert made == ["ObjectStoreSender", "ObjectStoreReceiver", "CollectiveSender", "CollectiveReceiver"]
    yield trainer, rollout
    ray.get([trainer.close.remote(), rollout.close.remote()], timeout=60)
    for a in (trainer, rollout):
        ray.kill(a)
    ray.shutdown()


@pytest.mark.slow
@pytest.mark.ray
def test_the_two_ends_run_in_the_trainer_and_rollout_groups(ends: Any) -> None:
    import ray

    trainer, rollout = ends
    assert ray.get(trainer.placed.remote()) == {"beam_trainer": 1.0}
    assert ray.get(rollout.placed.remote()) == {"beam_rollout": 1.0}


@pytest.mark.slow
@pytest.mark.ray
@pytest.mark.parametrize("kind", ["object_store", "nccl"])
def test_weights_arrive_bitwise_equal_push_after_push(ends: Any, kind: str) -> None:
    import ray

    trainer, rollout = ends
    for version, seed in ((1, 11), (2, 12)):  # the second push reuses the buckets of the first
        delivery = trainer.send.remote(kind, seed, version)  # the driver hands the ref on, as the backend does
        got, got_version, pid = ray.get(rollout.recv.remote(kind, delivery), timeout=120)
        want = {n: raw(t) for n, t in awkward_state(seed).items()}
        assert got_version == version
        assert got == want
        assert pid != os.getpid()
    assert awkward_state(11)["big"].isnan().any()  # the payload really carried a NaN
