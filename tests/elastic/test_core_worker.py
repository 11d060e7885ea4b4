"""``beam_hpc.backends.reference.rollouts.outside_worker.serve`` against a real service on a real socket, with the tiny model
and real policy files, no Ray: it computes a unit bit for bit as the segment's own RolloutWorker
does, takes only versions within the staleness, follows a new segment, and refuses a version whose
checksum fails (giving its unit back)."""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import pytest
from job_plans import HOST_SITE, make_test_plan
from polling import poll_until
from reference_harness import SMALL, assert_bitwise_equal

from beam_hpc.backends.reference.loop.prompt_source import encode_prompts, read_rows
from beam_hpc.backends.reference.rollouts import policy_store, rendezvous
from beam_hpc.backends.reference.rollouts.outside_worker import ServeReport, WorkerError, serve
from beam_hpc.backends.reference.rollouts.rollout_worker import RolloutWorker
from beam_hpc.backends.reference.rollouts.unit_server import ElasticServer, Service
from beam_hpc.backends.reference.rollouts.units import UnitQueue, cut, within_staleness

pytestmark = [pytest.mark.slow]

SECRET = "s" * 64


class Segment:
    """What a segment's driver provides an outside worker: queue, service, rendezvous."""

    def __init__(self, run_dir: Path, name: str, hello: dict[str, Any], version_now: int, max_staleness: int) -> None:
        self.run_dir, self.name = run_dir, name
        self.version_now, self.max_staleness = version_now, max_staleness
        self.queue = UnitQueue()
        self.queue.register("segment:0", outside=False)
        self.registered: list[str] = []
        svc = Service(self.queue, name, hello, self.accept, on_register=self.registered.append)
        self.server = ElasticServer(svc, SECRET, "127.0.0.1").start()
        rendezvous.write(run_dir, rendezvous.Rendezvous(name, "127.0.0.1", self.server.port, SECRET, 1,
                                                        max_staleness == 0, max_staleness,
                                                        str(policy_store.policy_dir(run_dir))))

    def accept(self, unit) -> bool:  # type: ignore[no-untyped-def]
        return (unit.version in policy_store.versions(self.run_dir)
                and within_staleness(unit.version, self.version_now, self.max_staleness))

    def close(self) -> None:
        rendezvous.remove(self.run_dir, self.name)
        self.server.close()


def test_serve_computes_units_bit_for_bit_within_staleness_across_segments(tmp_path, tiny_assets) -> None:
    import torch

    plan = make_test_plan(tmp_path / "run", assets=tiny_assets, site=HOST_SITE, overrides=SMALL)
    run_dir, recipe = Path(plan.output_dir), plan.recipe
    rd = recipe.model_dump(mode="json")
    own = RolloutWorker(rd, 0, str(tiny_assets.model_dir))  # the segment's own worker, as a plain object
    prompts, _ = encode_prompts(read_rows(recipe.data.train_path()), own.tok, recipe.tokens.max_prompt)
    ids, labels = [p.ids for p in prompts[:8]], [p.label for p in prompts[:8]]
    base = {n: p.detach().clone() for n, p in own.model.named_parameters() if p.requires_grad}
    for v in (1, 2, 3):  # three distinct policies, as three updates would make
        own.states[v] = {n: t + 0.01 * v * torch.sin(torch.arange(t.numel(), dtype=t.dtype).reshape(t.shape))
                         for n, t in base.items()}
        policy_store.publish(run_dir, v, own.states[v])
    hello = {"recipe": rd, "model_path": str(tiny_assets.model_dir), "unit_threads": 1}

    seg = Segment(run_dir, "5-0", hello, version_now=3, max_staleness=1)  # an async run at version 3
    stop = threading.Event()
    events: list[dict[str, Any]] = []
    out: dict[str, Any] = {}

    def run() -> None:
        try:
            out["report"] = serve(run_dir, worker_id="w1", stop=stop, on_event=events.append)
        except Exception as e:  # noqa: BLE001 (the test reads it)
            out["error"] = e

    t = threading.Thread(target=run, daemon=True)
    t.start()
    try:
        # Version 1 is two behind: not for an outside worker; versions 2 and 3 are.
        stale = cut("train", 7, ids[:2], labels[:2], samples_per_prompt=4, train=True, version=1, unit_prompts=2)
        fresh = (cut("train", 8, ids[:4], labels[:4], samples_per_prompt=4, train=True, version=2, unit_prompts=2)
                 + cut("eval", 8, ids[4:6], labels[4:6], samples_per_prompt=2, train=False, version=3, unit_prompts=2))
        stale_keys = seg.queue.add(stale)
        keys = seg.queue.add(fresh)
        assert poll_until(lambda: seg.queue.done(keys), 300, 0.2), out
        assert not seg.queue.done(stale_keys)  # still waiting: only the segment's own workers take it
        got = seg.queue.collect(keys)
        assert [r["served_by"] for r in got] == ["w1"] * 3
        for unit, r in zip(fresh, got, strict=True):
            mine = own.generate_unit(unit.to_json())
            assert r["version"] == unit.version
            for k in ("generate_time_s", "served_by"):
                mine.pop(k, None), r.pop(k, None)
            assert_bitwise_equal(mine, r, unit.key)  # every token, log-prob and reward the same
        assert len(got[0]["old_logp"]) == 8 and got[2]["old_logp"] == []
        # the comparison above can fail: the same unit computed with the version before (version 1's
        # weights, the same sampling seed) is not bit for bit the worker's result
        before = own.generate_unit({**fresh[0].to_json(), "version": fresh[0].version - 1})
        for k in ("generate_time_s", "served_by", "version"):
            before.pop(k, None), got[0].pop(k, None)
        with pytest.raises(AssertionError, match="differs"):
            assert_bitwise_equal(before, got[0], fresh[0].key)

        # The segment ends; the worker stops heartbeating to it, waits, then registers with the next one.
        seg.close()
        assert poll_until(lambda: not any(th.name == "elastic-heartbeat" and th.is_alive()
                                          for th in threading.enumerate()), 60, 0.2), "still heartbeating a gone segment"
        seg = Segment(run_dir, "5-1", hello, version_now=3, max_staleness=0)  # a sync run now
        keys = seg.queue.add(cut("train", 9, ids[6:8], labels[6:8], samples_per_prompt=4, train=True, version=3,
                                 unit_prompts=1))
        assert poll_until(lambda: seg.queue.done(keys), 300, 0.2), out
        assert {r["served_by"] for r in seg.queue.collect(keys)} == {"w1"}

        # A version whose file does not match its manifest is refused, and its unit given back.
        policy_store.publish(run_dir, 4, own.states[3])
        f = policy_store.version_dir(run_dir, 4) / policy_store.WEIGHTS
        f.write_bytes(f.read_bytes()[:-1] + bytes([f.read_bytes()[-1] ^ 1]))
        seg.version_now = 4
        bad = seg.queue.add(cut("train", 10, ids[:1], labels[:1], samples_per_prompt=4, train=True, version=4,
                                unit_prompts=1))
        t.join(300)
        assert isinstance(out.get("error"), policy_store.PolicyVersionError), out
        assert seg.queue.lease("segment:0").key == bad[0]  # back in the queue, for another worker
        assert seg.queue.outside_workers() == []  # and the worker deregistered
    finally:
        stop.set()
        t.join(60)
        seg.close()
    kinds = [e["event"] for e in events]
    assert kinds[0] == "joined" and kinds.count("joined") == 2 and kinds[-1] == "left"
    units = [e for e in events if e["event"] == "unit"]
    assert [(e["rollout"], e["version"]) for e in units] == [(8, 2), (8, 2), (8, 3), (9, 3), (9, 3)]
    assert events[-1]["given_back"] == [bad[0]]


def test_stop_before_any_run_returns_a_report_at_once(tmp_path) -> None:
    stop = threading.Event()
    stop.set()
    report = serve(tmp_path, worker_id="idle", stop=stop)
    assert isinstance(report, ServeReport) and report.units_served == 0 and report.joined_at is None
    assert report.left_at > 0


def test_a_model_this_node_cannot_load_ends_serve_with_one_message_after_deregistering(tmp_path, tiny_assets) -> None:
    plan = make_test_plan(tmp_path / "run", assets=tiny_assets, site=HOST_SITE, overrides=SMALL)
    run_dir = Path(plan.output_dir)
    hello = {"recipe": plan.recipe.model_dump(mode="json"), "model_path": str(tmp_path / "not-here"), "unit_threads": 1}
    seg = Segment(run_dir, "6-0", hello, version_now=0, max_staleness=0)
    try:
        with pytest.raises(WorkerError, match="cannot load the run's model from .*not-here on this node"):
            serve(run_dir, worker_id="w2", stop=threading.Event())
        assert seg.registered == ["w2"] and seg.queue.outside_workers() == []  # it registered, then left before raising
    finally:
        seg.close()
