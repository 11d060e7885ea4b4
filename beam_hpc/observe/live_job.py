"""The live Slurm state of a run's current job, for `beam-hpc status` (beam_hpc.observe.status).

Slurm is optional to the status: ``scontrol ping`` is asked first (instant when the controller is
down), and every failure becomes a note in the answer rather than an error, because the status
must come out on a login node whose Slurm is slow or gone.
"""

from __future__ import annotations

import shutil
from typing import Any

from beam_hpc.slurm import client as slurm_client

_JS = slurm_client.JobState  # Slurm's states are spelled once, there
ACTIVE_STATES = (_JS.RUNNING, _JS.COMPLETING, _JS.CONFIGURING, _JS.SIGNALING, _JS.STAGE_OUT, _JS.RESIZING)
WAITING_STATES = (_JS.PENDING, _JS.REQUEUED, _JS.REQUEUE_HOLD, _JS.REQUEUE_FED, _JS.SUSPENDED, _JS.RESV_DEL_HOLD)

CONTROLLER_CHECK_S = 5.0  # `scontrol ping` first: instant when slurmctld is down (scontrol show job: 18 s)


def slurm_job_state(job_id: str, timeout: float = 10.0) -> dict[str, Any]:
    """The live state of a (possibly heterogeneous) job from `scontrol show job`.

    ``reachable`` is False when scontrol is missing or the controller does not answer; a job that
    Slurm no longer knows (finished longer than MinJobAge ago) is reachable with state "GONE".
    ``controller`` names the controller when it did not answer (``scontrol ping``'s words), else None.
    """
    out: dict[str, Any] = {"reachable": False, "job_id": job_id, "state": None, "reason": None,
                           "components": [], "note": "", "controller": None}
    if shutil.which("scontrol") is None:
        out["note"] = "scontrol not found on PATH: no live Slurm state"
        return out
    try:
        slurm_client.ping(timeout=min(timeout, CONTROLLER_CHECK_S))
    except slurm_client.SlurmUnavailable as err:
        if err.transient:
            out["controller"] = slurm_client.describe_controller(err)
            out["note"] = f"Slurm could not be asked: {out['controller']}"
        else:
            out["note"] = f"scontrol failed: {err.last_line}"
        return out
    try:
        records = slurm_client.show_job_records(str(job_id), timeout=timeout)
    except slurm_client.SlurmUnavailable as err:
        out["note"] = (f"scontrol did not answer within {timeout:.0f} s" if err.timed_out
                       else f"scontrol failed: {err.last_line}")
        if err.transient:
            out["controller"] = slurm_client.describe_controller(err)
        return out
    if records is None:
        out.update(reachable=True, state="GONE",
                   note="Slurm no longer knows this job (it ended a while ago)")
        return out
    keys = ("JobId", "HetJobOffset", "JobState", "Reason", "NodeList", "Partition", "RunTime",
            "TimeLimit", "Restarts", "StartTime", "EndTime")
    for fields in records:
        if "JobState" in fields:
            out["components"].append({k: fields.get(k) for k in keys})
    out["reachable"] = True
    if out["components"]:
        lead = out["components"][0]
        out["state"], out["reason"] = lead["JobState"], lead["Reason"]
    return out
