"""benchmarks/ettr.py's simulator: a failure-free chain whose ETTR is known by hand, and scripted node
losses that show the policy seam and the product's decision code at work."""

from __future__ import annotations

import random
from dataclasses import replace

import benchmark_script
import pytest

sim = benchmark_script.load("ettr")

# 100 s steps, a 10 s save every 5 rollouts, 50 s bring-up, a 2,000 s walltime with a 100 s lead
SMALL = sim.Scale("small", trainer_nodes=2, rollout_nodes=4, bringup_s=50, queue_s=30, replace_s=300)
COSTS = sim.Costs(step_s=100, save_s=10, interval=5, walltime_s=2000, lead_s=100, detect_s=5, operator_s=600,
                  max_segments=50, per_gpu_hour=0.0)

LOSSES = replace(COSTS, per_gpu_hour=1.0)  # for the scripted losses below (their times are the script's)


class Scripted(random.Random):
    """Node losses at the held seconds given (after each, the next), each on the group given."""

    def __init__(self, gaps: list[float], groups: list[str]) -> None:
        super().__init__(0)
        self.gaps, self.groups = list(gaps), list(groups)

    def expovariate(self, lambd: float) -> float:
        return self.gaps.pop(0) if self.gaps else 1e12

    def random(self) -> float:
        return 0.0 if (self.groups.pop(0) if self.groups else "trainer") == "trainer" else 0.999


def test_without_failures_the_ettr_is_the_one_worked_out_by_hand() -> None:
    """Segment 1: bring-up to 50, rollouts 1-15 with three saves to 1,580, 16-18 to 1,880; rollout 19
    would pass the lead (1,900): save on request, end at 1,890. Segment 2: bring-up, rollouts 19-20
    and the final save: 260 s. 20 rollouts x 100 s over 2,150 s held."""
    r = sim.simulate(SMALL, COSTS, sim.FullRestart(), 20, random.Random(0))
    assert r.segments == 2 and r.restarts == 0 and r.chain_stops == 0
    assert r.ettr == pytest.approx(2000 / 2150) and r.ettr_full_speed == pytest.approx(2000 / 2150)
    assert r.span_ettr == pytest.approx(2000 / (2150 + 30))  # the queue wait is in the span, not held


def test_a_lost_rollout_node_restarts_today_and_only_slows_the_run_in_place() -> None:
    """A rollout node lost 300 s into the first segment. Full restart: the segment ends as a node
    failure, decide() resubmits from the checkpoint at 0 (none yet): 2 rollouts re-done. In place:
    1 of the 2 engines down (16-GPU engines of 2 nodes: 4 rollout nodes make 2), steps twice as slow
    until the replacement serves 300 s later, no restart, and the same 20 rollouts are kept."""
    restart = sim.simulate(SMALL, LOSSES, sim.FullRestart(), 20, Scripted([300], ["rollout"]))
    in_place = sim.simulate(SMALL, LOSSES, sim.InPlaceReplacement(replace_s=300), 20, Scripted([300], ["rollout"]))
    assert (restart.restarts, in_place.restarts) == (1, 0) and restart.node_losses == in_place.node_losses == 1
    assert in_place.ettr > restart.ettr
    assert in_place.ettr_full_speed < in_place.ettr  # the slowed steps count as training, not at full speed
    assert in_place.replacement_gpu_h > 0 == restart.replacement_gpu_h


def test_a_lost_trainer_node_restarts_under_both_policies() -> None:
    runs = [sim.simulate(SMALL, LOSSES, policy, 20, Scripted([300], ["trainer"]))
            for policy in (sim.FullRestart(), sim.InPlaceReplacement(replace_s=300))]
    assert [r.restarts for r in runs] == [1, 1] and runs[0].ettr == pytest.approx(runs[1].ettr)


def test_the_product_rule_book_stops_a_chain_that_fails_twice_without_progress() -> None:
    """Two segments in a row lose a node before their first checkpoint: decide() stops the chain
    (its rule 4), the simulated operator resubmits, and the run still completes."""
    r = sim.simulate(SMALL, LOSSES, sim.FullRestart(), 20, Scripted([200, 200], ["trainer", "trainer"]))
    assert (r.restarts, r.chain_stops, r.stops_no_progress) == (2, 1, 1)
    assert r.ettr > 0


def test_the_cap_on_replacements_is_the_recipes_and_leaves_the_engine_down_once_reached() -> None:
    """Two rollout nodes lost, 300 and 900 s into the run, with a cap of 1: the first is replaced
    (back at 600 s), the second is not, so the run goes on with one engine fewer until the segment
    ends; with a cap of 5 it is replaced too."""
    assert sim.InPlaceReplacement(replace_s=1).cap == 2  # lifecycle.max_replacements' default
    capped = sim.simulate(SMALL, LOSSES, sim.InPlaceReplacement(replace_s=300, cap=1), 20,
                          Scripted([300, 600], ["rollout", "rollout"]))
    free = sim.simulate(SMALL, LOSSES, sim.InPlaceReplacement(replace_s=300, cap=5), 20,
                        Scripted([300, 600], ["rollout", "rollout"]))
    assert capped.restarts == free.restarts == 0 and capped.ettr_full_speed < free.ettr_full_speed


def test_the_projection_runs_every_policy_on_every_scale() -> None:
    rows = sim.project(runs=2, seed=3, days=1)
    policies = ["full restart", "in place, cap 2", "in place, no cap"]
    assert [(r["scale"], r["policy"]) for r in rows][:3] == [(sim.SCALES[0].name, p) for p in policies]
    by = {(r["gpus"], r["policy"]): r for r in rows}
    for scale in sim.SCALES:
        for policy in policies:
            assert 0 < by[(scale.gpus, policy)]["ettr_mean"] <= 1
    assert "| 1,024 GPUs | 1024 (86 + 42; 21) |" in sim.table(rows)
    assert sim.main(["--runs", "0"]) == 2
