"""Preflight checks (`beam-hpc doctor`): is this cluster fit for a run, before an allocation is spent?

What this module owns: the login-node checks, and assembling the whole report. On the login node
(:func:`login_checks`): Slurm's commands and controller, the site's partitions, GRES and
constraints, the TmpDisk the trainer partition declares against the ``--tmp`` a run would ask (the
same decision as ``submit``), the account, the container runtime and image, the jobs' Python and the
shared paths; with ``--recipe``, the image's own Miles parses that recipe's driver command (the
job's pre-Ray check). The node half (``--in-job``) is :mod:`beam_hpc.node.checks`, started through
the Slurm client's one-task-per-node ``srun`` (:func:`in_job_checks`) with a canary written here.
Each check carries the fix for its failure. Nothing here prints for people: the CLI renders the
checks and turns any failure into a non-zero exit.
"""

from __future__ import annotations

import getpass
import os
import secrets
import shutil
import subprocess
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING

from beam_hpc.config.site import TMP_NONE, Site
from beam_hpc.config.slurm_size import gib_text
from beam_hpc.node import container, nvme
from beam_hpc.node.checks import SHARED_FS, Check, command, existing_parent, fs_type, node_checks, parse_answers
from beam_hpc.plan import local_disk
from beam_hpc.plan.local_disk import TmpDisk
from beam_hpc.slurm import client as slurm_client
from beam_hpc.slurm.client import gres_counts
from beam_hpc.slurm.environment import SlurmEnvironment
from beam_hpc.submission import tmp_disk

if TYPE_CHECKING:
    from beam_hpc.config.recipe import Recipe

SLURM_COMMANDS = ("sbatch", "srun", "scontrol", "sinfo", "squeue")


def failed(checks: list[Check]) -> bool:
    return any(c.status == "fail" for c in checks)


def format_checks(checks: list[Check]) -> str:
    """The pass/fail table, then one "fix:" line under every failure and warning."""
    from beam_hpc.progress import text_table

    rows = [[c.status.upper(), c.where, c.name, c.detail] for c in checks]
    lines = [text_table(["result", "where", "check", "detail"], rows)]
    todo = [c for c in checks if c.status in ("fail", "warn") and c.fix]
    if todo:
        lines.append("")
        lines += [f"{c.status.upper()} {c.name} ({c.where}): fix: {c.fix}" for c in todo]
    n_fail = sum(c.status == "fail" for c in checks)
    lines.append("")
    lines.append(f"{n_fail} check(s) failed" if n_fail else "all checks passed")
    return "\n".join(lines)


# -- commands that are not Slurm's (the batch Python) ------------------------------------------
def _run(argv: list[str], timeout: float = 20) -> subprocess.CompletedProcess:
    try:
        return subprocess.run(argv, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return subprocess.CompletedProcess(argv, 124, "", f"{argv[0]} did not answer within {timeout:.0f} s")
    except FileNotFoundError:
        return subprocess.CompletedProcess(argv, 127, "", f"{argv[0]}: not found")


def _last_line(res: subprocess.CompletedProcess) -> str:
    text = (res.stderr or res.stdout or "").strip()
    return text.splitlines()[-1] if text else f"exit status {res.returncode}"


# -- login node --------------------------------------------------------------------------------
def login_checks(site: Site, *, output_dir: str | None = None, recipe: Recipe | None = None) -> list[Check]:
    """Checks that need no allocation. ``site.python`` must already be resolved ("auto" is the
    submitting interpreter, beam_hpc.submission.submit.build_site). ``recipe``: judge the trainer
    partition's TmpDisk against that recipe's ``--tmp`` (else the site's ``tmp``)."""
    checks = _slurm_checks(site, recipe)
    checks += _account_check(site)
    checks += _container_checks(site)
    checks += wandb_key_checks(site, recipe, os.environ)
    checks.append(_python_check(site.python))  # the batch shell's interpreter, outside any container
    checks += _shared_path_checks(site, output_dir)
    from beam_hpc.node.warm_start import doctor_facts  # warm restarts: image copy, JIT caches

    checks += [Check(name, status, detail, fix) for name, status, detail, fix in doctor_facts(site, output_dir)]
    return checks


def _partitions(site: Site) -> list[tuple[str, str | None]]:
    """(groups label, partition or None for the cluster default), each partition once."""
    out: dict[str | None, list[str]] = {}
    for group in ("trainer", "rollout"):
        out.setdefault(site.partitions.for_group(group), []).append(group)
    return [("+".join(groups), part) for part, groups in out.items()]


def _slurm_checks(site: Site, recipe: Recipe | None) -> list[Check]:
    missing = [c for c in SLURM_COMMANDS if shutil.which(c) is None]
    if missing:
        return [Check("slurm commands", "fail", f"not on PATH: {', '.join(missing)}",
                      "load Slurm's module or add its bin directory to PATH (on a login node of the cluster)")]
    checks = [Check("slurm commands", "pass", ", ".join(SLURM_COMMANDS) + " found")]
    try:
        ping = slurm_client.ping()
    except slurm_client.SlurmUnavailable as err:
        checks.append(Check("slurm controller", "fail", f"scontrol ping: {slurm_client.describe_controller(err)}",
                            "retry `beam-hpc doctor` once `scontrol ping` says UP (slurmctld restarting, failing "
                            "over or down?); check SLURM_CONF if it never does"))
        return checks
    checks.append(Check("slurm controller", "pass", ping))
    names = slurm_client.partition_names()
    for groups, part in _partitions(site):
        checks += _partition_checks(site, groups, part, names)
    if site.replacement_partition is not None:
        checks.append(_replacement_check(site.replacement_partition, names))
    trainer = site.partitions.for_group("trainer")
    if not any(c.name == f"partition {trainer}" and c.status == "fail" for c in checks):
        checks.append(tmp_disk_check(site, recipe))
    return checks


def tmp_disk_check(site: Site, recipe: Recipe | None = None) -> Check:
    """What the trainer partition's nodes declare as TmpDisk, judged as ``submit`` judges it
    (beam_hpc.plan.local_disk): the same answer, the same reason, before anything is submitted."""
    part = site.partitions.for_group("trainer")
    label = f"tmp disk {part or '(default)'}"
    if site.tmp == TMP_NONE:
        return Check(label, "skip", f"the site's tmp: {TMP_NONE}: runs ask Slurm for no node-local disk; "
                     "the job's NVMe check guards it")
    if recipe is not None and not tmp_disk.staging_partitions(recipe, site):
        return Check(label, "skip", f"recipe {recipe.name} keeps no optimizer state on node-local disk "
                     f"(training.offload.target: {recipe.training.offload.target})")
    try:
        answer = tmp_disk.ask(part)
    except slurm_client.SlurmUnavailable as err:
        return Check(label, "warn", f"sinfo could not say what TmpDisk the nodes declare ({err.last_line})",
                     "submit then keeps the recipe's --tmp and sbatch judges it; check `sinfo -N -o '%N %d'`")
    if answer is None:
        return Check(label, "skip", f"Slurm lists no node of {part or 'a default partition'}")
    return tmp_disk_verdict(site, recipe, answer)


def tmp_disk_verdict(site: Site, recipe: Recipe | None, answer: TmpDisk) -> Check:
    """:func:`tmp_disk_check` once Slurm has answered (pure: the answer is data)."""
    label = f"tmp disk {answer.partition}"
    sizes: dict[int, int] = {}
    for mb in answer.node_mb:
        sizes[mb] = sizes.get(mb, 0) + 1
    declared = "TmpDisk " + ", ".join(f"{gib_text(mb)} on {n} node(s)" for mb, n in sorted(sizes.items(), reverse=True))
    if max(answer.node_mb, default=0) == 0:
        return Check(label, "warn", f"the {len(answer.node_mb)} node(s) of {answer.partition} declare no TmpDisk "
                     "(0: not set in slurm.conf): submit leaves --tmp out, since Slurm could place it on no node; "
                     "the job's NVMe check still refuses a node without room",
                     "ask the admins to declare TmpDisk for the nodes (slurm.conf) so that Slurm keeps trainer work "
                     f"off small disks; or set tmp: {TMP_NONE} in the site")
    off = recipe.training.offload if recipe is not None else None
    try:
        decision = local_disk.decide(
            "trainer", recipe.topology.trainer.nodes if recipe is not None else 1, site.partitions.for_group("trainer"),
            site_tmp=site.tmp, min_free_gb=off.min_free_gb if off else 0.0,
            nvme_dir=off.nvme_dir if off else (site.scratch or "the recipe's nvme_dir"),
            declared={site.partitions.for_group("trainer"): answer})
    except local_disk.TmpDiskTooSmall as err:
        return Check(label, "fail", f"{declared}; {err.problem}", err.fix)
    if decision.request is None:
        return Check(label, "pass", f"{declared}; pass --recipe to judge a recipe's --tmp against it")
    return Check(label, "pass", f"{declared}; --tmp={decision.request} {decision.why}")


def _partition_checks(site: Site, groups: str, part: str | None, known: list[str]) -> list[Check]:
    label = f"partition {part or '(default)'}"
    if part is None:
        return [Check(label, "warn", f"{groups}: no partition in the site; Slurm's default partition is used",
                      f"set partitions.{groups.split('+')[0]} in the site to pin it")]
    fields = slurm_client.show_partition(part)
    if fields is None:
        return [Check(label, "fail", f"{groups}: partition {part!r} does not exist",
                      f"set partitions.{groups.split('+')[0]} in the site to one of: {', '.join(known) or '(none)'}")]
    if fields.get("State") != "UP":
        return [Check(label, "fail", f"{groups}: partition {part} is {fields.get('State')}",
                      "pick a partition that is UP (`sinfo -s`) or wait for the admins to bring it up")]
    checks = [Check(label, "pass", f"{groups}: UP, nodes {fields.get('Nodes', '?')}")]
    if site.gpus_per_node > 0:
        checks.append(_gres_check(site, part))
    for group in groups.split("+"):
        constraint = site.constraints.for_group(group)
        if constraint:
            checks.append(_constraint_check(part, group, constraint))
    return checks


def _replacement_check(part: str, known: list[str]) -> Check:
    """The site's ``replacement_partition`` is asked only when a rollout node is lost, mid-run,
    where a misspelt one falls back to the rollout group's own partition (beam_hpc.elastic.replace):
    doctor says so before any run depends on it."""
    label = f"replacement partition {part}"
    fields = slurm_client.show_partition(part)
    if fields is None:
        return Check(label, "fail", f"partition {part!r} does not exist: a lost rollout node's replacement would "
                     "go to the rollout group's own partition", "set replacement_partition in the site to one of: "
                     f"{', '.join(known) or '(none)'}, or leave it out")
    if fields.get("State") != "UP":
        return Check(label, "warn", f"partition {part} is {fields.get('State')}: a replacement asked now would go "
                     "to the rollout group's own partition", "pick a partition that is UP (`sinfo -s`)")
    return Check(label, "pass", f"UP, nodes {fields.get('Nodes', '?')}: a lost rollout node is replaced there first")


def _gres_check(site: Site, part: str) -> Check:
    gres = slurm_client.partition_gres(part)
    counts = gres_counts(gres, site.gres)
    label = f"gres {site.gres} on {part}"
    if not counts or max(counts) < site.gpus_per_node:
        seen = ", ".join(sorted(set(gres.split()))) or "none"
        return Check(label, "fail", f"site wants {site.gres}:{site.gpus_per_node} per node; partition has {seen}",
                     f"set gres and gpus_per_node in the site to what `sinfo -p {part} -o %G` shows")
    return Check(label, "pass", f"{site.gres}:{max(counts)} per node (site uses {site.gpus_per_node})")


def _constraint_check(part: str, group: str, constraint: str) -> Check:
    features = slurm_client.partition_features(part)
    wanted = {w.strip("[]() ").split("*")[0] for w in constraint.replace("|", "&").split("&")}
    missing = sorted(w for w in wanted if w and w not in features)
    label = f"constraint {group}"
    if missing:
        return Check(label, "fail", f"{constraint!r}: no node of {part} has feature(s) {', '.join(missing)}",
                     f"set constraints.{group} to features of {part}: {', '.join(sorted(features)) or '(none)'}")
    return Check(label, "pass", f"{constraint!r} satisfiable in {part}")


def _account_check(site: Site) -> list[Check]:
    if not site.account:
        return [Check("account", "skip", "no account in the site: Slurm charges your default account")]
    user = getpass.getuser()
    try:
        ok = slurm_client.has_association(user, site.account)
    except slurm_client.SlurmUnavailable as err:
        return [Check("account", "skip", f"{site.account!r} not verified: sacctmgr could not answer ({err.last_line})")]
    if not ok:
        return [Check("account", "fail", f"user {user} has no association with account {site.account!r}",
                      f"set account in the site to one of `sacctmgr show associations user={user} format=Account`")]
    return [Check("account", "pass", f"{user} may charge {site.account!r}")]


def _container_checks(site: Site) -> list[Check]:
    c = site.container
    if c.runtime == "host":
        return [Check("container", "skip", "runtime host: no container")]
    if c.runtime == "pyxis":  # srun takes pyxis's options; the squashfs exists (beam_hpc.node.container)
        return container.pyxis_login_checks(site)
    exe = shutil.which("apptainer") or shutil.which("singularity")
    checks = [Check("apptainer", "pass", exe) if exe else
              Check("apptainer", "fail", "neither apptainer nor singularity is on PATH",
                    "`module load apptainer` (the site's module_loads), or set container.runtime: host")]
    image = Path(c.image or "")
    if not image.is_file():
        checks.append(Check("image", "fail", f"{image} does not exist",
                            f"build it: beam-hpc image build --output {image}, or fix container.image"))
    elif not os.access(image, os.R_OK) or image.stat().st_size == 0:
        checks.append(Check("image", "fail", f"{image} is empty or not readable by {getpass.getuser()}",
                            f"chmod a+r {image}, or rebuild it with beam-hpc image build"))
    else:
        checks.append(Check("image", "pass", f"{image} ({image.stat().st_size / 1e9:.1f} GB)"))
    return checks


def wandb_key_checks(site: Site, recipe: Recipe | None, environ: Mapping[str, str]) -> list[Check]:
    """Where the jobs' W&B key comes from inside their container. wandb reads WANDB_API_KEY, else
    the netrc (NETRC, default ~/.netrc). pyxis without ``container.mount_home`` starts each container
    with --no-container-mount-home, and then a ~/.netrc of the login node is not there: the key must
    come through the environment (pyxis passes the job's variables in; an image that sets the name
    would win unless it is listed in --container-env) or a netrc on a path the container mounts.
    With ``--recipe``, only a recipe that logs to W&B online is checked, and a hidden key fails;
    without one, a hidden netrc is a warning and no key at all says nothing."""
    from beam_hpc.run import tracking

    if recipe is not None:
        settings = tracking.settings_for(recipe, site)
        if settings is None or settings.mode != "online":
            return []
    if environ.get("WANDB_API_KEY"):
        how = " (pyxis passes the job's variables into the container)" if site.container.runtime == "pyxis" else ""
        return [Check("wandb-key", "pass", f"WANDB_API_KEY is set: the jobs get it from the environment{how}")]
    home = environ.get("HOME") or str(Path.home())
    netrc = environ.get("NETRC") or str(Path(home) / ".netrc")
    if not tracking.has_api_key(environ):
        return [] if recipe is None else [Check(
            "wandb-key", "fail", f"no W&B key: WANDB_API_KEY is not set and {netrc} has no entry for W&B",
            "export WANDB_API_KEY before submitting, or run `wandb login`")]
    hidden = site.container.runtime == "pyxis" and not site.container.mount_home and not any(
        container.inside(netrc, m) for m in container.pyxis_mounts(site, []))
    if not hidden:
        return [Check("wandb-key", "pass", f"the W&B key is in {netrc}, which the jobs' containers see")]
    return [Check("wandb-key", "fail" if recipe is not None else "warn",
                  f"the W&B key is only in {netrc}: pyxis starts the containers with --no-container-mount-home "
                  "(container.mount_home: false), so wandb inside them finds no key",
                  "export WANDB_API_KEY before submitting (the job's environment reaches the container), or put "
                  "the netrc on a path the containers mount and export NETRC=that path, or set "
                  "container.mount_home: true")]


def _python_check(python: str) -> Check:
    res = _run([python, "-c", "import beam_hpc"], timeout=60)
    if res.returncode != 0:
        return Check("python", "fail", f"{python}: cannot import beam_hpc ({_last_line(res)})",
                     "set python in the site to the interpreter of the venv where beam-hpc is installed")
    return Check("python", "pass", f"{python} imports beam_hpc")


def _shared_path_checks(site: Site, output_dir: str | None) -> list[Check]:
    paths = list(site.shared_paths) + ([output_dir] if output_dir else [])
    if not paths:
        return [Check("shared paths", "skip", "the site lists no shared_paths and no --output-dir was given")]
    checks = []
    for raw in paths:
        p = Path(raw)
        base = existing_parent(p)
        fstype, mnt = fs_type(base)
        label = f"shared {raw}"
        if raw in site.shared_paths and not p.is_dir():
            checks.append(Check(label, "fail", f"{raw} does not exist here",
                                "fix shared_paths in the site: list directories every node mounts (they are bound into the container)"))
        elif not os.access(base, os.W_OK):
            checks.append(Check(label, "fail", f"{base} is not writable by {getpass.getuser()}",
                                "pick a directory you can write on shared storage (project or scratch space)"))
        elif fstype in nvme.REFUSED_FS:
            checks.append(Check(label, "fail", f"on {fstype} ({mnt}): {nvme.REFUSED_FS[fstype]}, not shared",
                                "use a directory on the cluster's shared filesystem (NFS, Lustre, GPFS...)"))
        elif fstype in SHARED_FS:
            checks.append(Check(label, "pass", f"{fstype} at {mnt}"))
        else:
            checks.append(Check(label, "warn", f"{fstype} at {mnt} is usually node-local",
                                "fine only if every node mounts this same disk; `beam-hpc doctor --in-job` "
                                "proves it with a canary"))
    return checks


# -- through srun ------------------------------------------------------------------------------
def in_job_checks(site: Site, *, nodes: int = 1, canary_root: str | Path | None = None,
                  scratch_gb: float | None = None, wait_s: int = 300,
                  skip_partitions: frozenset[str] = frozenset()) -> list[Check]:
    """Run :func:`node_checks` on ``nodes`` nodes of each of the site's partitions through srun
    (or on the nodes of the allocation this runs in), with a canary in ``canary_root``."""
    slurm = SlurmEnvironment.current()
    inside = slurm.in_job
    if inside and slurm.step_id:  # already one task per node: just this node
        return node_checks(site, scratch_gb=scratch_gb)
    root = Path(canary_root) if canary_root else Path.cwd()
    token = secrets.token_hex(8)
    canary = root / f".beam-doctor-{token}"
    try:
        canary.mkdir(parents=True)
        (canary / "login.token").write_text(token + "\n")
    except OSError as err:
        return [Check("shared-fs canary", "fail", f"cannot write the canary in {root} ({err})",
                      "give --output-dir a writable directory on shared storage")]
    checks: list[Check] = []
    try:
        targets = [("allocation", None)] if inside else _partitions(site)
        for _groups, part in targets:
            if part in skip_partitions:
                checks.append(Check(f"nodes of {part}", "skip", "its partition check failed"))
                continue
            checks += _srun_node_checks(site, part, inside, nodes, canary, token, scratch_gb, wait_s)
    finally:
        shutil.rmtree(canary, ignore_errors=True)
    return checks


def miles_parser_check(site: Site, recipe: Recipe) -> Check:
    """The image's own Miles parses the recipe's driver command (backends.miles.preflight): the
    same check the job makes on the head node before Ray starts, made here through the image."""
    from beam_hpc.backends.miles import preflight
    from beam_hpc.errors import InputError

    name = f"miles parser ({recipe.name})"
    if recipe.backend != "miles":
        return Check(name, "skip", f"backend {recipe.backend}: no Miles command")
    if site.container.runtime == "pyxis":
        return Check(name, "skip", "pyxis starts the image only in a job: the job runs this check on its head node")
    try:
        verdict = preflight.check_recipe(recipe, site)
    except InputError as err:  # the recipe itself is refused (architecture flags, layout)
        return Check(name, "fail", str(err), "fix the recipe field it names")
    if verdict.ok:
        note = verdict.model_script_note()  # which form of model script the image read, if any
        return Check(name, "pass", f"the image's Miles accepts the driver command ({verdict.seconds:.1f} s)"
                     + (f"; {note}" if note else ""))
    refusal = verdict.refusal() or verdict.error
    first, _, rest = refusal.partition("\n")
    return Check(name, "fail", first, rest.strip().replace("\n", "; ") or "use an image whose Miles accepts it")


def run_doctor(site: Site, *, in_job: bool = False, nodes: int = 1, output_dir: str | None = None,
               scratch_gb: float | None = None, wait_s: int = 300, recipe: Recipe | None = None) -> list[Check]:
    """All of `beam-hpc doctor`: the login checks, then (``in_job``) the node checks of every
    partition whose login check passed, the canary living in ``output_dir`` (else the cwd).
    With ``recipe``, also the image's Miles parsing that recipe's driver command."""
    checks = login_checks(site, output_dir=output_dir, recipe=recipe)
    if recipe is not None:
        checks.append(miles_parser_check(site, recipe))
    if not in_job:
        return checks
    bad = frozenset(c.name.split(" ", 1)[1] for c in checks if c.name.startswith("partition ") and c.status == "fail")
    if any(c.name in ("slurm commands", "slurm controller") and c.status == "fail" for c in checks):
        return checks + [Check("nodes", "skip", "Slurm is not usable from here (see above)")]
    node = in_job_checks(site, nodes=nodes, canary_root=output_dir, scratch_gb=scratch_gb,
                         wait_s=wait_s, skip_partitions=bad)
    canaries = [c for c in node if c.name == "shared-fs canary"]
    if output_dir and canaries and all(c.status == "pass" for c in canaries):
        # the warning "usually node-local" is settled: every node read what the login node wrote
        checks = [Check(c.name, "pass", c.detail + "; the canary proved it shared", where=c.where)
                  if c.name == f"shared {output_dir}" and c.status == "warn" else c for c in checks]
    return checks + sorted(node, key=lambda c: c.where == "login")


def _srun_node_checks(site: Site, part: str | None, inside: bool, nodes: int, canary: Path,
                      token: str, scratch_gb: float | None, wait_s: int) -> list[Check]:
    expected = SlurmEnvironment.current().job_num_nodes if inside else nodes
    where = slurm_client.NodeRequest(
        nodes=expected, inside=inside, partition=part, account=site.account, qos=site.qos,
        gres=f"{site.gres}:{site.gpus_per_node}" if site.gpus_per_node else None, immediate_s=wait_s)
    label = f"nodes of {part or 'the allocation'}"
    try:
        res = slurm_client.srun_each_node(command(site, canary=canary, token=token, scratch_gb=scratch_gb),
                                          where, job_name="beam-doctor", timeout=wait_s + 120)
    except slurm_client.SlurmUnavailable as err:
        if err.timed_out:
            return [Check(label, "fail", f"srun did not finish within {wait_s + 120} s",
                          "the partition is busy or nodes hang; retry later or raise --wait")]
        return [Check(label, "fail", err.last_line, "load Slurm's module or add its bin directory to PATH")]
    checks = parse_answers(res.stdout)
    reported = {c.where for c in checks}
    if res.returncode == 0 and 0 < len(reported) < expected:
        checks.append(Check(label, "fail", f"only {len(reported)} of {expected} nodes answered: {', '.join(sorted(reported))}",
                            "look at the silent nodes' slurmd logs; they may be misconfigured or down"))
        return checks
    if res.returncode != 0 or not reported:
        checks.append(Check(label, "fail", f"srun exited {res.returncode}: {_last_line(res)}",
                            "see the partition, gres and account checks above; `srun` must be able to "
                            "start one task per node there"))
        return checks
    for c in list(checks):  # the other direction of the canary: the node's write, seen here
        if c.name == "shared-fs canary" and c.status == "pass":
            acks = list(canary.glob(f"ack-{c.where}-*"))
            if not acks:
                checks[checks.index(c)] = Check(c.name, "fail", f"{c.where} wrote its ack but the login node cannot see it",
                                                "use a path that every node and the login node mount", c.where)
    checks.append(Check(label, "pass", f"{len(reported)} node(s) answered: {', '.join(sorted(reported))}"))
    return checks
