"""Ray bring-up and teardown on the local Slurm cluster: beam-hpc's job against a sleep-based launcher.

    python benchmarks/bringup.py [--nodes 1 2 4] [--repeat 1] [--json results.json]

For each node count N, in one run:

- beam-hpc: a real job (``python -m beam_hpc.job.runner --smoke``) of N nodes (N = 1: one colocated
  node; otherwise N - 1 trainer nodes + 1 rollout node, 2 fake GPUs each). Bring-up is the job's
  own ``ready_s``: from the job process's start until every node and GPU of every group joined
  (readiness polled, never slept); teardown is the job's ``teardown_s`` (driver, node steps through
  ``scancel --signal=TERM``, stragglers by PID, temp dirs).
- sleep launcher, as the public examples do it (Ray's slurm-basic.sh, verl, OpenRLHF): head,
  ``sleep 10``, then each worker followed by ``sleep 5``, then the driver attaches. The same
  `ray start` command lines (beam_hpc.node.ray_node) are used, so only the orchestration differs.
  Bring-up is from the batch script's start until the driver sees all N nodes.
- one join: the issue's yardstick ("ready within 1.5x the time of one `ray start` join, flat in
  the node count"), measured in the same run next to each row: a 2-node job starts the head with
  the same command line, waits until it runs, then times one worker's ``srun ... ray start``
  (same command line) from launch until the head lists it alive. The table's "ready / one join"
  is beam-hpc's ready time over that.

The cluster is started (or reused) through tests/support/cluster/slurm_cluster.py. On a 2-core machine every
Ray node adds Python helper processes, so times grow with N here; on a real cluster each node
brings its own cores. Note the machine's load (printed) when comparing runs.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), *(str(ROOT / "tests" / "support" / d)
                             for d in ("builders/runs", "builders/waiting", "cluster", "standins"))]

from job_plans import batch_script, make_test_plan  # noqa: E402
from slurm_cluster import LocalSlurmCluster  # noqa: E402

JOB_TIMEOUT_S = 600

# What both comparison jobs share: the batch script's start time, the node list, a token, and
# beam-hpc's `ray start` command line for node i through srun (ray_cmd).
PREAMBLE = '''#!{python}
#SBATCH --nodes={n} --ntasks-per-node=1 --gres=gpu:2 --cpus-per-task=2 --mem=1000 --time=10
#SBATCH --output={out}
"""{doc}"""
import json, os, subprocess, sys, time
t0 = float(open("/proc/self/stat").read().rsplit(")", 1)[1].split()[19]) / os.sysconf("SC_CLK_TCK")
t0 += float([l.split()[1] for l in open("/proc/stat") if l.startswith("btime")][0])
sys.path.insert(0, {root!r})
from beam_hpc.node.ray_node import (GB, LOOPBACK_MAX_NODES, RayNode, loopback_ip, ray_env, ray_ports,
                               ray_start_argv, sweep, temp_dir_for, write_token)
from beam_hpc.config.site import load_site
site = load_site({root!r} + "/env/local.yaml")
job = int(os.environ["SLURM_JOB_ID"])
nodes = subprocess.run(["scontrol", "show", "hostnames", os.environ["SLURM_JOB_NODELIST"]],
                       capture_output=True, text=True, check=True).stdout.split()
token = write_token({tmp!r} + f"/auth-{{job}}")
# as the public examples do: srun needs the job's SLURM_* variables, Ray inherits them
env = {{**os.environ, **ray_env(token_path=str(token), job_tag=f"sleep.{{job}}")}}
address = f"{{loopback_ip(0)}}:{{ray_ports(site.ray, job, 0, LOOPBACK_MAX_NODES).gcs}}"
def ray_cmd(i):
    node = RayNode(group="trainer", roles=("trainer",), index=i, ip=loopback_ip(i), head_ip=loopback_ip(0),
                   ports=ray_ports(site.ray, job, i, LOOPBACK_MAX_NODES), num_cpus=2, num_gpus=2,
                   object_store_bytes=int(site.ray.object_store_gb * GB), temp_dir=temp_dir_for(str(job), 0, i))
    return ["srun", "--nodes=1", "--ntasks=1", "-w", nodes[i], "--overlap", "--mpi=none"] + ray_start_argv(node, sys.executable)
def alive():
    return len([n for n in ray.nodes() if n["Alive"]])
steps = []
'''

TEARDOWN = '''for p in steps:
    p.terminate()
for p in steps:
    p.wait()
sweep(f"sleep.{{job}}")
import shutil, glob
for d in glob.glob(f"/tmp/beam-{{job}}.0-*"):
    shutil.rmtree(d, ignore_errors=True)
'''

SLEEP_LAUNCHER = PREAMBLE + '''
for i in range(len(nodes)):
    steps.append(subprocess.Popen(ray_cmd(i), env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
    time.sleep(10 if i == 0 else 5)
os.environ.update(ray_env(token_path=str(token), job_tag="sleep-driver"))
import ray
ray.init(address=address, log_to_driver=False)
connected = time.time()
while alive() < len(nodes):
    time.sleep(0.1)
ready = time.time()
ray.shutdown()
print(json.dumps({{"ready_s": ready - t0, "late_s": ready - connected}}), flush=True)
''' + TEARDOWN

JOIN_PROBE = PREAMBLE + '''
steps.append(subprocess.Popen(ray_cmd(0), env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
os.environ.update(ray_env(token_path=str(token), job_tag="join-driver"))
import socket, ray
host, port = address.split(":")
while True:  # the head's GCS, then the head itself registered: only then does the clock start
    try:
        socket.create_connection((host, int(port)), timeout=1).close()
        break
    except OSError:
        time.sleep(0.1)
ray.init(address=address, log_to_driver=False)
while alive() < 1:
    time.sleep(0.05)
start = time.time()
steps.append(subprocess.Popen(ray_cmd(1), env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
while alive() < 2:
    time.sleep(0.05)
joined = time.time()
ray.shutdown()
print(json.dumps({{"join_s": joined - start}}), flush=True)
''' + TEARDOWN



def run_beam(cluster: LocalSlurmCluster, n: int, tmp: Path) -> dict:
    plan = make_test_plan(tmp / f"beam-{n}", trainer_nodes=max(n - 1, 1), rollout_nodes=1 if n > 1 else 0)
    job = cluster.run("sbatch", "--parsable", str(batch_script(plan, "--smoke"))).stdout.strip().split(";")[0]
    cluster.wait_for_job(job, timeout=JOB_TIMEOUT_S)
    outcome = json.loads(Path(plan.paths.segment_logs(job, 0), "outcome.json").read_text())
    if outcome["status"] != "completed":
        raise RuntimeError(f"beam-hpc job {job} with {n} nodes: {outcome['message']}")
    return {"ready_s": outcome["ready_s"], "teardown_s": outcome["teardown_s"]}


def run_script(cluster: LocalSlurmCluster, template: str, name: str, n: int, tmp: Path) -> dict:
    """Submit one of the comparison jobs (SLEEP_LAUNCHER, JOIN_PROBE) on n nodes; its JSON line."""
    tmp.mkdir(parents=True, exist_ok=True)
    out = tmp / f"{name}-{n}.out"
    script = tmp / f"{name}-{n}.py"
    doc = {"sleep": "The sleep-based launcher of the public examples, with beam-hpc's `ray start` command lines.",
           "join": "One `ray start` worker join to a running head, with beam-hpc's command lines."}[name]
    script.write_text(template.format(python=sys.executable, n=n, out=out, root=str(ROOT), tmp=str(tmp), doc=doc))
    job = cluster.run("sbatch", "--parsable", str(script)).stdout.strip().split(";")[0]
    cluster.wait_for_job(job, timeout=JOB_TIMEOUT_S)
    lines = [ln for ln in out.read_text().splitlines() if ln.startswith("{")]
    if not lines:
        raise RuntimeError(f"{name} job {job} with {n} nodes printed no result; see {out}")
    return json.loads(lines[-1])


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--nodes", type=int, nargs="+", default=[1, 2, 4])
    p.add_argument("--repeat", type=int, default=1)
    p.add_argument("--json", default=None, help="also write the raw results here")
    args = p.parse_args(argv)
    cluster = LocalSlurmCluster()
    too_many = [n for n in args.nodes if n > cluster.spec.nodes]
    if too_many:
        p.error(f"the local cluster has {cluster.spec.nodes} nodes; cannot run {too_many}")
    cluster.join()
    cluster.up(started_by_tests=True)
    os.environ.update(cluster.env)
    rows = []
    try:
        with tempfile.TemporaryDirectory(prefix="beam-bench-") as d:
            tmp = Path(d)
            for n in args.nodes:
                for r in range(args.repeat):
                    load = os.getloadavg()[0]
                    beam = run_beam(cluster, n, tmp / f"r{r}")
                    join = run_script(cluster, JOIN_PROBE, "join", 2, tmp / f"r{r}-{n}")
                    sleep = run_script(cluster, SLEEP_LAUNCHER, "sleep", n, tmp / f"r{r}")
                    rows.append({"nodes": n, "repeat": r, "load": load, "beam": beam, "join": join, "sleep": sleep})
                    print(f"N={n} run {r}: beam-hpc ready {beam['ready_s']:.1f} s, teardown "
                          f"{beam['teardown_s']:.1f} s; one join {join['join_s']:.1f} s; sleep launcher ready "
                          f"{sleep['ready_s']:.1f} s (load {load:.1f})", file=sys.stderr, flush=True)
    finally:
        cluster.leave()
    print(table(rows))
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))
    return 0


def table(rows: list[dict]) -> str:
    """Medians per node count, side by side."""
    def med(values: list[float]) -> float:
        s = sorted(values)
        return s[len(s) // 2] if len(s) % 2 else (s[len(s) // 2 - 1] + s[len(s) // 2]) / 2

    out = [("| nodes | beam-hpc ready (s) | one join (s) | ready / one join | beam-hpc teardown (s) "
            "| sleep launcher ready (s) | sleep / beam | load |"),
           "|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for n in sorted({r["nodes"] for r in rows}):
        rs = [r for r in rows if r["nodes"] == n]
        b = med([r["beam"]["ready_s"] for r in rs])
        j = med([r["join"]["join_s"] for r in rs])
        ratio = med([r["beam"]["ready_s"] / r["join"]["join_s"] for r in rs])
        t = med([r["beam"]["teardown_s"] for r in rs])
        s = med([r["sleep"]["ready_s"] for r in rs])
        load = med([r["load"] for r in rs])
        out.append(f"| {n} | {b:.1f} | {j:.1f} | {ratio:.2f} | {t:.1f} | {s:.1f} | {s / b:.2f} | {load:.1f} |")
    return textwrap.dedent("\n".join(out))


if __name__ == "__main__":
    sys.exit(main())
