"""How the trainer's weights reach the rollout workers: Ray's object store, or a collective.

Two transports behind one small API (``make_sender`` / ``make_receiver``, ``send`` / ``recv``):
``object_store`` copies the tensors to host memory and passes them to ``ray.put`` (four passes through host
memory and PCIe, but nothing to wire up: it works between any two Ray actors, CPUs included);
``nccl`` joins the trainer (rank 0) and the workers in one ``torch.distributed`` group, through a
rendezvous on a port of the job's port set, and broadcasts flat byte buckets GPU to GPU (on CPU the
same code runs with gloo, which is how the tests check it). Why both: measured on one H200 host
(benchmarks/results/two_gpu-2026-12-02-*), the object store moved bf16 weights at about 0.3 GB/s
(3.1 s for a 0.5B model against a 46 s step), so from a few hundred million parameters, or with
short steps, NCCL pays; it needs every rank on its own GPU, so colocated runs keep the object store.
Only a small :class:`Delivery` travels through Ray; every receiver must ``recv`` every delivery in
order (its sequence number turns a skipped one into an error, not a hang). NVLink multicast stays
off (:data:`MULTICAST_OFF`). No torch, Ray or Slurm import at module level.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import timedelta
from typing import TYPE_CHECKING, Any, Protocol

from beam_hpc.errors import RuntimeFailure

if TYPE_CHECKING:
    import torch

    from beam_hpc.config.site import RayPortSpec

TRANSPORTS = ("object_store", "nccl")
DEFAULT_BUCKET_BYTES = 256 * 2**20  # few enough collectives to amortise launch, small enough to pipeline
ALIGN_BYTES = 64  # every tensor starts at a multiple of this in its bucket, so dtype views are legal
# Switches that keep NVLink multicast off (a program that uses it can take a shared host's GPUs
# out of service); setdefault keeps whatever the machine already set.
MULTICAST_OFF = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1"}


class WeightSyncError(RuntimeFailure):
    """A transport was misused or misconfigured; the message says what to change."""


# -- layout: how a state dict maps onto flat byte buckets ------------------------------------------


@dataclass(frozen=True)
class Slot:
    """Where one tensor lives: ``bucket``, byte ``offset`` in it, and how to view it back."""

    name: str
    dtype: str  # torch dtype name without the "torch." prefix, e.g. "bfloat16"
    shape: tuple[int, ...]
    bucket: int
    offset: int
    nbytes: int


@dataclass(frozen=True)
class Layout:
    """The buckets' sizes in bytes and every tensor's slot; identical on sender and receivers."""

    bucket_bytes: tuple[int, ...]
    slots: tuple[Slot, ...]

    @property
    def total_bytes(self) -> int:
        return sum(s.nbytes for s in self.slots)


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def plan_layout(tensors: Mapping[str, torch.Tensor], bucket_bytes: int = DEFAULT_BUCKET_BYTES) -> Layout:
    """Pack tensors, in the mapping's order, into buckets of at most ``bucket_bytes`` (a tensor
    larger than that gets a bucket of its own). Mixed dtypes share buckets: they travel as bytes."""
    if bucket_bytes <= 0:
        raise WeightSyncError(f"bucket_bytes: {bucket_bytes} must be positive")
    sizes: list[int] = []
    slots: list[Slot] = []
    used = bucket_bytes  # forces a first bucket
    for name, t in tensors.items():
        nbytes = t.numel() * t.element_size()
        start = -(-used // ALIGN_BYTES) * ALIGN_BYTES
        if sizes and start + nbytes <= bucket_bytes:
            used = start + nbytes
        else:
            sizes.append(0)
            start, used = 0, nbytes
        sizes[-1] = used
        slots.append(Slot(name, _dtype_name(t.dtype), tuple(t.shape), len(sizes) - 1, start, nbytes))
    return Layout(tuple(sizes), tuple(slots))


def _cast(t: torch.Tensor, dtype: torch.dtype | None) -> torch.Tensor:
    """Floating tensors go out in ``dtype`` (bf16 halves the bytes of an fp32 master copy);
    integer and bool tensors are never cast."""
    return t.detach().to(dtype) if dtype is not None and t.is_floating_point() else t.detach()


def _as_bytes(t: torch.Tensor) -> torch.Tensor:
    import torch

    return t.contiguous().reshape(-1).view(torch.uint8)


def _view(bucket: torch.Tensor, slot: Slot) -> torch.Tensor:
    import torch

    raw = bucket[slot.offset : slot.offset + slot.nbytes]
    return raw.view(getattr(torch, slot.dtype)).view(slot.shape)


# -- what the driver hands from sender to receivers -------------------------------------------------


@dataclass(frozen=True)
class Delivery:
    """One push of weights, as the receivers need to know it: small and picklable. ``payload`` is
    the object-store reference (object_store) or None (nccl: the bytes come by broadcast)."""

    transport: str
    version: int
    seq: int
    layout: Layout | None = None
    payload: Any = None


class Sender(Protocol):
    def send(self, state: Mapping[str, torch.Tensor], version: int) -> Delivery: ...
    def wait(self) -> None: ...
    def close(self) -> None: ...


class Receiver(Protocol):
    def recv(self, delivery: Delivery) -> tuple[dict[str, torch.Tensor], int]: ...
    def close(self) -> None: ...


# -- object store ----------------------------------------------------------------------------------


@dataclass
class ObjectStoreSender:
    """``ray.put`` of host copies: the backend's path today. Must run inside a Ray worker or driver."""

    dtype: torch.dtype | None = None
    seq: int = 0

    def send(self, state: Mapping[str, torch.Tensor], version: int) -> Delivery:
        import ray

        host = {n: _cast(t, self.dtype).to("cpu", copy=True) for n, t in state.items()}
        self.seq += 1
        return Delivery("object_store", version, self.seq, payload=ray.put(host))

    def wait(self) -> None:
        """Nothing in flight: ``ray.put`` returns once the object is sealed in the store."""

    def close(self) -> None:
        """Nothing to release: the store frees the object when the last reference goes."""


@dataclass
class ObjectStoreReceiver:
    """``seq`` None: a receiver made after the run's first push (a rollout worker started again in
    place of a dead one, beam_hpc.backends.reference.rollouts.unit_service): its first delivery sets
    where the count starts, and every later one must follow it in order."""

    device: str = "cpu"
    seq: int | None = 0

    def recv(self, delivery: Delivery) -> tuple[dict[str, torch.Tensor], int]:
        import ray

        _check_order(delivery, "object_store", delivery.seq - 1 if self.seq is None else self.seq)
        self.seq = delivery.seq
        host = ray.get(delivery.payload)
        return {n: t.to(self.device) for n, t in host.items()}, delivery.version

    def close(self) -> None:
        """Nothing to release."""


# -- collective (nccl on GPUs, gloo on CPU) --------------------------------------------------------


@dataclass(frozen=True)
class Rendezvous:
    """Where the group meets: the trainer node's IP and a port of the job's port set.
    ``world_size`` is 1 (the trainer) + the number of rollout workers."""

    host: str
    port: int
    world_size: int
    backend: str = "nccl"  # "nccl" on GPUs, "gloo" on CPU (see backend_for)
    timeout_s: float = 1800.0  # a pending broadcast waits at most one generation; keep it generous

    def __post_init__(self) -> None:
        if self.world_size < 2:
            raise WeightSyncError(f"world_size: {self.world_size}; a weight group needs the trainer and >= 1 worker")
        if self.backend not in ("nccl", "gloo"):
            raise WeightSyncError(f"backend: {self.backend!r} is not 'nccl' or 'gloo'")
        if not 0 < self.port < 65536:
            raise WeightSyncError(f"port: {self.port} is not a TCP port")


def backend_for(device: str) -> str:
    """NCCL between GPUs; gloo on CPU (same code, so CPU tests exercise the GPU path's logic)."""
    return "nccl" if device.startswith("cuda") else "gloo"


def weight_sync_port(spec: RayPortSpec, job_num: int) -> int:
    """The rendezvous port of a job: its slot in the weight-sync band, the band after Ray's own
    in the site's port plan (beam_hpc.plan.ports), so concurrent jobs on shared nodes never
    clash with each other or with Ray."""
    from beam_hpc.plan.ports import WEIGHT_SYNC, band_port

    port = band_port(spec, WEIGHT_SYNC, job_num)
    if port > 65535:
        raise WeightSyncError(
            f"site ray.gcs_port_base={spec.gcs_port_base} with ray.port_span={spec.port_span} puts the "
            f"weight-sync port at {port} (> 65535); lower ray.gcs_port_base or ray.port_span"
        )
    return port


def _join(rv: Rendezvous, rank: int, device: str) -> None:
    """Join the job's weight group as ``rank`` (blocks until every rank has joined)."""
    import torch
    import torch.distributed as dist

    for key, value in MULTICAST_OFF.items():
        os.environ.setdefault(key, value)
    if dist.is_initialized():
        raise WeightSyncError(
            "this process already has a torch.distributed group; the weight group owns the process's "
            "default group, so give the trainer and every rollout worker a process of its own"
        )
    kwargs: dict[str, Any] = {}
    if rv.backend == "nccl":  # bind the group to this GPU now (eager init); it needs an index
        dev = torch.device(device)
        kwargs["device_id"] = dev if dev.index is not None else torch.device("cuda", torch.cuda.current_device())
    dist.init_process_group(
        rv.backend,
        init_method=f"tcp://{rv.host}:{rv.port}",
        rank=rank,
        world_size=rv.world_size,
        timeout=timedelta(seconds=rv.timeout_s),
        **kwargs,
    )


def _check_order(delivery: Delivery, transport: str, last_seq: int) -> None:
    if delivery.transport != transport:
        raise WeightSyncError(f"a {delivery.transport!r} delivery reached a {transport!r} receiver; make both sides one kind")
    if delivery.seq != last_seq + 1:
        raise WeightSyncError(
            f"delivery {delivery.seq} arrived after {last_seq}: every receiver must recv every delivery in order"
        )


class _Buckets:
    """Flat byte buffers on one device, kept between pushes and re-made when the layout changes."""

    def __init__(self, device: str) -> None:
        self.device = device
        self.sizes: tuple[int, ...] = ()
        self.buffers: list[torch.Tensor] = []

    def for_layout(self, layout: Layout) -> list[torch.Tensor]:
        import torch

        if layout.bucket_bytes != self.sizes:
            self.buffers = [torch.empty(n, dtype=torch.uint8, device=self.device) for n in layout.bucket_bytes]
            self.sizes = layout.bucket_bytes
        return self.buffers


@dataclass
class CollectiveSender:
    """Rank 0 of the weight group. ``send`` packs and starts the broadcasts and returns at once, so
    the driver can hand the delivery to the receivers; the buckets stay in use until they joined,
    and the next ``send`` (or ``wait``) waits for that first."""

    rendezvous: Rendezvous
    device: str = "cpu"
    dtype: torch.dtype | None = None
    bucket_bytes: int = DEFAULT_BUCKET_BYTES
    seq: int = 0
    _buckets: _Buckets | None = None
    _works: list[Any] = field(default_factory=list)

    def connect(self) -> None:
        """Create the group; call together with every receiver's ``connect`` (it blocks until all join)."""
        _join(self.rendezvous, 0, self.device)
        self._buckets = _Buckets(self.device)

    def send(self, state: Mapping[str, torch.Tensor], version: int) -> Delivery:
        import torch
        import torch.distributed as dist

        if self._buckets is None:
            raise WeightSyncError("send before connect: call connect() on the sender and every receiver first")
        self.wait()
        tensors = {n: _cast(t, self.dtype) for n, t in state.items()}
        layout = plan_layout(tensors, self.bucket_bytes)
        buffers = self._buckets.for_layout(layout)
        with torch.no_grad():
            for slot in layout.slots:
                if slot.nbytes:
                    buffers[slot.bucket][slot.offset : slot.offset + slot.nbytes].copy_(_as_bytes(tensors[slot.name]))
        self._works = [dist.broadcast(b, src=0, async_op=True) for b in buffers]
        self.seq += 1
        return Delivery("nccl", version, self.seq, layout=layout)

    def wait(self) -> None:
        """Block until the receivers took the last push (its buckets may then be overwritten)."""
        for w in self._works:
            w.wait()
        self._works = []

    def close(self) -> None:
        import torch.distributed as dist

        self.wait()
        if dist.is_initialized():
            dist.destroy_process_group()


@dataclass
class CollectiveReceiver:
    """Rank ``rank`` (1..n) of the weight group. ``recv`` returns views into its buckets: valid
    until the next ``recv``, so load them into the model (a copy) before receiving again."""

    rendezvous: Rendezvous
    rank: int = 1
    device: str = "cpu"
    seq: int = 0
    _buckets: _Buckets | None = None

    def connect(self) -> None:
        if not 1 <= self.rank < self.rendezvous.world_size:
            raise WeightSyncError(f"rank: {self.rank} outside 1..{self.rendezvous.world_size - 1} (rank 0 is the trainer)")
        _join(self.rendezvous, self.rank, self.device)
        self._buckets = _Buckets(self.device)

    def recv(self, delivery: Delivery) -> tuple[dict[str, torch.Tensor], int]:
        import torch.distributed as dist

        if self._buckets is None:
            raise WeightSyncError("recv before connect: call connect() on the sender and every receiver first")
        _check_order(delivery, "nccl", self.seq)
        assert delivery.layout is not None  # a collective delivery always carries its layout
        self.seq = delivery.seq
        buffers = self._buckets.for_layout(delivery.layout)
        for w in [dist.broadcast(b, src=0, async_op=True) for b in buffers]:
            w.wait()
        return {s.name: _view(buffers[s.bucket], s) for s in delivery.layout.slots}, delivery.version

    def close(self) -> None:
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()


# -- construction ------------------------------------------------------------------------------------


def make_sender(
    kind: str,
    *,
    rendezvous: Rendezvous | None = None,
    device: str = "cpu",
    dtype: torch.dtype | None = None,
    bucket_bytes: int = DEFAULT_BUCKET_BYTES,
) -> ObjectStoreSender | CollectiveSender:
    """The trainer's end. ``dtype`` casts floating tensors on the way out (e.g. ``torch.bfloat16``
    from an fp32 master copy). A collective sender still needs ``connect()``."""
    if kind == "object_store":
        return ObjectStoreSender(dtype=dtype)
    if kind == "nccl":
        if rendezvous is None:
            raise WeightSyncError("make_sender('nccl') needs rendezvous= (trainer node IP, port, world size)")
        return CollectiveSender(rendezvous, device=device, dtype=dtype, bucket_bytes=bucket_bytes)
    raise WeightSyncError(f"weight sync transport {kind!r}: choose one of {', '.join(TRANSPORTS)}")


def make_receiver(
    kind: str, *, rendezvous: Rendezvous | None = None, rank: int = 1, device: str = "cpu", late: bool = False
) -> ObjectStoreReceiver | CollectiveReceiver:
    """A rollout worker's end; tensors come back on ``device``. A collective receiver still needs
    ``connect()``, called while the sender connects. ``late``: made after the run's first push (the
    object store only: a collective group takes no new rank)."""
    if late and kind != "object_store":
        raise WeightSyncError(f"a {kind!r} weight sync takes no receiver after its first push")
    if kind == "object_store":
        return ObjectStoreReceiver(device=device, seq=None if late else 0)
    if kind == "nccl":
        if rendezvous is None:
            raise WeightSyncError("make_receiver('nccl') needs rendezvous= (trainer node IP, port, world size)")
        return CollectiveReceiver(rendezvous, rank=rank, device=device)
    raise WeightSyncError(f"weight sync transport {kind!r}: choose one of {', '.join(TRANSPORTS)}")
