"""beam_hpc.plan.ports: the band formula, and the bands of the suite's concurrent Ray clusters.

Under pytest-xdist, jobs of the shared local Slurm cluster, a private cluster's jobs, jobs a test
starts by hand and a long-lived "site" cluster run at once on the same loopback addresses, and
Ray binds its ports on every interface: two of them whose bands overlap can take each other's
ports (seen twice, as a `ray start` that failed with "Failed to start the grpc server").
"""

from __future__ import annotations

from itertools import pairwise
from pathlib import Path

from job_plans import LOCAL_RUN_PORTS, PRIVATE_CLUSTER_PORTS, SITE_CLUSTER_PORTS

from beam_hpc.config.recipe import load_yaml
from beam_hpc.config.site import RayPortSpec
from beam_hpc.plan.ports import BANDS, RAY_PORT_KINDS, band_port, highest_port

ROOT = Path(__file__).resolve().parents[2]
RAY_WORKER_PORTS = range(10002, 20000)  # Ray's default --min-worker-port..--max-worker-port


def test_each_kind_has_its_band_and_a_job_its_slot_in_each() -> None:
    spec = RayPortSpec(gcs_port_base=21000, port_span=500)
    assert band_port(spec, "gcs", 7) == 21007
    assert band_port(spec, "weight_sync", 7) == 21000 + BANDS.index("weight_sync") * 500 + 7
    assert band_port(spec, "gcs", 507) == band_port(spec, "gcs", 7)  # the slot wraps within the band
    assert highest_port(spec) == 21000 + len(RAY_PORT_KINDS) * 500 - 1
    assert highest_port(spec, BANDS) == 21000 + len(BANDS) * 500 - 1


def test_the_suites_ray_clusters_have_port_bands_that_never_meet() -> None:
    spans = {
        "env/local.yaml (the shared Slurm cluster's jobs)": _span(load_yaml(ROOT / "env" / "local.yaml")["ray"], BANDS),
        "LOCAL_RUN_PORTS": _span(LOCAL_RUN_PORTS, BANDS),
        "PRIVATE_CLUSTER_PORTS": _span(PRIVATE_CLUSTER_PORTS, BANDS),
        "SITE_CLUSTER_PORTS (Ray only)": _span(SITE_CLUSTER_PORTS, RAY_PORT_KINDS),
    }
    ordered = sorted(spans.items(), key=lambda kv: kv[1])
    for (name_a, (_, hi_a)), (name_b, (lo_b, _)) in pairwise(ordered):
        assert hi_a < lo_b, f"{name_a} ends at {hi_a}, {name_b} starts at {lo_b}"
    ephemeral_low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    assert ordered[0][1][0] > RAY_WORKER_PORTS[-1] and ordered[-1][1][1] < ephemeral_low


def _span(fields: dict, kinds: tuple[str, ...]) -> tuple[int, int]:
    spec = RayPortSpec(**fields)
    return spec.gcs_port_base, highest_port(spec, kinds)
