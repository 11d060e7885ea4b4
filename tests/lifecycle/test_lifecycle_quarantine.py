"""The site's node quarantine (beam_hpc.lifecycle.quarantine) and `beam-hpc nodes`: real files,
real flock between real processes. The cross-run Slurm test (run A's bad node left out of run B's
first job) extends tests/lifecycle/test_lifecycle_slurm.py's failed-node chain."""

from __future__ import annotations

import json
import multiprocessing
from pathlib import Path

import pytest

from beam_hpc.cli.app import main
from beam_hpc.config.site import site_from_dict
from beam_hpc.errors import InputError
from beam_hpc.lifecycle import quarantine as q

DAY = q.DAY_S


def _site(tmp_path: Path, **extra: object) -> Path:
    path = tmp_path / "site.yaml"
    body = {"name": "qsite", "container": {"runtime": "host"}, "quarantine": str(tmp_path / "bad-nodes.json"), **extra}
    path.write_text(json.dumps(body))  # JSON is YAML
    return path


def test_a_failure_is_listed_with_run_reason_and_time_until_it_expires(tmp_path):
    f = tmp_path / "bad-nodes.json"
    q.record(f, [{"node": "n3", "why": "node step failed: disk"}], run="r1", run_dir="/runs/a", segment="11-0",
             days=2, now=1000.0)
    q.record(f, [{"node": "n5", "why": "never joined"}], run="r2", run_dir="/runs/b", segment="12-0", days=1, now=2000.0)
    out = q.quarantined(f, now=3000.0)
    assert [(e.node, e.run, e.run_dir, e.segment, e.why, e.time) for e in out] == [
        ("n3", "r1", "/runs/a", "11-0", "node step failed: disk", 1000.0),
        ("n5", "r2", "/runs/b", "12-0", "never joined", 2000.0)]
    assert out[0].expires == 1000.0 + 2 * DAY
    assert [e.node for e in q.quarantined(f, now=1000.0 + 1.5 * DAY)] == ["n3"]  # n5's day is over
    assert q.quarantined(f, now=1000.0 + 2 * DAY) == []
    # a later write drops what has expired, so the shared file stays small
    q.record(f, [{"node": "n7", "why": "x"}], run="r3", run_dir="/runs/c", segment="13-0", days=1, now=1000.0 + 3 * DAY)
    assert [e["node"] for e in json.loads(f.read_text())["entries"]] == ["n7"]


def test_a_second_failure_keeps_the_latest_reason_and_never_shortens_the_quarantine(tmp_path):
    f = tmp_path / "bad-nodes.json"
    q.record(f, [{"node": "n3", "why": "first"}], run="r1", run_dir="/a", segment="1-0", days=10, now=0.0)
    q.record(f, [{"node": "n3", "why": "second"}], run="r2", run_dir="/b", segment="2-0", days=1, now=DAY)
    (e,) = q.quarantined(f, now=1.5 * DAY)
    assert (e.why, e.run, e.expires) == ("second", "r2", 10 * DAY)


def test_release_removes_the_node_for_every_run_and_refuses_a_name_not_quarantined(tmp_path):
    f = tmp_path / "bad-nodes.json"
    q.record(f, [{"node": "n3", "why": "a"}, {"node": "n4", "why": "b"}], run="r", run_dir="/a", segment="1-0", days=1)
    before = f.read_bytes()
    with pytest.raises(InputError, match=r"'n9' not quarantined .* \(quarantined now: n3, n4"):
        q.release(f, ["n3", "n9"])
    assert f.read_bytes() == before  # refused: nothing written
    assert [e.node for e in q.release(f, ["n3"])] == ["n3"]
    assert [e.node for e in q.quarantined(f)] == ["n4"]


def _record_many(path: str, worker: int) -> None:
    for i in range(5):
        q.record(path, [{"node": f"w{worker}-{i}", "why": "x"}], run=f"r{worker}", run_dir="/a", segment=f"{worker}-{i}",
                 days=1)


def test_concurrent_writers_in_separate_processes_lose_no_entry(tmp_path):
    """Segments of several runs end at once: the flock'ed read-modify-write keeps every entry."""
    f = tmp_path / "bad-nodes.json"
    ctx = multiprocessing.get_context("fork")
    procs = [ctx.Process(target=_record_many, args=(str(f), w)) for w in range(6)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(60)
    assert [p.exitcode for p in procs] == [0] * 6
    assert sorted(e.node for e in q.quarantined(f)) == sorted(f"w{w}-{i}" for w in range(6) for i in range(5))
    assert not list(tmp_path.glob(".bad-nodes.json.*.tmp"))  # every temporary was published


def test_a_damaged_file_refuses_submission_listing_but_never_fails_a_segment(tmp_path, caplog):
    f = tmp_path / "bad-nodes.json"
    f.write_text('{"entries": [{"node": "n1"}]')  # torn by hand
    site = site_from_dict({"name": "s", "container": {"runtime": "host"}, "quarantine": str(f)})
    with pytest.raises(q.QuarantineFileError, match=r"bad-nodes.json' is not a quarantine list .* remove it") as err:
        q.merged(site, ["n2"])
    assert err.value.exit_code == 2
    q.record_failures(site, [{"node": "n4", "why": "x"}], run="r", run_dir="/a", segment="1-0")  # logs, no raise
    assert "could not add node(s) n4" in caplog.text
    assert f.read_text() == '{"entries": [{"node": "n1"}]'  # left for a person to repair
    assert q.excluded_in_job(site, ["n2"]) == ["n2"]


def test_merged_adds_the_sites_quarantined_nodes_after_the_runs_own(tmp_path):
    f = tmp_path / "bad-nodes.json"
    site = site_from_dict({"name": "s", "container": {"runtime": "host"}, "quarantine": str(f), "quarantine_days": 0.5})
    q.record_failures(site, [{"node": "n4", "why": "x"}, {"node": "n2", "why": "y"}], run="r", run_dir="/a", segment="1-0")
    (e, _) = q.quarantined(f)
    assert e.expires - e.time == pytest.approx(0.5 * DAY)
    assert q.merged(site, ["n2", "n9"]) == ["n2", "n9", "n4"]
    assert q.merged(site_from_dict({"name": "s", "container": {"runtime": "host"}}), ["n2"]) == ["n2"]


def test_site_quarantine_must_be_absolute_and_its_days_positive():
    with pytest.raises(InputError, match=r"quarantine: 'bad.json' is relative; give an absolute path"):
        site_from_dict({"name": "s", "container": {"runtime": "host"}, "quarantine": "bad.json"})
    with pytest.raises(InputError, match="quarantine_days"):
        site_from_dict({"name": "s", "container": {"runtime": "host"}, "quarantine": "/x.json", "quarantine_days": 0})


def test_nodes_command_lists_and_releases(tmp_path, capsys):
    site = _site(tmp_path)
    assert main(["nodes", "--site", str(site)]) == 0
    assert "no node quarantined" in capsys.readouterr().out
    q.record(tmp_path / "bad-nodes.json", [{"node": "n3", "why": "node step failed"}], run="rA", run_dir="/runs/a",
             segment="7-0", days=1)
    assert main(["nodes", "--site", str(site)]) == 0
    out = capsys.readouterr().out
    assert "1 node(s) quarantined" in out and "n3  until" in out and "run rA (/runs/a) segment 7-0: node step failed" in out
    assert main(["nodes", "--site", str(site), "--json"]) == 0
    assert [n["node"] for n in json.loads(capsys.readouterr().out)["nodes"]] == ["n3"]
    assert main(["nodes", "release", "n4", "--site", str(site)]) == 2
    assert "'n4' not quarantined" in capsys.readouterr().err
    assert main(["nodes", "--site", str(site), "release", "n3"]) == 0
    assert "released n3" in capsys.readouterr().out
    assert q.quarantined(tmp_path / "bad-nodes.json") == []


def test_nodes_command_without_a_quarantine_file_is_bad_input(tmp_path, capsys):
    site = tmp_path / "plain.yaml"
    site.write_text(json.dumps({"name": "plain", "container": {"runtime": "host"}}))
    assert main(["nodes", "--site", str(site)]) == 2
    assert "site 'plain' names no quarantine file" in capsys.readouterr().err


def test_the_file_and_its_lock_are_group_writable_whatever_the_umask(tmp_path):
    import os

    old = os.umask(0o077)
    try:
        q.record(tmp_path / "bad-nodes.json", [{"node": "n1", "why": "x"}], run="r", run_dir="/a", segment="1-0", days=1)
    finally:
        os.umask(old)
    assert (tmp_path / "bad-nodes.json").stat().st_mode & 0o777 == 0o664
    assert (tmp_path / "bad-nodes.json.lock").stat().st_mode & 0o777 == 0o664
