"""beam_hpc.lifecycle.decide: the rule book, case by case (no I/O)."""

from __future__ import annotations

from beam_hpc.lifecycle.decide import Action, Outcome, decide
from beam_hpc.run import ledger


def _decide(reason: str, start: int, end: int, *, run: int = 3, history: list | None = None, **kw):
    o = Outcome(reason=reason, rollouts_at_start=start, rollouts_at_end=end, num_rollout=20, rollouts_run=run,
                retryable=kw.pop("retryable", True))
    opts = {"history": history or [], "max_segments": 10, "cancelled": False, "requeue_on_preemption": True}
    opts.update(kw)
    return decide(o, **opts)


def _seg(reason: str | None, start: int, end: int) -> dict:
    """An earlier segment as the ledger's reader merges it: its start line, and its end line unless
    it was killed hard (``reason`` None)."""
    seg = {"segment": "x", "start": ledger.start_record(job_id="100", restart=0, host="n1", rollouts_at_start=start,
                                                          num_rollout=10, resume=start > 0, walltime_s=120, lead_s=60)}
    if reason is not None:
        seg["end"] = ledger.end_record(job_id="100", restart=0, rollouts_at_end=end, reason=reason, detail="d",
                                       next_action="resubmit", next_job_id="101", rollout_s=2.0, save_s=0.5)
    return seg


def test_decide_resubmits_after_walltime_progress_and_stops_when_done() -> None:
    assert _decide("walltime", 4, 8).action == "resubmit"
    assert _decide("walltime", 4, 8).action is Action.RESUBMIT  # an enum whose value is the ledger's string
    assert _decide("walltime", 4, 20).action == "none"
    assert "num_rollout 20 reached" in _decide("error", 4, 20).detail


def test_decide_requeues_preemptions_unless_turned_off() -> None:
    assert _decide("preempted", 4, 4).action == "requeue"  # even without progress: it was not our fault
    assert _decide("preempted", 4, 6, requeue_on_preemption=False).action == "none"


def test_decide_guards() -> None:
    assert "no progress" in _decide("walltime", 4, 4).detail
    assert _decide("walltime", 4, 4).action == "none"
    assert _decide("walltime", 4, 8, cancelled=True).action == "none"
    assert _decide("cancelled", 4, 8).action == "none"
    d = _decide("walltime", 4, 8, history=[_seg("walltime", 0, 4)] * 9)
    assert d.action == "none" and "max_segments" in d.detail
    assert _decide("error", 4, 4, retryable=False).action == "none"


def test_decide_retries_a_failure_once_but_not_twice_in_a_row() -> None:
    first = _decide("node-failure", 4, 4, run=0, history=[_seg("walltime", 0, 4)])
    assert first.action == "resubmit" and "before its first rollout" in first.detail
    second = _decide("error", 4, 4, run=0, history=[_seg("walltime", 0, 4), _seg("node-failure", 4, 4)])
    assert second.action == "none" and "failed without progress too" in second.detail
    assert _decide("error", 4, 4, run=0, history=[_seg(None, 4, 4)]).action == "none"  # killed hard before
    assert _decide("error", 4, 6, run=2, history=[_seg("error", 4, 4)]).action == "resubmit"  # progress resets it
