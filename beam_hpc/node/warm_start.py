"""What ``beam-hpc doctor`` reports about warm restarts: the node-local image copy
(beam_hpc.node.image.stage) and the node-local JIT caches with the run's shared archives
(beam_hpc.node.jit_cache).

Plain tuples, so that doctor (beam_hpc.observe, above this layer) owns how a check looks.
"""

from __future__ import annotations

from pathlib import Path

from beam_hpc.config.site import Site
from beam_hpc.node import image, jit_cache
from beam_hpc.plan.paths import RunPaths

GROUPS = ("trainer", "rollout")


def doctor_facts(site: Site, output_dir: str | None = None) -> list[tuple[str, str, str, str]]:
    """(name, status, detail, fix) for the image copy (Apptainer sites) and the JIT caches; with
    ``output_dir``, the run's per-group cache archives too."""
    facts: list[tuple[str, str, str, str]] = []
    if site.container.runtime == "apptainer":
        facts.append(("image copy", *image.staging_summary(site.container, site.scratch)))
    archives = [p for g in GROUPS if (p := Path(RunPaths(output_dir).jit_cache_archive(g))).is_file()] if output_dir else []
    detail = jit_cache.describe(site.scratch, archives)
    if site.scratch:
        facts.append(("jit caches", "pass", detail, ""))
    else:
        facts.append(("jit caches", "warn", detail, "set scratch: to node-local disk (the node's temp dir may be in RAM)"))
    return facts
