"""benchmarks/ettr.py's simulator: a failure-free chain whose ETTR is known by hand, and scripted node
losses that show the product's own rules at work: the plan's on_node_loss and
elastic.replace.on_node_lost decide whether a segment goes on, saves first, or ends, and
whether a replacement is asked for (a rollout group that keeps no whole engine projects exactly as
a full restart; the seed's Miles recipe saves the rollout in flight first, then waits up to
lifecycle.replacement_wait_s for a node to join its Ray cluster, within lifecycle.max_replacements,
and goes on or ends), and lifecycle.decide.decide what follows a segment. Scripted process faults on live nodes show what
each driver does: Miles restarts a dead engine in place (or fails the weight update it missed),
the reference driver starts a new worker in the dead one's slot while the others serve (the
segment goes on even when it was the last worker), a trainer's fault ends it."""

from __future__ import annotations

import random
from dataclasses import replace
from typing import Any

import benchmark_script
import pytest

sim = benchmark_script.load("ettr")

# The seed's topology (8 trainer + 4 rollout nodes, two 16-GPU engines) with 100 s steps, a 10 s
# save every 5 rollouts, 50 s bring-up, a 2,000 s walltime with a 100 s lead: the recipe fields
# through the product's plan, the rest as Costs.
SMALL = sim.Shape("small", trainer_nodes=8, rollout_nodes=4, prompts=32, bringup_s=50, queue_s=30, replace_s=300)
RECIPE = ("lifecycle.walltime=00:33:20", "lifecycle.lead_s=100", "checkpoint.interval=5")
# Node losses only (process_share 0: no kind is drawn) unless a test says otherwise.
COSTS = sim.Costs(step_s=100, save_s=10, detect_s=5, operator_s=600, per_gpu_hour=0.0, process_share=0.0,
                  engine_restart_s=120, worker_restart_s=150)
LOSSES = replace(COSTS, per_gpu_hour=1.0)  # for the scripted losses below (their times are the script's)
FAULTS = replace(LOSSES, process_share=0.5)  # both kinds drawn: the script says which each is


def config(backend: str = "reference", *overrides: str, shape: Any = SMALL) -> Any:
    return sim.config_for(shape, backend, *RECIPE, *overrides)


class Scripted(random.Random):
    """Failures at the held seconds given (after each, the next), each on the group given, and (for
    a rollout node) the node index given, else the first one up. With ``kinds`` (and costs whose
    process_share is 0.5, so that the simulator draws a kind), each is a "process" fault or a
    "node" loss as given."""

    def __init__(self, gaps: list[float], groups: list[str], nodes: list[int] | None = None,
                 kinds: list[str] | None = None) -> None:
        super().__init__(0)
        self.gaps, self.nodes = list(gaps), list(nodes or [])
        self.draws: list[float] = []  # random()'s answers in the simulator's order: the kind, then the group
        for i, group in enumerate(groups):
            if kinds is not None:
                self.draws.append(0.0 if kinds[i] == "process" else 0.999)
            self.draws.append(0.0 if group == "trainer" else 0.999)  # the plan lists the trainer first

    def expovariate(self, lambd: float) -> float:
        return self.gaps.pop(0) if self.gaps else 1e12

    def random(self) -> float:
        return self.draws.pop(0) if self.draws else 0.0

    def choice(self, seq: Any) -> Any:
        want = self.nodes.pop(0) if self.nodes else seq[0]
        assert want in seq
        return want


def restart(*overrides: str) -> Any:
    """The full-restart policy as the product has it: lifecycle.rollout_node_loss: restart."""
    return config("reference", "lifecycle.rollout_node_loss=restart", *overrides)


def run(cfg: Any, rng: random.Random, costs: Any = LOSSES, n: int = 20) -> Any:
    """One simulated run under the product's rule on ``cfg``'s plan."""
    return sim.simulate(cfg, costs, sim.ProductRule(cfg), n, rng)


def test_without_failures_the_ettr_is_the_one_worked_out_by_hand() -> None:
    """Segment 1: bring-up to 50, rollouts 1-15 with three saves to 1,580, 16-18 to 1,880; rollout 19
    would pass the lead (1,900): save on request, end at 1,890. Segment 2: bring-up, rollouts 19-20
    and the final save: 260 s. 20 rollouts x 100 s over 2,150 s held."""
    r = run(restart(), random.Random(0), costs=COSTS)
    assert r.segments == 2 and r.restarts == 0 and r.chain_stops == 0 and r.unfinished == 0
    assert r.ettr == pytest.approx(2000 / 2150) and r.ettr_full_speed == pytest.approx(2000 / 2150)
    assert r.span_ettr == pytest.approx(2000 / (2150 + 30))  # the queue wait is in the span, not held


def test_the_simulator_asks_the_products_rule_with_the_real_plan(monkeypatch: pytest.MonkeyPatch) -> None:
    """The rule is the product's on_node_loss on the plan plan_for made, then
    elastic.replace.on_node_lost with the segment's own nodes left and the recipe's cap: the
    reference run goes on; the seed's Miles run (4 rollout nodes, engines of 2) saves first, and
    asks the cap rule again as may_replace does (survives, one node up, the run's count, the cap)
    before it waits for a replacement."""
    seen: list[tuple[Any, ...]] = []
    real_on_loss, real_on_lost = sim.on_node_loss, sim.on_node_lost

    def on_loss(plan: Any, group: Any) -> Any:
        action = real_on_loss(plan, group)
        seen.append(("on_node_loss", plan, group.name, action))
        return action

    def on_lost(**kw: Any) -> Any:
        seen.append(("on_node_lost", kw))
        return real_on_lost(**kw)

    monkeypatch.setattr(sim, "on_node_loss", on_loss)
    monkeypatch.setattr(sim, "on_node_lost", on_lost)
    for cfg, action, survives in ((config(), sim.NodeLossAction.GO_ON, True),
                                  (config("miles"), sim.NodeLossAction.SAVE_FIRST, False)):
        seen.clear()
        run(cfg, Scripted([300], ["rollout"]))
        may_replace = [("on_node_lost", {"survives": True, "others_up": 1, "replacements": 0, "cap": 2})]
        assert seen == [("on_node_loss", cfg.plan, "rollout", action),
                        ("on_node_lost", {"survives": survives, "others_up": 3, "replacements": 0, "cap": 2}),
                        *(may_replace if action is sim.NodeLossAction.SAVE_FIRST else [])]
        assert cfg.plan.group("rollout").nodes == 4


def test_where_the_product_ends_the_segment_the_projection_is_the_full_restarts() -> None:
    """A rollout node lost 300 s in. A Miles recipe whose rollout group keeps no whole engine
    without the node (2 rollout nodes, one engine of 2), a reference recipe whose rollout group is
    one node, and one with lifecycle.rollout_node_loss: restart: the product's answer is END, so
    each projects exactly as the full restart of its shape for the same draws (here and over random
    draws at a high rate). The seed's Miles recipe (4 rollout nodes) saves first, so it differs.
    The reference recipe with 4 rollout nodes goes on: no restart, a slower run, a replacement."""
    one_node = ("topology.rollout.nodes=1", "topology.rollout.gpus_per_engine=8")
    one_engine = ("topology.rollout.nodes=2",)
    full = restart()
    busy = replace(COSTS, per_gpu_hour=0.02)  # about a node loss every 1,900 held seconds
    lost = run(full, Scripted([300], ["rollout"]))
    many = run(full, random.Random(1), costs=busy, n=60)
    assert lost.restarts == 1 and lost.node_losses == 1 and lost.went_on == 0 and many.restarts > 3
    assert lost.saved_first == 0 == lost.save_too_late
    for cfg, same_shape in ((config("miles", *one_engine), restart(*one_engine)),
                            (config("reference", *one_node), restart(*one_node))):
        assert sim.on_node_loss(cfg.plan, cfg.plan.group("rollout")) is sim.NodeLossAction.END
        lost_here = run(cfg, Scripted([300], ["rollout"]))
        assert lost_here == run(same_shape, Scripted([300], ["rollout"])) and lost_here.restarts == 1
        assert run(cfg, random.Random(1), costs=busy, n=60) == run(same_shape, random.Random(1), costs=busy, n=60)
    seed_miles = run(config("miles"), random.Random(1), costs=busy, n=60)
    assert seed_miles.saved_first + seed_miles.replaced_in_segment > 0 and seed_miles != many
    in_place = run(config(), Scripted([300], ["rollout"]))
    assert (in_place.restarts, in_place.went_on, in_place.replacements) == (0, 1, 1)
    assert in_place.ettr > lost.ettr and in_place != lost
    assert in_place.ettr_full_speed < in_place.ettr  # an engine of 2 down: steps twice as slow until it is back
    assert in_place.replacement_gpu_h > 0 == lost.replacement_gpu_h
    assert run(config(), random.Random(1), costs=busy, n=60).went_on > 0 == many.went_on


def ledger_of(monkeypatch: pytest.MonkeyPatch) -> list[list[dict[str, Any]]]:
    """The simulated ledgers, one per run, as the product's ETTR reader is handed them."""
    ledgers: list[list[dict[str, Any]]] = []
    real = sim.ettr

    def reader(lines: list[dict[str, Any]], **kw: Any) -> Any:
        ledgers.append(lines)
        return real(lines, **kw)

    monkeypatch.setattr(sim, "ettr", reader)
    return ledgers


def ends(lines: list[dict[str, Any]]) -> list[tuple[Any, ...]]:
    """Each segment's end as (reason, rollouts_at_end, rollouts_run, time, failed nodes, next action)."""
    return [(s["end"]["reason"], s["end"]["rollouts_at_end"], s["end"]["rollouts_run"], pytest.approx(s["end"]["time"]),
             [f["node"] for f in s["end"].get("failed_nodes") or []], s["end"]["next"]["action"]) for s in lines]


def test_a_miles_run_with_no_replacement_to_wait_for_saves_the_rollout_in_flight_and_ends(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The seed's Miles recipe (4 rollout nodes, two engines of 2), 10 rollouts, with
    lifecycle.replacement_wait_s 0 (no wait) or lifecycle.max_replacements 0 (none may be asked
    for): the segment ends once the save is in, with no wait. Rollout node 0 is lost 300 s in,
    halfway through rollout 3 (250-350). on_node_loss says SAVE_FIRST: the loss is noticed at 305,
    before the step's boundary (350), so the save request is in time. The step's other half runs on
    one engine of two (50 s of work in 100 s: it ends at 400), one save (10 s) keeps it, and the
    segment ends at 410 as node-failure naming the node, with rollouts_at_end 3 (the rollout in
    flight included). decide() resubmits; the next segment (bring-up 50, rollouts 4-10 and two
    saves) holds 770 s. Nothing is trained twice: the ledger's ETTR is rollouts 1-3 at segment 1's
    mean step ((100 + 100 + 150) / 3) and 4-10 at 100 s over 410 + 770 held: 1,050 / 1,180; at full
    speed 1,000 / 1,180. Full restart: 1,000 / (305 + 1,070). With lifecycle.save_on_request false
    the product saves nothing (and so waits for nothing): the full restart's figures."""
    ledgers = ledger_of(monkeypatch)
    for override in ("lifecycle.replacement_wait_s=0", "lifecycle.max_replacements=0"):
        miles = config("miles", override)
        assert sim.ProductRule(miles).on_node_lost(sim.NodeLost("rollout", 3, 0)).replacement_wait_s == 0
        r = run(miles, Scripted([300], ["rollout"], [0]), n=10)
        assert ends(ledgers[-1]) == [("node-failure", 3, 3, 410, ["rollout-0"], "resubmit"),
                                     ("completed", 10, 7, 410 + 30 + 770, [], "none")]
        assert ledgers[-1][1]["start"]["rollouts_at_start"] == 3
        assert (r.segments, r.restarts, r.saved_first, r.save_too_late, r.went_on, r.replacements) == (2, 1, 1, 0, 0, 0)
        assert (r.replaced_in_segment, r.waited_out, r.replacement_gpu_h) == (0, 0, 0)
        assert r.ettr == pytest.approx(1050 / 1180) and r.ettr_full_speed == pytest.approx(1000 / 1180)
    full = run(restart(), Scripted([300], ["rollout"], [0]), n=10)
    assert ends(ledgers[-1])[0] == ("node-failure", 0, 2, 305, ["rollout-0"], "resubmit")
    assert full.ettr == pytest.approx(1000 / (305 + 1070)) and full.ettr < r.ettr
    unsaved = run(config("miles", "lifecycle.save_on_request=false"), Scripted([300], ["rollout"], [0]), n=10)
    assert unsaved == full


def test_a_miles_run_whose_replacement_joins_within_the_wait_trains_on_in_the_same_segment(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The same loss (rollout node 0, 300 s in) under the recipe's own wait (600 s) and cap (2): the
    save is in at 410, as above; then the segment asks for a replacement and waits, all held. Its
    one-node job starts queue_s (30 s) later and its Ray node joins ray_join_s (60 s) after that,
    at 500, within the wait; Miles then starts the lost engine on it (engine_restart_s, 120 s) and
    the weight update returns at 620. Rollouts 4-10 and two saves follow (720 s): one segment,
    completed at 1,340, no restart, no bring-up or queue paid again, nothing trained twice. ETTR
    1,050 / 1,340 (the wait and the engine restart held, not training; here dearer than the 50 s
    bring-up and 30 s queue of a restart), at full speed 1,000 / 1,340. The replacement holds its
    8 GPUs from its start (440) to the segment's end (1,340), and counts against the cap. The
    deadline bounds the join, not the engine restart after it: a wait of 90 s (the join to the
    second) still goes on, 89 s does not."""
    ledgers = ledger_of(monkeypatch)
    miles = config("miles")
    assert miles.recipe.lifecycle.replacement_wait_s == 600 and miles.recipe.lifecycle.max_replacements == 2
    r = run(miles, Scripted([300], ["rollout"], [0]), n=10)
    assert ends(ledgers[-1]) == [("completed", 10, 10, 1340, [], "none")]
    assert (r.segments, r.restarts, r.saved_first, r.save_too_late, r.replaced_in_segment, r.waited_out) == (
        1, 0, 0, 0, 1, 0)
    assert (r.replacements, r.went_on, r.node_losses) == (1, 0, 1)
    assert r.ettr == pytest.approx(1050 / 1340) and r.ettr_full_speed == pytest.approx(1000 / 1340)
    assert r.replacement_gpu_h == pytest.approx(8 * (1340 - 440) / 3600)
    run(config("miles", "lifecycle.replacement_wait_s=90"), Scripted([300], ["rollout"], [0]), n=10)
    assert ends(ledgers[-1]) == [("completed", 10, 10, 1340, [], "none")]
    late = run(config("miles", "lifecycle.replacement_wait_s=89"), Scripted([300], ["rollout"], [0]), n=10)
    assert ends(ledgers[-1])[0] == ("node-failure", 3, 3, 410 + 89, ["rollout-0"], "resubmit")
    assert (late.waited_out, late.replaced_in_segment, late.restarts) == (1, 0, 1)


def test_a_miles_run_whose_replacement_does_not_join_in_time_ends_after_the_whole_wait(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The same loss, with a wait of 60 s (the join needs 90 s): the segment ends at 470 (the save
    in at 410, plus the whole wait, held), as node-failure naming the node, from the rollout in
    flight (3); the next segment holds 770 s as after a save-then-end. ETTR 1,050 / (470 + 770):
    the save-then-end figure with the wait added. The replacement job, cancelled at the wait's end,
    held its node from its start (440) to then, and counts against the cap. Under the recipe's
    600 s with a Ray join of 600 s (the join at 1,040, past the 1,010 deadline) the segment ends at
    1,010."""
    ledgers = ledger_of(monkeypatch)
    short = config("miles", "lifecycle.replacement_wait_s=60")
    r = run(short, Scripted([300], ["rollout"], [0]), n=10)
    assert ends(ledgers[-1]) == [("node-failure", 3, 3, 470, ["rollout-0"], "resubmit"),
                                 ("completed", 10, 7, 470 + 30 + 770, [], "none")]
    assert "no replacement joined within lifecycle.replacement_wait_s=60" in ledgers[-1][0]["end"]["failed_nodes"][0]["why"]
    assert (r.segments, r.restarts, r.saved_first, r.waited_out, r.replaced_in_segment, r.replacements) == (
        2, 1, 1, 1, 0, 1)
    assert r.ettr == pytest.approx(1050 / (470 + 770)) and r.ettr_full_speed == pytest.approx(1000 / 1240)
    assert r.replacement_gpu_h == pytest.approx(8 * 30 / 3600)
    slow = run(config("miles"), Scripted([300], ["rollout"], [0]), costs=replace(LOSSES, ray_join_s=600), n=10)
    assert ends(ledgers[-1])[0] == ("node-failure", 3, 3, 1010, ["rollout-0"], "resubmit")
    assert (slow.waited_out, slow.replaced_in_segment) == (1, 0)


def test_a_miles_loss_past_the_replacement_cap_ends_once_saved_with_no_wait(monkeypatch: pytest.MonkeyPatch) -> None:
    """Two rollout nodes lost in one run: node 0 at 300 s (saved at 410, replaced, training again at
    620, as above), then node 2 at 750 s, during rollout 5 (720-820, a periodic save due). Noticed
    at 755, in time: the step's rest on one engine of two ends at 890 and its save is in at 900.
    Under lifecycle.max_replacements 1 the run has asked for its one replacement already, so the
    segment ends at once, at 900, from rollout 5: no wait, no second replacement; the next segment
    holds 50 + 500 + 10. Under the recipe's cap of 2 it waits again: the second replacement joins at
    990, the engine restarts by 1,110, and rollouts 6-10 end the run in the same segment at 1,620."""
    ledgers = ledger_of(monkeypatch)
    script = (lambda: Scripted([300, 450], ["rollout", "rollout"], [0, 2]))
    capped = run(config("miles", "lifecycle.max_replacements=1"), script(), n=10)
    assert ends(ledgers[-1]) == [("node-failure", 5, 5, 900, ["rollout-2"], "resubmit"),
                                 ("completed", 10, 5, 900 + 30 + 560, [], "none")]
    assert (capped.replacements, capped.replaced_in_segment, capped.waited_out, capped.saved_first) == (1, 1, 0, 1)
    assert sim.ProductRule(config("miles", "lifecycle.max_replacements=1")).on_node_lost(
        sim.NodeLost("rollout", 3, 1)).replacement_wait_s == 0
    both = run(config("miles"), script(), n=10)
    assert ends(ledgers[-1]) == [("completed", 10, 10, 1620, [], "none")]
    assert (both.replacements, both.replaced_in_segment, both.restarts) == (2, 2, 0)


def test_a_miles_save_in_after_the_walltime_lead_is_not_followed_by_a_wait(monkeypatch: pytest.MonkeyPatch) -> None:
    """20 rollouts; the first segment's lead is at 1,900 (2,000 s walltime, 100 s lead). Rollout
    node 0 lost at 1,840, during rollout 18 (1,780-1,880): noticed at 1,845, in time; the step's
    rest on one engine of two ends at 1,920 and its save is in at 1,930, after the lead, when the
    segment is being stopped: no replacement is asked for (the runner waits only with no stop under
    way), and it ends at 1,930 from rollout 18."""
    ledgers = ledger_of(monkeypatch)
    r = run(config("miles"), Scripted([1840], ["rollout"], [0]), n=20)
    assert ends(ledgers[-1])[0] == ("node-failure", 18, 18, 1930, ["rollout-0"], "resubmit")
    assert (r.replacements, r.replaced_in_segment, r.waited_out, r.saved_first) == (0, 0, 0, 1)


def test_a_loss_too_late_for_the_rollouts_save_waits_the_stall_timeout_and_ends_from_the_last_checkpoint(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The same run, rollout node 0 lost at 346, within detect_s (5 s) of rollout 3's boundary at
    350: the save request (351) comes after Miles looked for it. Rollout 3 is trained, then Miles
    waits in its weight update for the lost engine and no save comes: the segment waits the stall
    timeout (4 x (100 + 10) s, raised to the 20-minute floor: 1,200 s, below the 1,800 s of
    lifecycle.save_timeout_s) and ends at 1,551 from the last periodic checkpoint (none: 0). ETTR
    1,000 / (1,551 + 1,070). Lost at 546 instead, within 5 s of rollout 5's boundary (550), its
    periodic save (550-560) still lands: the segment ends at 1,751 from rollout 5, and the next
    holds 50 + 500 + 10. The wait follows the recipe: lifecycle.stall_timeout_s 1,500 (1,500 s) and
    lifecycle.save_timeout_s 600 (600 s). No save came, so no replacement is waited for (the job
    waits only after a save that came in)."""
    ledgers = ledger_of(monkeypatch)
    miles = config("miles")
    late = run(miles, Scripted([346], ["rollout"], [0]), n=10)
    assert ends(ledgers[-1]) == [("node-failure", 0, 3, 1551, ["rollout-0"], "resubmit"),
                                 ("completed", 10, 10, 1551 + 30 + 1070, [], "none")]
    assert (late.restarts, late.saved_first, late.save_too_late) == (1, 0, 1)
    assert late.ettr == pytest.approx(1000 / (1551 + 1070))
    periodic = run(miles, Scripted([546], ["rollout"], [0]), n=10)
    assert ends(ledgers[-1])[0] == ("node-failure", 5, 5, 1751, ["rollout-0"], "resubmit")
    assert periodic.ettr == pytest.approx(1000 / (1751 + 560)) and periodic.save_too_late == 1
    assert (late.replacements, late.waited_out, late.replaced_in_segment) == (0, 0, 0)  # no save: no wait
    # noticed at 349: saved at 350 + 6 + 10
    in_time = run(config("miles", "lifecycle.replacement_wait_s=0"), Scripted([344], ["rollout"], [0]), n=10)
    assert ends(ledgers[-1])[0] == ("node-failure", 3, 3, 366, ["rollout-0"], "resubmit") and in_time.saved_first == 1
    replaced = run(miles, Scripted([344], ["rollout"], [0]), n=10)  # the recipe's wait: joined at 456, back at 576
    assert (replaced.segments, replaced.replaced_in_segment, replaced.restarts) == (1, 1, 0)
    for override, wait in (("lifecycle.stall_timeout_s=1500", 1500), ("lifecycle.save_timeout_s=600", 600)):
        run(config("miles", override), Scripted([346], ["rollout"], [0]), n=10)
        assert ends(ledgers[-1])[0] == ("node-failure", 0, 3, 351 + wait, ["rollout-0"], "resubmit")


def test_no_save_without_an_engine_left_to_finish_the_rollout(monkeypatch: pytest.MonkeyPatch) -> None:
    """The seed's Miles run with one engine's process dead (restarted in place only at the next
    weight update): a rollout node of the other engine lost 10 s later leaves no engine to finish
    the rollout in flight, so no save can come and the segment ends as the revoked job's would,
    detect_s after the loss, from the last checkpoint."""
    ledgers = ledger_of(monkeypatch)
    r = run(config("miles"), Scripted([300, 10], ["rollout", "rollout"], [0, 2], kinds=["process", "node"]),
            costs=FAULTS, n=10)
    assert ends(ledgers[-1])[0] == ("node-failure", 0, 2, 315, ["rollout-2"], "resubmit")
    assert (r.saved_first, r.save_too_late, r.engine_restarts) == (0, 1, 1)


def test_the_cap_on_replacements_is_the_recipes() -> None:
    """Two rollout nodes of one engine lost, 300 and 600 s in: the recipe's default cap of 2
    replaces both; ``lifecycle.max_replacements`` 1 replaces one, and 0 none (the run goes on with
    an engine fewer until the segment ends, so it runs slower)."""
    runs = {cap: run(c, Scripted([300, 300], ["rollout", "rollout"], [0, 1]))
            for cap, c in ((2, config()), (1, config("reference", "lifecycle.max_replacements=1")),
                           (0, config("reference", "lifecycle.max_replacements=0")))}
    assert [runs[c].replacements for c in (2, 1, 0)] == [2, 1, 0]
    assert runs[0].replacement_gpu_h == 0 < runs[1].replacement_gpu_h < runs[2].replacement_gpu_h
    assert all(r.restarts == 0 and r.went_on == 2 for r in runs.values())
    assert runs[0].ettr_full_speed < runs[2].ettr_full_speed


def test_with_no_whole_engine_left_the_stall_watchdog_ends_the_segment() -> None:
    """No replacements (cap 0), one node of each engine lost: the product goes on (two of the
    segment's rollout nodes still run) but no engine is whole, so no rollout finishes until the
    product's stall watchdog (20 minutes at the floor) stops the segment; decide() resubmits."""
    cfg = config("reference", "lifecycle.max_replacements=0")
    r = run(cfg, Scripted([300, 300], ["rollout", "rollout"], [0, 2]))
    assert (r.stalls, r.restarts, r.went_on, r.replacements) == (1, 0, 2, 0)
    assert r.unfinished == 0 and r.ettr < run(restart(), Scripted([300], ["rollout"])).ettr


def test_a_lost_trainer_node_restarts_under_every_policy() -> None:
    """A lost trainer node ends the segment from the last checkpoint whatever the backend: no save
    first for Miles either (on_node_loss says END for the trainer group)."""
    runs = [run(cfg, Scripted([300], ["trainer"])) for cfg in (restart(), config(), config("miles"))]
    assert [r.restarts for r in runs] == [1, 1, 1] and runs[0] == runs[1] == runs[2]
    assert runs[2].saved_first == 0 == runs[2].save_too_late


def test_the_product_rule_book_stops_a_chain_that_fails_twice_without_progress() -> None:
    """Two segments in a row lose a node before their first checkpoint: decide() stops the chain
    (its rule 4), the simulated operator resubmits, and the run still completes."""
    r = run(restart(), Scripted([200, 200], ["trainer", "trainer"]))
    assert (r.restarts, r.chain_stops, r.stops_no_progress) == (2, 1, 1)
    assert r.ettr > 0


def test_a_run_that_cannot_finish_is_given_up_at_the_horizon() -> None:
    r = run(restart(), random.Random(1), costs=replace(COSTS, per_gpu_hour=1.0, horizon=3))
    assert r.unfinished == 1 and r.ettr == 0 and r.days * 86400 >= 3 * 20 * 100


def test_the_projection_runs_every_policy_on_every_size() -> None:
    shapes = (SMALL, replace(sim.SHAPES[1], name="1,024"))
    rows = sim.project(runs=2, seed=3, days=1, costs=replace(COSTS, per_gpu_hour=1e-3), overrides=RECIPE,
                       shapes=shapes)
    policies = ["full restart", "(a) product, miles recipe", "(b) product, reference, cap 2",
                "(b) product, reference, no cap"]
    assert [(r["scale"], r["policy"]) for r in rows] == [(s.name, p) for s in shapes for p in policies]
    by = {(r["gpus"], r["policy"]): r for r in rows}
    assert by[(1024, policies[0])]["survives"] == by[(1024, policies[1])]["survives"] == {
        "trainer": False, "rollout": False}
    assert by[(1024, policies[2])]["survives"] == {"trainer": False, "rollout": True}
    assert by[(1024, policies[0])]["on_node_loss"] == {"trainer": "END", "rollout": "END"}
    assert by[(1024, policies[1])]["on_node_loss"] == {"trainer": "END", "rollout": "SAVE_FIRST"}
    assert by[(1024, policies[2])]["on_node_loss"] == {"trainer": "END", "rollout": "GO_ON"}
    assert by[(1024, policies[3])]["max_replacements"] == sim.NO_CAP
    assert all(0 < r["ettr_mean"] <= 1 for r in rows)
    assert "| 1,024 | 1024 (88 + 40; 20) |" in sim.table(rows) and "restarts (saved first / too late)" in sim.table(rows)
    assert "Miles replacement waits: joined / not in time" in sim.table(rows)
    assert all(r["replacement_wait_s"] == 600 for r in rows)
    assert sim.main(["--runs", "0"]) == 2 and sim.main(["--interval", "0"]) == 2 and sim.main(["--rate", "0"]) == 2
    assert sim.main(["--replacement-wait", "-1"]) == 2
    assert sim.main(["--process-share", "1.5"]) == 2


# -- process faults on a live node ----------------------------------------------------------------
def process(group: str, at: float = 300, node: int = 0) -> Scripted:
    """One process fault ``at`` held seconds into the run, on ``group`` (rollout: on node ``node``)."""
    return Scripted([at], [group], [node] if group == "rollout" else [], kinds=["process"])


def test_a_miles_engine_that_dies_is_restarted_in_place_and_the_segment_goes_on() -> None:
    """10 rollouts in one segment. The engine of rollout nodes 0-1 dies 300 s in (rollout 3, from 250
    to 350): Miles's health check sees it before the weight update, so the step runs on one engine
    of two (200 s), then the update waits 120 s for the engine to start again on the same GPUs, and
    the run goes on whole. Nothing is trained twice: one segment, ledger ETTR 1,100 / 1,290 (the slow
    step counts as training) and 1,000 / 1,290 at full speed, against 1,000 / 1,070 without the fault."""
    miles = config("miles")
    assert sim.restarts_dead_engines(miles.plan) and not sim.restarts_dead_workers(miles.plan)
    clean = run(miles, random.Random(0), costs=COSTS, n=10)
    r = run(miles, process("rollout"), costs=FAULTS, n=10)
    assert (clean.segments, clean.ettr) == (1, pytest.approx(1000 / 1070))
    assert (r.segments, r.process_faults, r.engine_restarts, r.fault_ends, r.restarts, r.node_losses) == (1, 1, 1, 0, 0, 0)
    assert r.ettr == pytest.approx(1100 / 1290) and r.ettr_full_speed == pytest.approx(1000 / 1290)
    assert r.replacements == 0 == r.replacement_gpu_h and r.unfinished == 0
    # both engines dead at once (nodes 0 and 2, 10 s apart): no engine serves, Miles fails the rollout
    both = run(miles, Scripted([300, 10], ["rollout", "rollout"], [0, 2], kinds=["process", "process"]), costs=FAULTS,
               n=10)
    assert (both.engine_restarts, both.fault_ends, both.segments) == (2, 1, 2)


def test_a_miles_engine_death_after_the_last_health_check_fails_the_weight_update() -> None:
    """The engine dies 330 s in, 20 s before rollout 3's weight update, after Miles's last check
    (every 30 s, read from the plan's argv): rollout 3 is trained, the update to the dead engine
    fails, the driver exits 1 and decide() retries the segment from the start (no checkpoint yet):
    rollouts 1-3 are trained again. With the check every 10 s (the recipe's extra_args) the same
    death is seen in time and the segment goes on."""
    miles = config("miles")
    assert sim.update_window_s(miles.plan) == 30
    r = run(miles, process("rollout", at=330), costs=FAULTS, n=10)
    assert (r.segments, r.fault_ends, r.engine_restarts, r.restarts) == (2, 1, 0, 0)
    assert r.ettr == pytest.approx(1000 / (355 + 1070))
    fast = config("miles", 'backend_options.extra_args=["--rollout-health-check-interval", "10"]')
    assert sim.update_window_s(fast.plan) == 10
    assert run(fast, process("rollout", at=330), costs=FAULTS, n=10).ettr == pytest.approx(1100 / 1290)


def test_a_trainer_process_fault_ends_the_segment_as_an_error_and_excludes_no_node(monkeypatch: pytest.MonkeyPatch) -> None:
    """A trainer process dies 300 s in on every backend and policy: the driver fails, the segment
    ends as ``error`` (not ``node-failure``: the node is up, so its end names no failed node and
    nothing is excluded) and decide() resubmits from the last checkpoint. It costs what a lost
    trainer node costs: 1,000 / (305 + 1,070)."""
    reasons: list[tuple[str, str]] = []
    real = sim.decide

    def decide(outcome: Any, **kw: Any) -> Any:
        d = real(outcome, **kw)
        reasons.append((outcome.reason.value, d.action.value))
        return d

    monkeypatch.setattr(sim, "decide", decide)
    for cfg in (config("miles"), config(), restart()):
        reasons.clear()
        r = run(cfg, process("trainer"), costs=FAULTS, n=10)
        assert reasons == [("error", "resubmit"), ("completed", "none")]
        assert (r.segments, r.fault_ends, r.restarts, r.node_losses, r.process_faults) == (2, 1, 0, 0, 1)
        assert r.ettr == pytest.approx(1000 / (305 + 1070))
        reasons.clear()
        lost = run(cfg, Scripted([300], ["trainer"], kinds=["node"]), costs=FAULTS, n=10)
        assert reasons == [("node-failure", "resubmit"), ("completed", "none")] and lost.restarts == 1
        assert lost.ettr == r.ettr


def test_a_reference_worker_that_dies_is_restarted_in_place_while_the_others_serve_under_both_policies() -> None:
    """The reference driver starts a new worker in the slot of one whose process died on a live node
    (unit_service._restart_in_place; _joined swaps it in once its model has loaded) and goes on
    with the others meanwhile; no replacement is asked for (the node is up), and
    lifecycle.rollout_node_loss is not read, so the full-restart recipe does the same. Node 0's
    worker dies 300 s in (rollout 3, from 250): its engine is not whole until its new worker serves,
    150 s later (worker_restart_s), so rollout 3 takes 200 s (250-450); the worker is back at 450,
    from rollout 4 on the run is whole again: one segment, ends at 1,170; ETTR 1,100 / 1,170, at full
    speed 1,000 / 1,170 (Miles, whose update waits 120 s for its engine: 1,100 / 1,290; the worker
    dropped until the segment's end, as before the restart: 1,800 / 1,870)."""
    runs = [run(cfg, process("rollout"), costs=FAULTS, n=10) for cfg in (config(), restart())]
    assert runs[0] == runs[1]
    r = runs[0]
    assert (r.segments, r.workers_restarted, r.fault_ends, r.replacements, r.went_on, r.restarts) == (1, 1, 0, 0, 0, 0)
    assert r.ettr == pytest.approx(1100 / 1170) and r.ettr_full_speed == pytest.approx(1000 / 1170)
    assert r.replacement_gpu_h == 0 and r.unfinished == 0
    # back only after rollout 4 has started (180 s): rollouts 3 and 4 both on one engine, 200 s each
    slow = run(config(), process("rollout"), costs=replace(FAULTS, worker_restart_s=180), n=10)
    assert (slow.segments, slow.workers_restarted) == (1, 1)
    assert slow.ettr == pytest.approx(1200 / 1270) and slow.ettr_full_speed == pytest.approx(1000 / 1270)


def test_the_last_reference_worker_that_dies_does_not_end_the_segment_the_step_waits_for_it() -> None:
    """A rollout group of one node (one worker) whose worker dies 300 s in, during rollout 3
    (250-350): the segment goes on (a worker is starting, unit_service._check_capacity), nothing
    serves until the new worker does at 450, and rollout 3 runs again from there (the units done
    before the death charged again): 450-550, the run ends at 1,270 in one segment, ETTR 1,000 /
    1,270 (no zero-capacity division: the step waits). With nccl weights the segment still ends
    (the worker was a rank of the broadcast group): decide() resubmits, 1,000 / (305 + 1,070)."""
    one_node = config("reference", "topology.rollout.nodes=1", "topology.rollout.gpus_per_engine=8")
    nccl = config("reference", "backend_options.weight_sync=nccl")
    assert not sim.restarts_dead_workers(nccl.plan) and sim.restarts_dead_workers(one_node.plan)
    assert sim.ProductRule(one_node).on_process_fault(sim.ProcessFault("rollout", 0)).end_segment is False
    last = run(one_node, process("rollout"), costs=FAULTS, n=10)
    assert (last.segments, last.fault_ends, last.workers_restarted, last.stalls, last.restarts) == (1, 0, 1, 0, 0)
    assert last.ettr == pytest.approx(1000 / 1270) and last.ettr_full_speed == pytest.approx(1000 / 1270)
    ended = run(nccl, process("rollout"), costs=FAULTS, n=10)
    assert (ended.segments, ended.fault_ends, ended.workers_restarted) == (2, 1, 0)
    assert ended.ettr == pytest.approx(1000 / (305 + 1070))


def test_a_lost_node_ends_the_segment_only_when_no_worker_serves_and_none_is_starting() -> None:
    """A rollout group of two one-node engines (reference, in place). Node 0's worker dies 300 s in
    (back at 450), then node 1 is lost 10 s later: no worker serves, but node 0's is starting, so
    the segment goes on (unit_service._check_capacity) and waits for it; node 1 is dropped and a
    replacement asked for: rollout 3 waits for the restarted worker (450), then runs on its one
    engine until the replacement serves."""
    two = config("reference", "topology.rollout.nodes=2", "topology.rollout.gpus_per_engine=8")
    assert two.engines == 2
    r = run(two, Scripted([300, 10], ["rollout", "rollout"], [0, 1], kinds=["process", "node"]), costs=FAULTS, n=10)
    assert (r.segments, r.workers_restarted, r.went_on, r.fault_ends, r.restarts) == (1, 1, 1, 0, 0)
    assert r.unfinished == 0


class Counted(random.Random):
    """A seeded generator that records the rate of every gap it draws."""

    def __init__(self, seed: int) -> None:
        super().__init__(seed)
        self.rates: set[float] = set()

    def expovariate(self, lambd: float) -> float:
        self.rates.add(lambd)
        return super().expovariate(lambd)


def test_process_faults_split_the_interruption_rate_and_add_nothing_to_it() -> None:
    """The gaps between interruptions are drawn at the run's GPUs x the per-GPU rate with or without
    the split, and over many draws the share of process faults is the one asked (Llama 3's 14.6%),
    so the rate of node losses falls by that share. With share 0 no kind is drawn: the projection
    is the node-loss-only one, draw for draw."""
    assert sim.LLAMA3_PROCESS_SHARE == pytest.approx(0.146)
    assert sim.PROCESS_SHARES == {"llama3": sim.LLAMA3_PROCESS_SHARE, "robustrl": sim.LLAMA3_PROCESS_SHARE}
    cfg, busy = config(), replace(COSTS, per_gpu_hour=0.2)  # about one every 190 held seconds
    per_second = cfg.plan.total_gpus * 0.2 / 3600
    faults = losses = 0
    for seed in range(20):
        rng = Counted(seed)
        r = run(cfg, rng, costs=replace(busy, process_share=sim.LLAMA3_PROCESS_SHARE), n=40)
        assert rng.rates == {per_second}
        faults, losses = faults + r.process_faults, losses + r.node_losses
    assert faults + losses > 1000
    assert faults / (faults + losses) == pytest.approx(sim.LLAMA3_PROCESS_SHARE, abs=0.035)
    split = sim.project(runs=1, seed=3, days=1, costs=replace(busy, process_share=0.25), overrides=RECIPE,
                        shapes=(SMALL,))[0]
    assert split["node_losses_per_day"] + split["process_faults_per_day"] == pytest.approx(split["interruptions_per_day"])
    assert split["interruptions_per_day"] == pytest.approx(96 * 0.2 * 24)
    assert split["process_faults_per_day"] == pytest.approx(96 * 0.2 * 24 * 0.25)
    node_only = run(cfg, Counted(1), costs=busy, n=40)
    assert node_only.process_faults == 0 and node_only == run(cfg, random.Random(1), costs=busy, n=40)
