"""Where the replacement of a lost rollout node goes (beam_hpc.elastic.replace, issue 42): the site's
``replacement_partition`` first when it names one, the rollout group's own partition when it names
none or cannot take the job; and the new site field leaves the plans made before it as they were.

Fast: ``rollout add``'s subprocess (``replace._submit``) is a recorder here, which answers as the
real command does (a job id, or None after a refusal). The real command against the real cluster:
test_replace_partition_slurm.py.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from job_plans import make_test_plan

from beam_hpc.config.site import load_site, site_from_dict
from beam_hpc.elastic import replace
from beam_hpc.errors import InputError
from beam_hpc.plan.plan import Plan

ROOT = Path(__file__).resolve().parents[2]
LOST = {"node": "n6", "why": "rollout node lost mid-segment (it went on): node step failed: exit code 0"}


def _recorder(monkeypatch: pytest.MonkeyPatch, answers: list[str | None]) -> list[list[str]]:
    calls: list[list[str]] = []

    def submit(argv: list[str], node: str, label: str) -> str | None:
        calls.append(argv)
        return answers[len(calls) - 1]

    monkeypatch.setattr(replace, "_submit", submit)
    return calls


def _partition(argv: list[str]) -> str | None:
    return argv[argv.index("--partition") + 1] if "--partition" in argv else None


def test_the_replacement_asks_the_site_s_replacement_partition_then_the_rollout_group_s_own(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    plan = make_test_plan(tmp_path / "run", trainer_nodes=1, rollout_nodes=2,
                          site={"partitions": {"trainer": "debug", "rollout": "debug"}, "replacement_partition": "spot"})
    assert replace.partitions_to_try(plan) == ["spot", None]
    calls = _recorder(monkeypatch, [None, "92"])  # the backfill partition refuses it, the own one takes it
    assert replace.replace_lost(plan, LOST, segment="78-0") == "92"
    assert [_partition(a) for a in calls] == ["spot", None]  # None: rollout add's default, the group's partition
    assert all(a[a.index("--exclude") + 1] == "n6" and a[a.index("--nodes") + 1] == "1" for a in calls)
    assert calls[0][-6:] == ["--nodes", "1", "--partition", "spot", "--exclude", "n6"]
    assert [(r["job_id"], r["replaces"], r["segment"]) for r in replace.replacements(plan.output_dir)] == \
        [("92", "n6", "78-0")]
    calls = _recorder(monkeypatch, ["93"])  # a second loss: the backfill partition takes it at once
    assert replace.replace_lost(plan, {**LOST, "node": "n7"}, segment="78-0") == "93"
    assert [_partition(a) for a in calls] == ["spot"]


def test_without_a_replacement_partition_the_replacement_asks_for_the_rollout_group_s_own(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    plan = make_test_plan(tmp_path / "run", trainer_nodes=1, rollout_nodes=2)
    assert replace.partitions_to_try(plan) == [None]
    calls = _recorder(monkeypatch, [None])
    assert replace.replace_lost(plan, LOST, segment="78-0") is None  # refused: nothing recorded, nothing retried
    assert calls == [replace.add_command(plan, "n6")] and "--partition" not in calls[0]
    assert replace.replacements(plan.output_dir) == []


def test_the_field_travels_in_the_plan_and_an_unset_one_leaves_dumps_as_they_were(tmp_path: Path) -> None:
    """The segment reads the site from the plan: the field must survive plan.json. Unset, it is not
    in the dump at all, so a plan or script made before it keeps its bytes and its inputs digest."""
    local = load_site(ROOT / "env" / "local.yaml")
    assert "replacement_partition" not in local.model_dump(mode="json") and local.replacement_partition is None
    plan = make_test_plan(tmp_path / "run", trainer_nodes=1, rollout_nodes=2, site={"replacement_partition": "spot"})
    assert Plan.load(plan.paths.plan).site.replacement_partition == "spot"
    with pytest.raises(InputError, match="replacement_partition"):
        site_from_dict({"name": "x", "container": {"runtime": "host"}, "replacement_partition": ""})
