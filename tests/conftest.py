"""Shared pytest fixtures for beam-hpc's tests (one section per fixture family)."""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest
from slurm_cluster import LocalSlurmCluster, SlurmClusterError

# -- spreading the suite over xdist workers (tests/support/xdist/xdist_schedule.py) ------------------


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config: pytest.Config, log):  # type: ignore[no-untyped-def]
    """Modules that share a module fixture stay on one worker; units go out longest first."""
    from xdist_schedule import DurationScheduling

    return DurationScheduling(config, log)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Under xdist, every worker collects the same order: the units longest first (the scheduler
    sends them out in this order). A plain run keeps the files' order."""
    if not os.environ.get("PYTEST_XDIST_WORKER"):
        return
    from xdist_schedule import longest_first

    by_id = {item.nodeid: item for item in items}
    order = longest_first((item.nodeid, item.get_closest_marker("slow") is not None) for item in items)
    items[:] = [by_id[nodeid] for nodeid in order]


_CONTROLLER_LEASE: list[LocalSlurmCluster] = []


def pytest_configure(config: pytest.Config) -> None:
    """The xdist controller holds a lease on the local Slurm cluster for the whole run, so that a
    worker that finishes early cannot stop the cluster under the others (it is stopped when the
    last lease goes: tests/support/cluster/slurm_cluster.py)."""
    is_worker = hasattr(config, "workerinput")
    if is_worker or not getattr(config.option, "numprocesses", None):
        return
    if LocalSlurmCluster.missing_prerequisites():
        return
    cluster = LocalSlurmCluster()
    cluster.join()
    _CONTROLLER_LEASE.append(cluster)


def pytest_unconfigure(config: pytest.Config) -> None:
    while _CONTROLLER_LEASE:
        _CONTROLLER_LEASE.pop().leave()


# -- local Slurm cluster ---------------------------------------------------------------------


@pytest.fixture(scope="session")
def slurm_cluster() -> Iterator[LocalSlurmCluster]:
    """A real local Slurm cluster (tests/support/cluster/slurm_cluster.py), started once per session.

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
def _slurm_marked_tests_get_the_cluster(request: pytest.FixtureRequest) -> Iterator[None]:
    """`@pytest.mark.slurm` alone is enough for a test to run against the cluster. On its way out,
    passed or failed, the jobs it left under its temp dir are cancelled (module fixtures that submit
    chains cancel theirs in their own teardown): a leftover chain would slow every later test."""
    if request.node.get_closest_marker("slurm") is None:
        yield
        return
    cluster: LocalSlurmCluster = request.getfixturevalue("slurm_cluster")
    tmp = request.getfixturevalue("tmp_path")
    yield
    left = cluster.cancel_jobs_under(tmp)
    if left:
        print(f"\ncancelled the jobs this test left behind: {' '.join(left)}")


# -- reference backend: the tiny model + data, and a shared local Ray head ---------------------


@pytest.fixture(scope="session")
def tiny_assets():  # type: ignore[no-untyped-def]
    """The tiny model and data, built once by the project's code (tests/support/builders/runs/reference_harness.py)."""
    from reference_harness import build_tiny_assets

    return build_tiny_assets()


@pytest.fixture(scope="session")
def reference_ray() -> Iterator[str]:
    """The address of a real one-node Ray cluster carrying both group resources: one for all the
    xdist workers of a run (tests/support/builders/runs/reference_harness.py, LocalRayHead)."""
    from reference_harness import LocalRayHead

    with LocalRayHead(share=os.environ.get("PYTEST_XDIST_TESTRUNUID")) as address:
        yield address
