"""A real multi-node Slurm 22.05 cluster on this one host, for tests and developers.

Why it exists: beam-hpc's job logic (heterogeneous jobs, `srun --het-group`, requeue, preemption,
signals) must run against real Slurm daemons, not a mock. Debian's slurm-wlm package runs one
slurmctld plus one slurmd per fake node (`slurmd -N nK`, one port each) on a single machine; each
slurmd lives in its own UTS namespace so that `hostname` inside a job prints the node name. Fake
GPUs are character devices (same major/minor as /dev/null) because gres/gpu drops file-less or
regular-file GPUs.

Daemons are stopped by the PIDs in their pidfiles, never by name, and every job on the cluster is
cancelled first. Several pytest sessions may share one cluster: each session holds a lease file in
`LAB/leases/`, and the cluster is stopped only when the last lease goes and it was started by tests
(a cluster that a developer brought up with `up` is left running).

CLI for developers (root): `.venv/bin/python tests/support/cluster/slurm_cluster.py up|down|status|plugin [--lab DIR]`
(``plugin``: build the pyxis stand-in SPANK plugin, standins/spank/pyxis_standin.c, as `up` does).
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import os
import shutil
import signal
import socket
import stat
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "builders" / "waiting"))  # run as a program: polling
from polling import poll_until  # noqa: E402

from beam_hpc.files import write_atomic
from beam_hpc.node import procs
from beam_hpc.slurm.client import JobState, parse_key_values, parse_show_job_records, slurm_time

DEFAULT_LAB = Path(os.environ.get("BEAM_SLURM_LAB", "/tmp/beam-slurm"))
# slurmctld's port; the nodes' slurmd ports (17001, 17002, ...) move by the same amount. Set
# another value (and another LAB) to run a second cluster beside the default one.
DEFAULT_CTLD_PORT = int(os.environ.get("BEAM_SLURM_CTLD_PORT", "6817"))
REQUIRED_BINARIES = ("munged", "munge", "unmunge", "slurmctld", "slurmd", "sbatch", "srun",
                     "squeue", "scontrol", "scancel", "sinfo", "unshare", "runuser")
_MUNGE_PIDFILE = Path("/run/munge/munged.pid")
_ETC_SLURM = Path("/etc/slurm")
# The pyxis stand-in (a SPANK plugin: pyxis's srun options, enroot's private /tmp and named containers as
# mount namespaces, the image's environment; recorded per task), built
# from its C source against libslurm-dev's spank.h into LAB/lib and loaded through plugstack.conf.
PYXIS_STANDIN_SRC = Path(__file__).resolve().parents[1] / "standins" / "spank" / "pyxis_standin.c"


class SlurmClusterError(RuntimeError):
    """The local cluster could not be brought up or down; the message says what to look at."""


def _first_nodes(count: int) -> str:
    """Nodes n1..n<count> as a Slurm host range."""
    return f"n[1-{count}]" if count > 1 else "n1"


@dataclass(frozen=True)
class ClusterSpec:
    """Shape of the local cluster. The defaults are what the test suite needs; keep LAB short
    because Slurm and Ray put unix sockets under it (path limit 107 bytes)."""

    lab: Path = DEFAULT_LAB
    nodes: int = 12
    cpus_per_node: int = 2
    gpus_per_node: int = 8
    real_memory_mb: int = 4000
    # Node-local disk as Slurm sees it (TmpDisk, MB): the last ``small_disk_nodes`` nodes have too
    # little for the seed's 2 TB of optimizer state, so tests can show that --tmp keeps trainer
    # work off them (declared only: SlurmdParameters=config_overrides trusts the numbers).
    tmp_disk_mb: int = 3_000_000
    small_disk_nodes: int = 2
    small_tmp_disk_mb: int = 100_000
    # Nodes n<nodes+1>..n<nodes+spot_nodes> form the ``spot`` partition and no other but ``urgent``:
    # the only place a test sends work it will preempt, so an urgent job aimed at one job's nodes
    # preempts that job alone, never a job of another test (pytest-xdist), not even one that got
    # the nodes between the victim's end and the urgent job's start. ``debug`` keeps its own nodes
    # (the seed scripts' --test-only needs all twelve). The tests' jobs in spot take whole nodes
    # (env/local.yaml's cpus_per_node is the nodes' 2 CPUs). (Not OverSubscribe=EXCLUSIVE: that
    # hands a job every GPU of its nodes, which a segment refuses when its plan asked for fewer.)
    spot_nodes: int = 4
    ctld_port: int = DEFAULT_CTLD_PORT
    cluster_name: str = "beamlab"
    # Point /etc/slurm at this cluster when nothing else does (a client run without SLURM_CONF
    # finds it). False for a private second cluster, whose clients always get SLURM_CONF.
    link_etc: bool = True
    # The first job id (slurm.conf FirstJobId): a second cluster's ids far from the first's, since
    # some per-job names on this host (Ray temp dirs) carry the job id alone. BEAM_SLURM_FIRST_JOB_ID
    # sets it for a second cluster started by the tests' fixture (with BEAM_SLURM_LAB and _CTLD_PORT).
    first_job_id: int = int(os.environ.get("BEAM_SLURM_FIRST_JOB_ID", "1"))

    @property
    def first_slurmd_port(self) -> int:
        return 17001 + self.ctld_port - 6817

    @property
    def node_names(self) -> list[str]:
        return [f"n{i}" for i in range(1, self.nodes + 1)]

    @property
    def node_range(self) -> str:
        """``debug``'s nodes as a Slurm host range."""
        return _first_nodes(self.nodes)

    @property
    def spot_names(self) -> list[str]:
        return [f"n{i}" for i in range(self.nodes + 1, self.nodes + self.spot_nodes + 1)]

    @property
    def every_name(self) -> list[str]:
        """Every node's name: ``debug``'s (node_names), then ``spot``'s."""
        return self.node_names + self.spot_names

    @property
    def every_range(self) -> str:
        """Every node (``debug``'s, then ``spot``'s) as a Slurm host range."""
        return _first_nodes(len(self.every_name))


@dataclass
class LocalSlurmCluster:
    """Brings the cluster of `spec` up and down and answers questions about its jobs.

    `env` is what a Slurm client needs (SLURM_CONF); `partitions` lists `debug` (default,
    PriorityTier 1, GraceTime 20), `spot` (its own nodes, otherwise as `debug`: where preemption
    tests put their victims) and `urgent` (every node, PriorityTier 10, preempts both with requeue).
    """

    spec: ClusterSpec = field(default_factory=ClusterSpec)

    # -- layout -------------------------------------------------------------------------------
    @property
    def lab(self) -> Path:
        return self.spec.lab

    @property
    def conf(self) -> Path:
        return self.lab / "etc" / "slurm.conf"

    @property
    def env(self) -> dict[str, str]:
        return {"SLURM_CONF": str(self.conf)}

    @property
    def nodes(self) -> list[str]:
        return self.spec.every_name

    @property
    def partitions(self) -> list[str]:
        return ["debug", "spot", "urgent"]

    def _pidfile(self, daemon: str) -> Path:
        return self.lab / "run" / f"{daemon}.pid"

    def slurmd_pid(self, node: str) -> int | None:
        """The PID of ``node``'s slurmd, while it runs (for a test that takes a node away as a dead
        node goes: its slurmd gone, no goodbye to slurmctld)."""
        return _live_pid(self._pidfile(f"slurmd_{node}"), "slurmd")

    # -- prerequisites ------------------------------------------------------------------------
    @staticmethod
    def missing_prerequisites() -> list[str]:
        """Reasons this machine cannot run the cluster (empty when it can)."""
        reasons = []
        if os.geteuid() != 0:
            reasons.append("not root (slurmd, munged and UTS namespaces need root)")
        missing = [b for b in REQUIRED_BINARIES if shutil.which(b) is None
                   and not Path("/usr/sbin", b).exists()]
        if missing:
            reasons.append("missing binaries: " + ", ".join(missing)
                           + " (apt-get install munge slurmctld slurmd slurm-client)")
        return reasons

    # -- client helpers -----------------------------------------------------------------------
    def client_env(self) -> dict[str, str]:
        """os.environ plus SLURM_CONF, and without SLURM_* job variables of an enclosing job."""
        env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
        env.update(self.env)
        return env

    def run(self, *argv: str, check: bool = True,
            timeout: float = 30) -> subprocess.CompletedProcess:
        """Run a Slurm client command against this cluster and capture its output."""
        return subprocess.run(list(argv), env=self.client_env(), capture_output=True, text=True,
                              check=check, timeout=timeout)

    def controller_up(self) -> bool:
        if not self.conf.exists() or shutil.which("scontrol") is None:
            return False
        try:
            out = self.run("scontrol", "ping", check=False, timeout=15).stdout
        except subprocess.TimeoutExpired:
            return False
        return "UP" in out

    def _controller_state_dir(self) -> str | None:
        """StateSaveLocation of the controller that answers on our port (tells clusters apart)."""
        out = self.run("scontrol", "show", "config", check=False).stdout
        for line in out.splitlines():
            key, _, value = line.partition("=")
            if key.strip() == "StateSaveLocation":
                return value.strip()
        return None

    def _controller_is_ours(self) -> bool:
        return self._controller_state_dir() == str(self.lab / "state" / "ctld")

    def cancel_jobs_under(self, *roots: Path) -> list[str]:
        """Cancel every job whose output file or working directory lies under one of ``roots``;
        returns their ids. What a test calls on its way out, passed or failed: a chain it left
        behind (one that resubmits itself toward a total of 100,000, say) would otherwise take the
        machine's CPU from every test after it, on every xdist worker."""
        out = self.run("squeue", "--noheader", "--Format=JobID:30,STDOUT:1000,WorkDir:1000", check=False).stdout
        prefixes = tuple(str(Path(r).resolve()).rstrip("/") + "/" for r in roots)
        ids = sorted({line.split()[0].split("+")[0] for line in out.splitlines()
                      if line.split() and any((f.rstrip("/") + "/").startswith(pre)
                                              for f in line.split()[1:] for pre in prefixes)})
        if ids:
            self.run("scancel", *ids, check=False)
        return ids

    @contextlib.contextmanager
    def scratch_runs(self, prefix: str) -> Iterator[Path]:
        """A directory for a test's run directories, outside pytest's numbered temp dirs (other
        pytest sessions prune those, and a run directory must outlive every segment of its chain);
        the jobs under it are cancelled and it is removed afterwards, passed or failed: once they
        have left the queue (at most a minute), as a job's programs may still write into its run
        directory on their way out (an extra rollout job records its leaving) and would make it
        again after the removal."""
        root = Path(tempfile.mkdtemp(prefix=prefix, dir="/tmp"))
        try:
            yield root
        finally:
            ids = self.cancel_jobs_under(root)
            if ids:
                poll_until(lambda: not self.run("squeue", "--noheader", "--jobs", ",".join(ids),
                                                check=False).stdout.strip(), 60, 0.5)
            shutil.rmtree(root, ignore_errors=True)

    def _queue_empty(self) -> bool:
        return not self.run("squeue", "--noheader", check=False).stdout.strip()

    def node_states(self) -> dict[str, str]:
        out = self.run("sinfo", "--noheader", "--Node", "--format=%N %T", check=False).stdout
        states: dict[str, str] = {}
        for line in out.splitlines():
            name, _, state = line.partition(" ")
            states[name] = state.strip()
        return states

    def job_states(self, job_id: str) -> list[JobState]:
        """States of every component of job `job_id` (hetjobs have several, leader first), [] once
        purged: the Slurm client's parse of ``scontrol --oneliner show job``."""
        res = self.run("scontrol", "--oneliner", "show", "job", str(job_id), check=False)
        return [JobState(r["JobState"]) for r in parse_show_job_records(res.stdout) if "JobState" in r]

    def wait_for_job(self, job_id: str, timeout: float = 120, poll_s: float = 0.5) -> str:
        """Block until job `job_id` (all components) is finished; return the leader's state
        ("PURGED" once Slurm forgot it). Raises TimeoutError naming the last seen states, so a
        stuck test says why."""
        states: list[JobState] = []

        def finished() -> str | None:
            states[:] = self.job_states(job_id)
            if not states:
                return "PURGED"
            return states[0].value if all(s.terminal for s in states) else None

        state = poll_until(finished, timeout, poll_s)
        if state is None:
            raise TimeoutError(f"job {job_id} not finished after {timeout:.0f} s (states {[s.value for s in states]})")
        return state

    def end_soon(self, job_id: str, *, left_s: float = 45) -> tuple[int, float]:
        """Lower running job ``job_id``'s time limit so that it ends more than ``left_s`` and at most
        ``left_s`` + 60 s from now (``scontrol update TimeLimit``, as a user or an admin does; Slurm
        counts limits in whole minutes). A job whose walltime lead is longer than that is then inside
        it: Slurm sends its ``--signal`` at its next time check (every 30 s here) and the job's own
        deadline (EndTime - lead) has passed. The walltime tests and benchmarks/faults.py enter the
        walltime this way instead of waiting out a limit long enough for a slow bring-up. Returns
        the new limit (minutes) and the job's new end (epoch seconds)."""
        shown = self.run("scontrol", "--oneliner", "show", "job", str(job_id)).stdout.splitlines()[0]
        start = slurm_time(parse_key_values(shown).get("StartTime"))
        if start is None:
            raise SlurmClusterError(f"job {job_id} has no start time yet: {shown[:200]}")
        minutes = int((time.time() + left_s - start) // 60) + 1
        self.run("scontrol", "update", f"JobId={job_id}", f"TimeLimit={minutes}")
        return minutes, start + minutes * 60

    def status(self) -> str:
        """Human-readable snapshot: controller, nodes, queue."""
        if not self.controller_up():
            return f"local Slurm cluster in {self.lab}: controller down"
        parts = [self.run("scontrol", "ping", check=False).stdout,
                 self.run("sinfo", "--Node", "--format=%N %P %T %G %c %m", check=False).stdout,
                 self.run("squeue", check=False).stdout]
        return "".join(parts)

    # -- configuration ------------------------------------------------------------------------
    def slurm_conf_text(self) -> str:
        s, lab, host = self.spec, self.lab, socket.gethostname().split(".")[0]
        lines = [
            f"ClusterName={s.cluster_name}",
            f"SlurmctldHost={host}(127.0.0.1)",
            "SlurmUser=root",
            "SlurmdUser=root",
            "AuthType=auth/munge",
            "CredType=cred/munge",
            # also the delay before a requeued job may start again (default 120 s)
            "AuthInfo=cred_expire=10",
            f"SlurmctldPort={s.ctld_port}",
            *([f"FirstJobId={s.first_job_id}"] if s.first_job_id != 1 else []),
            f"StateSaveLocation={lab}/state/ctld",
            f"SlurmdSpoolDir={lab}/state/slurmd_%n",
            f"SlurmctldPidFile={lab}/run/slurmctld.pid",
            f"SlurmdPidFile={lab}/run/slurmd_%n.pid",
            f"SlurmctldLogFile={lab}/log/slurmctld.log",
            f"SlurmdLogFile={lab}/log/slurmd_%n.log",
            "SlurmctldDebug=info",
            "SlurmdDebug=info",
            "MailProg=/bin/true",
            "ProctrackType=proctrack/linuxproc",
            "TaskPlugin=task/none",
            "MpiDefault=none",
            "SwitchType=switch/none",
            "SelectType=select/cons_tres",
            "SelectTypeParameters=CR_Core",
            "SchedulerType=sched/backfill",
            "SchedulerParameters=sched_interval=2,bf_interval=1,sched_min_interval=100000",
            # no slurmdbd: job states come from squeue (beam_hpc.slurm.submitit_het)
            "AccountingStorageType=accounting_storage/none",
            "JobAcctGatherType=jobacct_gather/none",
            "JobCompType=jobcomp/none",
            "GresTypes=gpu",
            "ReturnToService=2",
            "SlurmctldTimeout=10",
            "SlurmdTimeout=30",
            "MessageTimeout=10",
            "InactiveLimit=0",
            "MinJobAge=30",
            "KillWait=5",
            "WaitTime=0",
            # nodes may declare more CPUs than this small machine has
            "SlurmdParameters=config_overrides",
            "PreemptType=preempt/partition_prio",
            "PreemptMode=REQUEUE",
            # with GraceTime, preempted jobs get submitit's USR2 before SIGTERM
            "SlurmctldParameters=preempt_send_user_signal",
            f"PlugStackConfig={lab}/etc/plugstack.conf",  # the pyxis stand-in (pyxis_standin.c)
        ]
        for i, name in enumerate(s.every_name):
            tmp = s.small_tmp_disk_mb if s.nodes - s.small_disk_nodes <= i < s.nodes else s.tmp_disk_mb
            lines.append(
                f"NodeName={name} NodeHostname={host} NodeAddr=127.0.0.1 "
                f"Port={s.first_slurmd_port + i} CPUs={s.cpus_per_node} "
                f"RealMemory={s.real_memory_mb} TmpDisk={tmp} Gres=gpu:{s.gpus_per_node} State=UNKNOWN")
        lines += [
            f"PartitionName=debug Nodes={s.node_range} Default=YES MaxTime=INFINITE State=UP "
            "PriorityTier=1 GraceTime=20",
            f"PartitionName=spot Nodes={','.join(s.spot_names)} MaxTime=INFINITE State=UP "
            "PriorityTier=1 GraceTime=20",
            f"PartitionName=urgent Nodes={s.every_range} MaxTime=INFINITE State=UP PriorityTier=10",
        ]
        return "\n".join(lines) + "\n"

    def gres_conf_text(self) -> str:
        last = self.spec.gpus_per_node - 1
        files = f"{self.lab}/dev/nvidia[0-{last}]" if last > 0 else f"{self.lab}/dev/nvidia0"
        return f"AutoDetect=off\nNodeName={self.spec.every_range} Name=gpu File={files}\n"

    def _write_config(self, fresh_state: bool) -> None:
        lab = self.lab
        if fresh_state:  # job ids start again at FirstJobId: a record of an old job 29 would pass as the new one's
            shutil.rmtree(lab / "state", ignore_errors=True)
            shutil.rmtree(self.pyxis_records, ignore_errors=True)
        for d in ("etc", "state/ctld", "log", "run", "dev", "leases"):
            (lab / d).mkdir(parents=True, exist_ok=True)
        for name in self.nodes:  # slurmd refuses to start without its spool dir
            (lab / "state" / f"slurmd_{name}").mkdir(parents=True, exist_ok=True)
        for g in range(self.spec.gpus_per_node):
            dev = lab / "dev" / f"nvidia{g}"
            if not dev.is_char_device():
                dev.unlink(missing_ok=True)
                os.mknod(dev, 0o666 | stat.S_IFCHR, os.makedev(1, 3))
        write_atomic(self.conf, self.slurm_conf_text())
        write_atomic(lab / "etc" / "gres.conf", self.gres_conf_text())
        self._write_plugstack()
        # A client run without SLURM_CONF would otherwise try DNS SRV ("configless") discovery.
        if not self.spec.link_etc:
            return
        _ETC_SLURM.mkdir(exist_ok=True)
        for name in ("slurm.conf", "gres.conf"):
            link = _ETC_SLURM / name
            if link.exists() and (not link.is_symlink() or Path(os.readlink(link)).parent
                                  != lab / "etc"):
                continue  # a site's config or another live local cluster's: SLURM_CONF is ours
            tmp = link.with_name(f".{name}.beam-tmp")
            tmp.unlink(missing_ok=True)
            tmp.symlink_to(lab / "etc" / name)
            os.replace(tmp, link)

    # -- the pyxis stand-in ---------------------------------------------------------------------
    @property
    def pyxis_plugin(self) -> Path:
        return self.lab / "lib" / "pyxis_standin.so"

    @property
    def pyxis_records(self) -> Path:
        """Where the stand-in writes one ``<job>.<step>.<node>.<task>.json`` per containerised task."""
        return self.lab / "pyxis"

    def build_pyxis_plugin(self) -> Path:
        """Compile the stand-in (when its source is newer than the .so); SlurmClusterError without
        gcc or spank.h (apt-get install gcc libc6-dev libslurm-dev)."""
        out = self.pyxis_plugin
        if out.exists() and out.stat().st_mtime >= PYXIS_STANDIN_SRC.stat().st_mtime:
            return out
        out.parent.mkdir(parents=True, exist_ok=True)
        tmp = out.with_name(f".{out.name}.{os.getpid()}")
        res = subprocess.run(["gcc", "-shared", "-fPIC", "-Wall", "-Werror", "-o", str(tmp), str(PYXIS_STANDIN_SRC)],
                             capture_output=True, text=True, check=False)
        if res.returncode != 0:
            tmp.unlink(missing_ok=True)
            raise SlurmClusterError(f"cannot build the pyxis stand-in: {res.stderr.strip()[-500:]} "
                                    "(apt-get install gcc libc6-dev libslurm-dev)")
        os.replace(tmp, out)  # a step starting now loads the old or the new one, never half of one
        return out

    def _write_plugstack(self) -> None:
        """plugstack.conf: the stand-in when it builds, else nothing (a machine without a compiler
        still runs every other test; the pyxis tests then find srun without its options and say so).
        ``required``, as pyxis's own line: a task whose container cannot be set up fails instead of
        running outside it."""
        with contextlib.suppress(SlurmClusterError, OSError):
            self.build_pyxis_plugin()
        self.pyxis_records.mkdir(parents=True, exist_ok=True)
        self.pyxis_records.chmod(0o1777)
        line = (f"required {self.pyxis_plugin} record_dir={self.pyxis_records} image_files={':'.join(image_files())}\n"
                if self.pyxis_plugin.exists() else "")
        write_atomic(self.lab / "etc" / "plugstack.conf", line)

    def _remove_etc_links(self) -> None:
        for name in ("slurm.conf", "gres.conf"):
            link = _ETC_SLURM / name
            if link.is_symlink() and Path(os.readlink(link)) == self.lab / "etc" / name:
                link.unlink()

    # -- bring up -----------------------------------------------------------------------------
    def up(self, started_by_tests: bool = False, timeout: float = 60) -> bool:
        """Start whatever part of the cluster is not running; return True if slurmctld was
        started here. A running cluster with the same LAB and configuration is reused."""
        problems = self.missing_prerequisites()
        if problems:
            raise SlurmClusterError("cannot start the local Slurm cluster: " + "; ".join(problems))
        self.lab.mkdir(parents=True, exist_ok=True)
        with self._lock():
            ctld_pid = _live_pid(self._pidfile("slurmctld"), "slurmctld")
            if ctld_pid is not None and self.conf.exists():
                if self.conf.read_text() != self.slurm_conf_text():
                    raise SlurmClusterError(
                        f"a Slurm cluster with a different configuration runs in {self.lab} "
                        f"(slurmctld pid {ctld_pid}); stop it with `python tests/support/cluster/slurm_cluster.py "
                        f"down --lab {self.lab}` or use another BEAM_SLURM_LAB")
            self._write_config(fresh_state=ctld_pid is None)
            self._start_munged()
            started = False
            if ctld_pid is None:
                (self.lab / "run" / "started-by-tests").unlink(missing_ok=True)
                self._spawn(["slurmctld"], "slurmctld")
                started = True
                if started_by_tests:
                    (self.lab / "run" / "started-by-tests").write_text(f"{os.getpid()}\n")
            elif not started_by_tests:
                # a developer adopts a running test cluster: tests must no longer stop it
                (self.lab / "run" / "started-by-tests").unlink(missing_ok=True)
            _wait_until(self.controller_up, timeout, "slurmctld to answer `scontrol ping`",
                        self.lab / "log" / "slurmctld.log")
            if not self._controller_is_ours():
                raise SlurmClusterError(
                    f"port {self.spec.ctld_port} is answered by another Slurm controller (state in "
                    f"{self._controller_state_dir()}); stop that cluster or set "
                    "BEAM_SLURM_CTLD_PORT and BEAM_SLURM_LAB")
            for name in self.nodes:
                if _live_pid(self._pidfile(f"slurmd_{name}"), "slurmd") is None:
                    # Own UTS namespace: `hostname` in a job on this node prints its node name.
                    self._spawn(["unshare", "--uts", "sh", "-c",
                                 f"hostname {name} && exec slurmd -N {name}"], f"slurmd_{name}")
            _wait_until(self._nodes_ready, timeout, f"nodes {self.spec.every_range} to be ready",
                        self.lab / "log" / f"slurmd_{self.nodes[0]}.log")
            return started

    def _nodes_ready(self) -> bool:
        states = self.node_states()
        usable = ("idle", "mixed", "allocated", "completing", "planned")  # planned: held for a pending job
        return all(states.get(n, "").rstrip("*~#$@+^-!%") in usable for n in self.nodes)

    def _spawn(self, argv: Sequence[str], log_name: str) -> None:
        """Start a self-daemonizing Slurm daemon; its console output goes to LAB/log."""
        with open(self.lab / "log" / f"{log_name}.console", "ab") as console:
            res = subprocess.run(list(argv), env=self.client_env(), stdin=subprocess.DEVNULL,
                                 stdout=console, stderr=console, start_new_session=True,
                                 timeout=60)
        if res.returncode != 0:
            raise SlurmClusterError(f"`{' '.join(argv)}` exited with {res.returncode}; see "
                                    f"{self.lab}/log/{log_name}.console and {log_name}.log")

    def _start_munged(self) -> None:
        if _munge_works():
            return
        key = Path("/etc/munge/munge.key")
        if not key.exists() or key.stat().st_size == 0:
            subprocess.run(["mungekey", "--create", "--force"], check=True, capture_output=True)
            shutil.chown(key, "munge", "munge")
            key.chmod(0o400)
        subprocess.run(["install", "-d", "-o", "munge", "-g", "munge", "-m", "0755", "/run/munge"],
                       check=True)
        res = subprocess.run(["runuser", "-u", "munge", "--", "munged"], capture_output=True,
                             text=True, stdin=subprocess.DEVNULL, start_new_session=True)
        if res.returncode != 0:
            raise SlurmClusterError(f"munged failed to start: {res.stderr.strip()}")
        _wait_until(_munge_works, 10, "munged to answer `munge -n | unmunge`", None)
        pid = _MUNGE_PIDFILE.read_text().strip()
        (self.lab / "run" / "munged.ours").write_text(pid + "\n")

    # -- a controller outage (tests/lifecycle/test_controller_outage.py) -----------------------
    # Only on a cluster no other session uses: every job on the cluster loses its controller too,
    # and while slurmctld is down a session's `up` would take the cluster for stopped and start it
    # afresh on wiped state. The outage tests bring up a private cluster of their own for it.
    def controller_pid(self) -> int | None:
        """slurmctld's PID from its pidfile, when that process is alive and is slurmctld."""
        return _live_pid(self._pidfile("slurmctld"), "slurmctld")

    def stop_controller(self, timeout: float = 15) -> None:
        """Stop slurmctld by the PID in its pidfile (SIGTERM: it saves its state and exits, as for
        an upgrade or a restart); slurmd and the jobs on the nodes run on."""
        with self._lock():
            if self.controller_pid() is None:
                raise SlurmClusterError(f"no slurmctld of {self.lab} runs (pidfile {self._pidfile('slurmctld')})")
            _stop_by_pidfiles([self._pidfile("slurmctld")], "slurmctld", timeout)

    def start_controller(self, timeout: float = 60) -> None:
        """Start slurmctld again on the state it saved (its jobs, running or queued, are recovered;
        never ``up``, which starts a stopped controller on fresh state) and wait until it answers."""
        with self._lock():
            if self.controller_pid() is None:
                self._spawn(["slurmctld"], "slurmctld")
            _wait_until(self.controller_up, timeout, "slurmctld to answer `scontrol ping` again",
                        self.lab / "log" / "slurmctld.log")

    def pause_controller(self) -> None:
        """SIGSTOP slurmctld: it keeps its port and accepts connections but answers nothing, as an
        overloaded controller does (clients say ``Socket timed out on send/recv operation``)."""
        pid = self.controller_pid()
        if pid is None:
            raise SlurmClusterError(f"no slurmctld of {self.lab} runs")
        os.kill(pid, signal.SIGSTOP)

    def resume_controller(self) -> None:
        """SIGCONT slurmctld after :meth:`pause_controller`; it then works off what it was sent."""
        pid = self.controller_pid()
        if pid is not None:
            os.kill(pid, signal.SIGCONT)

    # -- shared use by several pytest sessions ------------------------------------------------
    def join(self) -> None:
        """Record that this process uses the cluster (see `leave`). Call it before `up`, so a
        session that is leaving at the same moment cannot stop the cluster under us."""
        with self._lock():
            (self.lab / "leases").mkdir(parents=True, exist_ok=True)
            (self.lab / "leases" / str(os.getpid())).touch()

    def leave(self) -> bool:
        """Drop this process's lease; stop the cluster if tests started it and no other live
        process holds a lease. Return True if it was stopped."""
        with self._lock():
            (self.lab / "leases" / str(os.getpid())).unlink(missing_ok=True)
            others = [p for p in (self.lab / "leases").glob("*") if procs.running(int(p.name))]
            if others or not (self.lab / "run" / "started-by-tests").exists():
                return False
            self._down_locked()
            return True

    # -- bring down ---------------------------------------------------------------------------
    def down(self) -> None:
        """Cancel every job on the cluster, then stop its daemons by PID."""
        if not self.lab.exists():
            return
        with self._lock():
            self._down_locked()

    def _down_locked(self) -> None:
        # Only cancel jobs on our own controller, never on another cluster answering our port.
        if self.controller_up() and self._controller_is_ours():
            users = set(self.run("squeue", "--noheader", "--format=%u", check=False).stdout.split())
            for user in users:
                self.run("scancel", f"--user={user}", check=False)
            with contextlib.suppress(SlurmClusterError):
                _wait_until(self._queue_empty, 30, "the queue to drain", None)
        slurmd_pids = [self._pidfile(f"slurmd_{n}") for n in self.nodes]
        _stop_by_pidfiles(slurmd_pids, "slurmd")
        _stop_by_pidfiles([self._pidfile("slurmctld")], "slurmctld")
        ours = self.lab / "run" / "munged.ours"
        if ours.exists():
            pid = ours.read_text().strip()
            if _MUNGE_PIDFILE.exists() and _MUNGE_PIDFILE.read_text().strip() == pid:
                _stop_by_pidfiles([_MUNGE_PIDFILE], "munged")
            ours.unlink()
        (self.lab / "run" / "started-by-tests").unlink(missing_ok=True)
        for lease in (self.lab / "leases").glob("*"):
            lease.unlink(missing_ok=True)
        self._remove_etc_links()

    @contextlib.contextmanager
    def _lock(self) -> Iterator[None]:
        """Serialise up/down/leave between processes sharing this LAB."""
        self.lab.mkdir(parents=True, exist_ok=True)
        with open(self.lab / ".lock", "w") as fh:
            fcntl.flock(fh, fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.flock(fh, fcntl.LOCK_UN)


def image_files() -> list[str]:
    """What stands for the image's own files in the stand-in's containers: the repository (beam-hpc,
    installed editable), this venv and its base interpreter. The stand-in mounts those under /tmp into
    each container's fresh /tmp (where a checkout under /tmp would otherwise vanish); the rest of the
    host's filesystem is visible as it is."""
    repo = Path(__file__).resolve().parents[3]
    return sorted({str(repo), sys.prefix, sys.base_prefix})


# -- sites for the cluster ---------------------------------------------------------------------
def spot_site(site: Path, dst: Path) -> Path:
    """A copy of beam-hpc site profile ``site`` (env/local.yaml or one made from it) whose groups
    run in the ``spot`` partition: what a test that preempts its own job submits with."""
    text = site.read_text()
    debug = "partitions: {trainer: debug, rollout: debug}"
    if debug not in text:
        raise ValueError(f"{site}: no '{debug}' line to move to the spot partition")
    dst.write_text(text.replace(debug, "partitions: {trainer: spot, rollout: spot}"))
    return dst


# -- process helpers ---------------------------------------------------------------------------
def _live_pid(pidfile: Path, program: str) -> int | None:
    """PID from `pidfile` if that process is alive and is `program` (guards against PID reuse)."""
    try:
        pid = int(pidfile.read_text().strip())
    except (OSError, ValueError):
        return None
    argv = procs.cmdline(pid)
    return pid if argv and os.path.basename(argv[0]) == program else None


def _stop_by_pidfiles(pidfiles: Sequence[Path], program: str, timeout: float = 15) -> None:
    """SIGTERM every live daemon listed, wait for all, SIGKILL stragglers; remove the pidfiles."""
    pids = [p for p in (_live_pid(f, program) for f in pidfiles) if p is not None]
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, 15)
    poll_until(lambda: not any(procs.running(p) for p in pids), timeout, 0.1)
    for pid in pids:
        if procs.running(pid):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, 9)
    for f in pidfiles:
        f.unlink(missing_ok=True)


def _munge_works() -> bool:
    if shutil.which("munge") is None:
        return False
    cred = subprocess.run(["munge", "-n"], capture_output=True)
    if cred.returncode != 0:
        return False
    return subprocess.run(["unmunge"], input=cred.stdout, capture_output=True).returncode == 0


def _wait_until(predicate: Callable[[], bool], timeout: float, what: str,
                log: Path | None) -> None:
    """Return once ``predicate()`` holds; SlurmClusterError with the log's last lines after ``timeout`` s."""
    if poll_until(predicate, timeout, 0.2):
        return
    hint = ""
    if log is not None and log.exists():
        hint = "; last log lines of " + str(log) + ":\n" + "\n".join(
            log.read_text(errors="replace").splitlines()[-15:])
    raise SlurmClusterError(f"timed out after {timeout:.0f} s waiting for {what}{hint}")


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("action", choices=["up", "down", "status", "plugin"])
    parser.add_argument("--lab", type=Path, default=DEFAULT_LAB, help="cluster directory")
    args = parser.parse_args(argv)
    cluster = LocalSlurmCluster(ClusterSpec(lab=args.lab))
    try:
        if args.action == "plugin":
            # a running cluster takes it at its next step: each slurmstepd (one per step) and each srun
            # reads plugstack.conf and loads the .so afresh; only slurmd's own context keeps the old one
            print(f"built {cluster.build_pyxis_plugin()}")
            if (cluster.lab / "etc").is_dir():
                cluster._write_plugstack()
            return 0
        if args.action == "up":
            t0 = time.monotonic()
            started = cluster.up()
            print(f"{'started' if started else 'reused'} local Slurm cluster in {cluster.lab} "
                  f"({time.monotonic() - t0:.2f} s); export SLURM_CONF={cluster.conf}")
        elif args.action == "down":
            cluster.down()
            print(f"stopped local Slurm cluster in {cluster.lab}")
        print(cluster.status(), end="")
    except SlurmClusterError as err:
        print(f"error: {err}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
