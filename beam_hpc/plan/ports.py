"""The job's port plan: one band of ``ray.port_span`` ports per kind, one slot per job.

``port = gcs_port_base + band * port_span + slot % port_span``: each kind of listener (Ray's
GCS, node manager, object manager, ... then the reference backend's weight-sync rendezvous, the
SGLang servers of a Miles run's extra rollout jobs, and the reference backend's unit service for
outside rollout workers) gets its own band, and a job's number picks its slot in every band, so concurrent jobs on
shared nodes never clash with each other or with another kind. One module owns the bands so
that Ray and the weight sync cannot drift into each other's ports.
"""

from __future__ import annotations

from beam_hpc.config.site import RayPortSpec

RAY_PORT_KINDS = (
    "gcs",
    "client_server",
    "node_manager",
    "object_manager",
    "dashboard_agent_grpc",
    "dashboard_agent_listen",
    "runtime_env_agent",
    "metrics_export",
)
WEIGHT_SYNC = "weight_sync"
SGLANG_ENGINE = "sglang_engine"  # a job's engines take consecutive slots (backends.miles.external_engines)
ELASTIC = "elastic"  # the reference backend's rollout service for outside workers
BANDS = (*RAY_PORT_KINDS, WEIGHT_SYNC, SGLANG_ENGINE, ELASTIC)


def band_port(spec: RayPortSpec, kind: str, slot: int) -> int:
    """The port of ``kind`` in slot ``slot`` (taken modulo the span)."""
    return spec.gcs_port_base + BANDS.index(kind) * spec.port_span + slot % spec.port_span


def highest_port(spec: RayPortSpec, kinds: tuple[str, ...] = RAY_PORT_KINDS) -> int:
    """The highest port the bands of ``kinds`` can use (callers refuse a plan above 65535)."""
    return spec.gcs_port_base + (max(BANDS.index(k) for k in kinds) + 1) * spec.port_span - 1


def ephemeral_overlap(spec: RayPortSpec, ephemeral: tuple[int, int]) -> tuple[int, int] | None:
    """The part of the site's bands (every kind, :data:`BANDS`) inside the kernel's ephemeral range
    ``(low, high)``, or None. A port there can be taken by any outgoing connection before the
    job binds it (seen: Ray's runtime-env agent failed "Address already in use" and its node died)."""
    lo = max(spec.gcs_port_base, ephemeral[0])
    hi = min(highest_port(spec, BANDS), ephemeral[1])
    return (lo, hi) if lo <= hi else None
