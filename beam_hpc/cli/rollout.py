"""``beam-hpc rollout add RUN --nodes N | list RUN | remove RUN [JOBID]``: rollout capacity that comes and
goes, as Slurm jobs of their own that join a running run (beam_hpc.submission.rollout_job, extra_node).

Registered by beam_hpc/cli/app.py (PLUGIN_MODULES). ``add`` checks everything (the run, the node
count, the time, the partition's shape asked of Slurm, the model's reach) before it writes the script
under ``RUN/elastic/`` and submits it; ``--dry-run`` prints it and writes nothing. A Miles run is
refused first, with the Miles code line that stops it (Miles starts no engines it did not launch on
any run an extra job could serve), unless ``--replaces NODE`` names a rollout node its running
segment lost: the job then joins that segment's Ray cluster in the node's place (the segment asks
for this itself, beam_hpc.elastic.ray_replacement). ``remove`` asks a
running job's nodes to leave (``USR2`` to its tasks: they drain, deregister, and the job ends) and
cancels a pending one. Exit codes: 0 done; 2 bad input, one line per problem; 1 Slurm refused.
"""

from __future__ import annotations

import argparse
import shlex
import time

from beam_hpc.errors import InputError, RuntimeFailure, shorten


def add_parser(subparsers: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    p = subparsers.add_parser("rollout", help="add, list or remove extra rollout capacity of a running run")
    sub = p.add_subparsers(dest="rollout_command", required=True)
    a = sub.add_parser("add", help="submit a rollout-only job that joins the run and serves its rollouts")
    a.add_argument("run_dir", metavar="RUN", help="the run's output directory")
    a.add_argument("--nodes", type=int, required=True, help="nodes of the run's rollout-group shape")
    a.add_argument("--partition", default=None, help="where (default: the site's rollout partition)")
    a.add_argument("--time", default=None, help="the job's time limit (default: the run's walltime)")
    a.add_argument("--site", default=None, help="site profile for the job (default: the run's own)")
    a.add_argument("--exclude", action="append", default=[], metavar="NODE",
                   help="a node to leave out (repeatable), beside the run's excluded nodes and the site's quarantine")
    a.add_argument("--replaces", default=None, metavar="NODE",
                   help="(a Miles run) join the running segment's Ray cluster in the place of NODE, a rollout node "
                        "it lost; the segment asks for this itself")
    a.add_argument("--dry-run", action="store_true", help="print the script and the sbatch line; submit nothing")
    a.set_defaults(func=cmd_add)
    ls = sub.add_parser("list", help="the run's extra jobs: state, rollouts and versions served")
    ls.add_argument("run_dir", metavar="RUN")
    ls.set_defaults(func=cmd_list)
    r = sub.add_parser("remove", help="let extra jobs leave the run (they drain and deregister first)")
    r.add_argument("run_dir", metavar="RUN")
    r.add_argument("job_ids", nargs="*", metavar="JOBID", help="default: every extra job still pending or running")
    r.set_defaults(func=cmd_remove)


def _run(run_dir: str):  # type: ignore[no-untyped-def]
    """The run's Plan, or InputError naming what is wrong with the directory."""
    from pathlib import Path

    from beam_hpc.observe.run_dir import check_run_dir
    from beam_hpc.plan.paths import RunPaths
    from beam_hpc.plan.plan import load_plan

    root = check_run_dir(run_dir)
    plan_file = RunPaths(str(root)).plan
    if not Path(plan_file).is_file():
        raise InputError(f"RUN: {shorten(run_dir)} is not a run directory (no plan.json); give the run's "
                         "--output-dir, the directory `beam-hpc submit` printed")
    return load_plan(plan_file)


def _excluded(plan, site) -> tuple[str, ...]:  # type: ignore[no-untyped-def]
    """The run's failed nodes and the site's quarantine: what the run's own resubmissions exclude."""
    from beam_hpc.lifecycle import exclusions, quarantine
    from beam_hpc.run import ledger

    segments, _ = ledger.read_ledger(plan.paths.ledger)
    own = exclusions.names(exclusions.from_ledger(segments, exclusions.read_cleared(plan.output_dir)))
    return tuple(quarantine.merged(site, own))


def _run_over(plan) -> str | None:  # type: ignore[no-untyped-def]
    """Why the run is over, as its extra jobs' nodes judge it (None: it is not, or Slurm cannot say)."""
    from beam_hpc.elastic.extra_node import RunEndWatch

    return RunEndWatch(plan).over()


def _engines_refused(plan) -> str | None:  # type: ignore[no-untyped-def]
    """Why the run's next segments could not use an extra job's SGLang engines (a Miles run: Miles
    starts none it did not launch, see beam_hpc.backends.miles.external_engines), or None."""
    if plan.recipe.backend != "miles":
        return None
    from beam_hpc.backends.miles import external_engines

    return external_engines.refusal(plan)


def cmd_add(args: argparse.Namespace) -> int:
    from beam_hpc.submission import rollout_job
    from beam_hpc.submission.submit import build_site

    plan = _run(args.run_dir)
    if args.replaces is not None:
        from beam_hpc.elastic import ray_replacement

        refused = ray_replacement.request_problems(plan, args.replaces, nodes=args.nodes)
        if refused:
            raise InputError("\n".join(refused))
    else:
        engines_refused = _engines_refused(plan)
        if engines_refused is not None:  # before Slurm is asked anything, before anything is written
            raise InputError(engines_refused)
    over = _run_over(plan)
    if over is not None:
        raise InputError(f"RUN: {shorten(args.run_dir)}: the run is over ({over}); an extra job would leave "
                         "as it starts; resubmit the run (beam-hpc submit ... --resume) first, then add capacity")
    site = build_site(args.site) if args.site else plan.site
    req, problems = rollout_job.make_request(plan, site, nodes=args.nodes, partition=args.partition, time=args.time,
                                           exclude=tuple(dict.fromkeys([*_excluded(plan, site), *args.exclude])),
                                           replaces=args.replaces)
    if req is None:
        raise InputError("\n".join(problems))
    problems = rollout_job.problems(req)
    if problems:
        raise InputError("\n".join(problems))
    if args.dry_run:
        print(rollout_job.render(req), end="")
        script = rollout_job.registry.script_path(req.run_dir, "<time>")
        print(f"would run: {shlex.join(['sbatch', *rollout_job.sbatch_args(req, script)])}")
        print("dry run: nothing written, nothing submitted")
        return 0
    from beam_hpc.slurm import client

    try:
        job_id, script = rollout_job.submit(req)
    except client.SlurmUnavailable:
        raise
    except client.SlurmError as err:
        raise RuntimeFailure(f"sbatch refused the extra rollout job: {err.detail}") from None
    print(f"submitted extra rollout job {job_id}: {req.nodes} node(s) in {req.partition or 'the default partition'} "
          f"for run {plan.run_id}; script {script}")
    print(f"it joins the run's next rollout once it starts; watch it: beam-hpc rollout list {plan.output_dir}")
    return 0


def _fmt(values: list[int]) -> str:
    if not values:
        return "-"
    return f"{values[0]}-{values[-1]} ({len(values)})" if len(values) > 3 else ",".join(map(str, values))


def cmd_list(args: argparse.Namespace) -> int:
    from beam_hpc.elastic import registry

    plan = _run(args.run_dir)
    jobs = registry.extra_jobs(plan.output_dir)
    if not jobs:
        print(f"no extra rollout job for this run; add one: beam-hpc rollout add {plan.output_dir} --nodes N")
        return 0
    now = time.time()
    for j in jobs:
        state = j.state + (f" ({j.reason})" if j.reason else "")
        print(f"job {j.job_id}: {j.nodes} node(s) in {j.partition or '(default)'}, {state}; {j.units_served} units, "
              f"{j.samples} samples; rollouts {_fmt(j.rollouts)}; versions {_fmt(j.versions)}; "
              f"{j.node_seconds(now=now) / 3600:.2f} node-hours")
    return 0


def cmd_remove(args: argparse.Namespace) -> int:
    from beam_hpc.elastic import registry
    from beam_hpc.slurm import client

    plan = _run(args.run_dir)
    jobs = {j.job_id: j for j in registry.extra_jobs(plan.output_dir)}
    unknown = [j for j in args.job_ids if j not in jobs]
    if unknown:
        raise InputError(f"JOBID: {shorten(', '.join(unknown))} is not an extra rollout job of this run "
                         f"(its jobs: {', '.join(jobs) or 'none'}; see beam-hpc rollout list)")
    chosen = [jobs[j] for j in args.job_ids] if args.job_ids else list(jobs.values())
    acted = 0
    for j in chosen:
        # Slurm's word, not the record's: a preempted job has left but comes back after its requeue
        state = client.job_state(j.job_id)
        if state is None or state.terminal:
            if args.job_ids:
                print(f"job {j.job_id}: Slurm no longer runs it ({state.value if state else 'unknown to Slurm'})")
            continue
        acted += 1
        if state is client.JobState.RUNNING:
            client.cancel([j.job_id], signal="USR2")  # to the tasks: each node drains, deregisters, leaves
            print(f"job {j.job_id}: asked its nodes to leave (they finish deregistering, then the job ends)")
        else:
            client.cancel([j.job_id])
            registry.record(plan.output_dir, j.job_id, {"event": "left", "reason": registry.LeftReason.REMOVED,
                                                        "state": state.value})
            print(f"job {j.job_id}: cancelled ({state.value})")
    if not acted and not args.job_ids:
        print("no extra rollout job is pending or running")
    return 0
