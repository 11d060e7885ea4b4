"""Shared pytest fixtures for beam-hpc's tests (one section per fixture family)."""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest
from slurm_cluster import LocalSlurmCluster, SlurmClusterError

# -- local Slurm cluster ---------------------------------------------------------------------


@pytest.fixture(scope="session")
def slurm_cluster() -> Iterator[LocalSlurmCluster]:
    """A real local Slurm cluster (tests/slurm_cluster.py), started once per session.

    Skips where it cannot run (not root, Slurm binaries missing), except when
    BEAM_REQUIRE_SLURM=1 (CI, which installs Slurm): then it fails, so a broken install cannot
    pass as skipped tests. A cluster that was already up is reused; at the end the cluster is
    stopped only if tests started it and no other live pytest session still uses it.
    """
    required = os.environ.get("BEAM_REQUIRE_SLURM") == "1"
    problems = LocalSlurmCluster.missing_prerequisites()
    if problems:
        reason = "local Slurm cluster unavailable: " + "; ".join(problems)
        if required:
            pytest.fail(reason + " (BEAM_REQUIRE_SLURM=1 requires it)", pytrace=False)
        pytest.skip(reason)
    cluster = LocalSlurmCluster()
    cluster.join()
    try:
        cluster.up(started_by_tests=True)
    except SlurmClusterError as err:
        cluster.leave()
        pytest.fail(f"local Slurm cluster failed to start: {err}", pytrace=False)
    saved = os.environ.get("SLURM_CONF")
    os.environ.update(cluster.env)  # submitit and other clients call sbatch/squeue directly
    try:
        yield cluster
    finally:
        if saved is None:
            os.environ.pop("SLURM_CONF", None)
        else:
            os.environ["SLURM_CONF"] = saved
        cluster.leave()


@pytest.fixture(autouse=True)
def _slurm_marked_tests_get_the_cluster(request: pytest.FixtureRequest) -> None:
    """`@pytest.mark.slurm` alone is enough for a test to run against the cluster."""
    if request.node.get_closest_marker("slurm") is not None:
        request.getfixturevalue("slurm_cluster")


# -- reference backend: the tiny model + data, and a shared local Ray head ---------------------


@pytest.fixture(scope="session")
def tiny_assets():  # type: ignore[no-untyped-def]
    """The tiny model and data, built once by the project's code (tests/reference_harness.py)."""
    from reference_harness import build_tiny_assets

    return build_tiny_assets()


@pytest.fixture(scope="session")
def reference_ray() -> Iterator[str]:
    """The address of a real one-node Ray cluster carrying both group resources."""
    from reference_harness import LocalRayHead

    with LocalRayHead() as address:
        yield address
