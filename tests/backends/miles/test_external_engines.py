"""Extra SGLang engines for a Miles run (``beam_hpc.backends.miles.external_engines``): their command
against the written contract of SGLang's parser, their ports, their records in the run directory,
the SGLang stand-in, and what segment start does with them. SGLang's and Miles's real parsers and the
Slurm question are in ``test_external_engines_real.py``.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import stat
import subprocess
import sys
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
from miles_facts import QWEN3_30B_A3B
from polling import poll_until
from test_miles_args import miles_accepts, parse_flags

from beam_hpc.backends import registry
from beam_hpc.backends.miles import external_engines as ee
from beam_hpc.backends.miles.flags import OWNED_NOT_EMITTED
from beam_hpc.backends.miles.launch import parse_args as launcher_parse_args
from beam_hpc.config.recipe import load_recipe
from beam_hpc.config.site import Site
from beam_hpc.errors import InputError
from beam_hpc.node.ray_node import ray_ports
from beam_hpc.plan.plan import Plan
from beam_hpc.plan.ports import RAY_PORT_KINDS, WEIGHT_SYNC, band_port

ROOT = Path(__file__).resolve().parents[3]
CONTRACT = ROOT / "tests" / "support" / "fixtures" / "sglang-server-flags.txt"
STANDIN = ROOT / "tests" / "support" / "standins" / "sglang_standin"
SITE = Site(name="t", container={"runtime": "host"}, python=sys.executable, gpus_per_node=8)


def load_contract() -> dict[str, str]:
    """Every option SGLang's parser accepts -> how many values it takes ("0" for a switch)."""
    out = {}
    for line in CONTRACT.read_text().splitlines():
        if line and not line.startswith("#"):
            flags, nargs, _dest, _default = line.split("\t")
            out.update(dict.fromkeys(flags.split(","), nargs))
    return out


def miles_plan(tmp: Path, *overrides: str, recipe: str = "dedicated") -> Plan:
    model = tmp / "model"
    model.mkdir(exist_ok=True)
    (model / "config.json").write_text(json.dumps(QWEN3_30B_A3B))
    r = load_recipe(ROOT / "recipes" / f"{recipe}.yaml",
                    ["model.miles_model_script=null", f"model.path={model}", f"output_dir={tmp}/run",
                     *([] if recipe == "colocated" else ["topology.rollout.gpus_per_engine=2"]), *overrides])
    return registry.plan_for(r, SITE)


@pytest.fixture
def plan(tmp_path: Path) -> Plan:
    return miles_plan(tmp_path)


# -- the engine's command ---------------------------------------------------------------------------


def test_engine_argv_is_sglang_launch_server_with_the_runs_settings(plan: Plan) -> None:
    argv = ee.engine_argv(plan, host="10.0.0.7", port=38001, gpu_ids=[2, 3], rank=5)
    assert argv[:3] == [sys.executable, "-m", "sglang.launch_server"]
    contract = load_contract()
    flags = parse_flags(argv[3:])
    assert sorted(f for f in flags if f not in contract) == []
    for flag, values in flags.items():  # switches carry no value, the rest exactly one
        assert len(values) == (0 if contract[flag] == "0" else 1), (flag, values)
    assert flags["--model-path"] == [plan.recipe.model.path]
    assert flags["--tp-size"] == ["2"] == [str(plan.recipe.topology.rollout.gpus_per_engine)]
    assert (flags["--host"], flags["--port"]) == (["10.0.0.7"], ["38001"])
    assert (flags["--base-gpu-id"], flags["--gpu-id-step"]) == (["2"], ["1"])
    # what Miles passes the engines it launches: remote code, seed + rank, no warm-up, ...
    assert flags["--random-seed"] == [str(plan.recipe.seed + 5)]
    for switch in ("--trust-remote-code", "--skip-server-warmup", "--enable-draft-weights-cpu-backup", "--enable-metrics"):
        assert flags[switch] == [], switch
    # ... and every --sglang-* flag of the driver as SGLang's own flag (the memory share here)
    assert flags["--mem-fraction-static"] == [repr(plan.recipe.performance.sglang_mem_fraction)]
    assert "--enable-memory-saver" not in flags  # a dedicated pool: Miles's expected value is off


def test_sglang_flags_of_the_driver_carry_over(tmp_path: Path) -> None:
    plan = miles_plan(tmp_path, 'backend_options.extra_args=["--sglang-chunked-prefill-size", "4096", '
                                '"--sglang-server-concurrency", "64", "--sglang-enable-dp-attention"]')
    flags = parse_flags(ee.engine_argv(plan, host="h", port=1, gpu_ids=[0, 1], rank=0)[3:])
    assert flags["--chunked-prefill-size"] == ["4096"] and flags["--enable-dp-attention"] == []
    assert "--server-concurrency" not in flags  # Miles's client setting, no server flag
    assert set(flags) <= set(load_contract())


@pytest.mark.parametrize(("recipe", "field", "miles_lines"), [
    ("dedicated", "backend: miles", ("placement_group.py:97-99", "server_group.py:90-91")),
    ("colocated", "training.colocated", ("placement_group.py:97-99", "server_group.py:90-91", "actor.py:253-254")),
    ("lora", "training.mode", ()),
])
def test_every_miles_run_refuses_extra_engines_naming_the_miles_line(tmp_path: Path, recipe: str, field: str,
                                                                     miles_lines: tuple[str, ...]) -> None:
    """Miles main starts no engine it did not launch (test_miles_placement shows the layout on Ray):
    one line, naming the field and the Miles code line. The colocated and LoRA engines' own commands
    are refused too; a dedicated run's command stays buildable (an older beam-hpc's job runs it)."""
    plan = miles_plan(tmp_path, recipe=recipe)
    why = ee.refusal(plan)
    assert why is not None and why.startswith(field) and "\n" not in why
    assert all(line in why for line in miles_lines), why
    if recipe == "dedicated":
        assert ee.engine_argv(plan, host="h", port=1, gpu_ids=[0, 1], rank=0)
    else:
        with pytest.raises(InputError, match=field):
            ee.engine_argv(plan, host="h", port=1, gpu_ids=[0, 1], rank=0)


def test_each_engine_has_its_own_seed_seed_plus_rank(tmp_path: Path) -> None:
    """Miles seeds engine ``rank`` with ``seed + rank``; an extra job's engine k has the rank of its
    port slot, so no two engines of one job, or of two jobs, share a seed (the GPU-index seed that
    came before repeated on every node)."""
    plan = miles_plan(tmp_path, "topology.rollout.gpus_per_engine=2")
    per_node = plan.site.gpus_per_node // 2

    def seeds(job: int, nodes: int) -> list[int]:
        out = []
        for k in range(per_node * nodes):
            i = k % per_node  # engine i of its node, on GPUs 2i and 2i+1, as extra_node starts them
            argv = ee.engine_argv(plan, host="h", port=1, gpu_ids=[2 * i, 2 * i + 1],
                                  rank=ee.engine_rank(plan.site, job, k))
            out.append(int(argv[argv.index("--random-seed") + 1]))
        return out

    both = seeds(12, 2) + seeds(13, 2)
    assert len(set(both)) == len(both) == 4 * per_node
    assert seeds(12, 1)[0] == plan.recipe.seed + ee.engine_rank(plan.site, 12, 0)


@pytest.mark.parametrize("gpu_ids", [[0], [0, 2], [1, 2, 3], [], [-1, 0]])
def test_gpu_ids_must_be_one_engines_consecutive_gpus(plan: Plan, gpu_ids: list[int]) -> None:
    with pytest.raises(InputError, match="gpu_ids"):
        ee.engine_argv(plan, host="h", port=1, gpu_ids=gpu_ids, rank=0)


def test_an_engine_across_nodes_is_refused(tmp_path: Path) -> None:
    plan = miles_plan(tmp_path, "topology.rollout.gpus_per_engine=16")
    with pytest.raises(InputError, match="gpus_per_engine: 16 spans nodes"):
        ee.engine_argv(plan, host="h", port=1, gpu_ids=list(range(16)), rank=0)


# -- ports ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("base_span", [(20000, 2000), (30000, 100), (1024, 8)])
def test_engine_ports_never_meet_any_jobs_ray_or_weight_sync_ports(base_span: tuple[int, int]) -> None:
    base, span = base_span
    site = Site(name="t", container={"runtime": "host"}, gpus_per_node=8, ray={"gcs_port_base": base, "port_span": span})
    jobs = range(1, 3 * span, 7)
    others = {band_port(site.ray, kind, job) for job in jobs for kind in (*RAY_PORT_KINDS, WEIGHT_SYNC)}
    others |= {p for job in jobs for p in vars(ray_ports(site.ray, job)).values()}
    for job in jobs:
        ports = ee.engine_ports(site, job, 8)
        assert len(set(ports)) == 8 and not set(ports) & others
    # the next job gets other slots (a span of 2,000 holds 250 jobs' worth of 8)
    assert not set(ee.engine_ports(SITE, 41, 8)) & set(ee.engine_ports(SITE, 42, 8))
    assert ee.engine_ports(SITE, 41, 8) == ee.engine_ports(SITE, 41 + 250, 8)


def test_engine_ports_of_a_multi_node_job_are_distinct() -> None:
    """Node k of a job takes the k-th run of its ports: 3 nodes x 8 engines, all distinct."""
    ports = ee.engine_ports(SITE, 41, 24)
    assert len(set(ports)) == 24 and ports[:8] == ee.engine_ports(SITE, 41, 8)


def test_engine_ports_refusals() -> None:
    with pytest.raises(InputError, match="between 1 and site ray.port_span"):
        ee.engine_ports(Site(name="t", container={"runtime": "host"}, gpus_per_node=8, ray={"port_span": 4}), 5, 5)
    with pytest.raises(InputError, match="between 1 and site ray.port_span"):
        ee.engine_ports(SITE, 5, 0)
    with pytest.raises(InputError, match="ray.gcs_port_base: 60000"):
        ee.engine_ports(Site(name="t", container={"runtime": "host"}, gpus_per_node=8, ray={"gcs_port_base": 60000}), 5, 2)


# -- registration -----------------------------------------------------------------------------------


def test_register_registered_deregister(tmp_path: Path) -> None:
    run = tmp_path / "run"
    assert ee.registered(run) == [] and ee.deregister(run, 7) is False
    a = [ee.Engine("10.0.0.1", 40001, 2), ee.Engine("10.0.0.1", 40002, 2)]
    path = ee.register(run, 12, a)
    ee.register(run, 9, [ee.Engine("10.0.0.2", 40003, 2)])
    assert path == run / "elastic" / "engines" / "12.json"
    record = json.loads(path.read_text())
    assert record["job_id"] == "12" and record["engines"] == [{"host": "10.0.0.1", "port": 40001, "tp": 2},
                                                              {"host": "10.0.0.1", "port": 40002, "tp": 2}]
    assert isinstance(record["time"], float)
    assert stat.S_IMODE(path.stat().st_mode) == 0o600 and stat.S_IMODE(path.parent.stat().st_mode) == 0o700
    assert sorted(p.name for p in path.parent.iterdir()) == [".lock", "12.json", "9.json"]  # no temporary left
    assert [(e.job_id, e.addr) for e in ee.registered(run)] == [
        ("9", "10.0.0.2:40003"), ("12", "10.0.0.1:40001"), ("12", "10.0.0.1:40002")]
    # another node of job 12 registers its engine (as a mapping): the job's record keeps both nodes';
    # a node registering an address again replaces that engine
    ee.register(run, 12, [{"host": "10.0.0.3", "port": 40001, "tp": 2}, ee.Engine("10.0.0.1", 40002, 4)])
    assert [(e.addr, e.tp) for e in ee.registered(run) if e.job_id == "12"] == [
        ("10.0.0.1:40001", 2), ("10.0.0.3:40001", 2), ("10.0.0.1:40002", 4)]
    assert ee.deregister(run, 12) is True and [e.job_id for e in ee.registered(run)] == ["9"]


def test_an_unreadable_record_is_left_out_with_a_line(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    ee.register(tmp_path, 3, [ee.Engine("h", 1, 2)])
    (ee.engines_dir(tmp_path) / "4.json").write_text('{"job_id": "4", "engines": [{"host": "h"}]}')
    with caplog.at_level(logging.WARNING):
        assert [e.job_id for e in ee.registered(tmp_path)] == ["3"]
    assert "4.json left out: unreadable" in caplog.text


# -- the Miles argv at segment start -----------------------------------------------------------------


def filled(plan: Plan) -> list[str]:
    """The driver argv as the runner fills it."""
    return [a.replace("{ray_address}", "10.0.0.1:20000").replace("{num_rollout}", "100") for a in plan.driver_argv]


def test_attach_argv_adds_the_engines_and_sets_the_rollout_gpus(plan: Plan) -> None:
    argv = filled(plan)
    engines = [ee.Engine("10.0.0.5", 40001, 2, "12"), ee.Engine("10.0.0.6", 40001, 2, "13")]
    out = ee.attach_argv(argv, engines)
    opts, rest = launcher_parse_args(out[out.index("-m") + 2:])  # the launcher still splits it
    flags = parse_flags(rest[1:])
    assert flags["--rollout-external"] == [] and flags["--use-fault-tolerance"] == []
    assert flags["--rollout-external-engine-addrs"] == ["10.0.0.5:40001", "10.0.0.6:40001"]
    assert flags["--worker-urls"] == ["http://10.0.0.5:40001", "http://10.0.0.6:40001"]
    assert flags["--rollout-num-gpus"] == ["4"]
    assert sorted(f for f in flags if not miles_accepts(f)) == []  # Miles main's parser knows them all
    before = parse_flags(argv[argv.index("--") + 2:])
    assert {k: v for k, v in flags.items() if k not in (*ee.ATTACH_FLAGS, "--rollout-num-gpus")} == \
        {k: v for k, v in before.items() if k != "--rollout-num-gpus"}
    assert ee.attach_argv(argv, []) == argv


def test_attach_flags_are_owned(tmp_path: Path) -> None:
    for flag in ee.ATTACH_FLAGS:
        assert flag in OWNED_NOT_EMITTED and miles_accepts(flag)
        with pytest.raises(InputError, match=f"{flag}.*rollout add"):
            miles_plan(tmp_path, f"backend_options.extra_args=[{flag},x]")


# -- the SGLang stand-in and segment start ------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def start_standin(argv: list[str], record: Path) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": str(STANDIN), "BEAM_SGLANG_STANDIN_RECORD": str(record)}
    return subprocess.Popen([sys.executable, *argv[1:]], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE)


@pytest.fixture
def standins(plan: Plan, tmp_path: Path) -> Iterator[list[ee.Engine]]:
    """Two stand-in engines started with engine_argv, as an extra job starts them."""
    procs, engines = [], []
    for i in range(2):
        port = free_port()
        procs.append(start_standin(ee.engine_argv(plan, host="127.0.0.1", port=port, gpu_ids=[2 * i, 2 * i + 1],
                                                  rank=i),
                                   tmp_path / "record"))
        engines.append(ee.Engine("127.0.0.1", port, 2))
    try:
        assert poll_until(lambda: all(ee.healthy(e, 0.5) for e in engines), 30), "stand-ins did not come up"
        yield engines
    finally:
        for p in procs:
            p.terminate()
        for p in procs:
            assert p.wait(10) == 0


def get(url: str) -> tuple[int, object]:
    with urllib.request.urlopen(url, timeout=5) as resp:
        body = resp.read()
        return resp.status, json.loads(body) if body else None


def test_standin_serves_what_miles_probes_and_records_its_argv(standins: list[ee.Engine], tmp_path: Path) -> None:
    e = standins[1]
    for path in ("/health", "/health_generate", "/flush_cache"):
        assert get(e.url + path)[0] == 200
    status, info = get(e.url + "/get_server_info")
    assert status == 200 and isinstance(info, dict)
    # the fields Miles compares for an attached engine (31f1ca961 _compute_server_args, checked ones)
    assert {k: info[k] for k in ("host", "port", "tp_size", "dp_size", "pp_size", "ep_size", "nnodes", "node_rank",
                                 "gpu_id_step", "base_gpu_id", "enable_memory_saver")} == {
        "host": "127.0.0.1", "port": e.port, "tp_size": 2, "dp_size": 1, "pp_size": 1, "ep_size": 1, "nnodes": 1,
        "node_rank": 0, "gpu_id_step": 1, "base_gpu_id": 2, "enable_memory_saver": False}
    assert get(e.url + "/model_info")[1]["weight_version"] == "default"
    recorded = json.loads((tmp_path / "record" / f"{e.port}.json").read_text())["argv"]
    assert recorded[recorded.index("--port") + 1] == str(e.port)


def post(url: str, body: object) -> tuple[int, dict]:
    req = urllib.request.Request(url, data=json.dumps(body).encode(), method="POST",
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=10) as resp:
            return resp.status, json.loads(resp.read() or b"{}")
    except urllib.error.HTTPError as err:
        return err.code, json.loads(err.read() or b"{}")


def test_standin_generates_and_takes_the_weight_updates_miles_sends(standins: list[ee.Engine], tmp_path: Path) -> None:
    """Bodies as Miles writes them (miles-rl 0.0.2: ``miles/rollout/sglang_rollout.py:165-184`` for
    /generate, which reads ``meta_info.output_token_logprobs`` as ``[logprob, token_id, _]`` and
    ``finish_reason.type``, ``:200-209, 235``; ``sglang_engine.py:462-542`` for the weight updates),
    answered as SGLang's http_server answers them."""
    a, b = standins  # engine_argv gave them ranks 0 and 1: seeds seed+0 and seed+1
    ask = {"input_ids": [11, 12, 13], "sampling_params": {"max_new_tokens": 5, "temperature": 1.0},
           "return_logprob": True}
    status, out = post(a.url + "/generate", ask)
    assert status == 200
    meta = out["meta_info"]
    tokens = [t[1] for t in meta["output_token_logprobs"]]
    assert tokens == out["output_ids"] and len(tokens) == meta["completion_tokens"] == 5
    assert all(t[0] <= 0 and t[2] is None for t in meta["output_token_logprobs"])
    assert meta["finish_reason"]["type"] == "length" and meta["prompt_tokens"] == 3
    assert meta["weight_version"] == "default" and isinstance(out["text"], str)
    assert post(a.url + "/generate", ask)[1]["output_ids"] == tokens  # one seed, one answer
    assert post(b.url + "/generate", ask)[1]["output_ids"] != tokens  # the other engine's own seed
    assert post(a.url + "/generate", {"sampling_params": {}})[0] == 400  # neither input_ids nor text

    group = {"master_address": "10.0.0.1", "master_port": 29500, "rank_offset": 1, "world_size": 3,
             "group_name": "miles", "backend": "nccl"}
    update = {"names": ["a.w", "b.w"], "dtypes": ["bfloat16", "float32"], "shapes": [[2, 3], [4]],
              "group_name": "miles", "flush_cache": False, "weight_version": "3"}
    assert post(a.url + "/update_weights_from_distributed", update) == (
        400, {"success": False, "message": "Group miles not in the update groups"})  # no group yet
    assert post(a.url + "/init_weights_update_group", group)[1]["success"] is True
    assert post(a.url + "/pause_generation", {"mode": "retract"})[1]["status"] == "ok"
    assert post(a.url + "/update_weights_from_distributed", {**update, "shapes": [[2, 3]]})[0] == 400
    assert post(a.url + "/update_weights_from_distributed", update)[1]["success"] is True
    assert post(a.url + "/continue_generation", {})[1]["status"] == "ok"
    assert get(a.url + "/model_info")[1]["weight_version"] == "3"
    assert post(a.url + "/generate", ask)[1]["meta_info"]["weight_version"] == "3"
    assert post(a.url + "/update_weight_version", {"new_version": "4"})[1]["new_version"] == "4"
    assert get(a.url + "/model_info")[1]["weight_version"] == "4"
    assert post(a.url + "/init_weights_update_group", {"master_address": "x"})[0] == 422  # FastAPI's: fields missing
    assert post(a.url + "/pause_generation", {"mode": "sometimes"})[0] == 422
    assert post(a.url + "/destroy_weights_update_group", {"group_name": "miles"})[1]["success"] is True
    assert post(a.url + "/destroy_weights_update_group", {"group_name": "miles"})[0] == 400
    assert get(a.url + "/release_memory_occupation") == (200, None)  # SGLang answers null
    calls = [json.loads(line)["path"] for line in (tmp_path / "record" / f"{a.port}-calls.jsonl").read_text().splitlines()]
    assert calls[:3] == ["/update_weights_from_distributed", "/init_weights_update_group", "/pause_generation"]


def test_standin_refuses_a_flag_sglang_does_not_have(tmp_path: Path) -> None:
    proc = start_standin([sys.executable, "-m", "sglang.launch_server", "--model-path", "m", "--no-such-flag"],
                         tmp_path)
    _, err = proc.communicate(timeout=30)
    assert proc.returncode == 2 and b"unrecognized arguments: --no-such-flag" in err


def test_segment_start_selects_live_engines_only(plan: Plan, standins: list[ee.Engine],
                                                  caplog: pytest.LogCaptureFixture) -> None:
    """The selection a segment would make once Miles starts engines it did not launch
    (``attach_live``). What Slurm answers is a parameter here: job 12 runs two answering engines and
    one that does not answer, job 13 has ended, job 14's engine has another TP. Only job 12's two
    live engines are kept, each other one gets its line."""
    run = plan.output_dir
    ee.register(run, 12, [*standins, ee.Engine("127.0.0.1", free_port(), 2)])
    ee.register(run, 13, [ee.Engine("127.0.0.1", free_port(), 2)])
    ee.register(run, 14, [ee.Engine("127.0.0.1", standins[0].port, 4)])
    argv = filled(plan)
    own = parse_flags(argv[argv.index("--") + 2:])["--rollout-num-gpus"]
    assert own == ["32"]  # the dedicated recipe's rollout group: 4 nodes x 8
    with caplog.at_level(logging.INFO):
        out = ee.attach_live(plan, argv, ee.registered(run), running=lambda job: job in ("12", "14"))
    assert out == argv  # 2 engines (4 GPUs) would replace 32 GPUs: left out
    assert "fewer GPUs than the run's rollout group (32)" in caplog.text
    assert "of extra job 13 left out: the job is no longer running" in caplog.text
    assert "of extra job 12 left out: no answer on /health" in caplog.text
    assert "of extra job 14 left out: TP 4, the run's engines have 2" in caplog.text

    small = miles_plan(Path(run).parent, "topology.rollout.nodes=1", "topology.rollout.gpus_per_node=4")
    caplog.clear()
    with caplog.at_level(logging.INFO):
        out = ee.attach_live(small, filled(small), ee.registered(run), running=lambda job: job in ("12", "14"))
    flags = parse_flags(out[out.index("--") + 2:])
    assert flags["--rollout-external-engine-addrs"] == [e.addr for e in standins]
    assert flags["--rollout-num-gpus"] == ["4"]
    assert "attaching 2 extra engines (4 GPUs)" in caplog.text


@pytest.mark.parametrize("recipe", ["dedicated", "colocated"])
def test_segment_start_leaves_registered_engines_out_of_a_miles_run(tmp_path: Path, recipe: str,
                                                                    caplog: pytest.LogCaptureFixture) -> None:
    """Live, answering engines of a running job, registered for a Miles run (by a beam-hpc that
    still added them): the segment runs with the run's own rollout group and says why."""
    plan = miles_plan(tmp_path, recipe=recipe)
    ee.register(plan.output_dir, 12, [ee.Engine("127.0.0.1", 1, ee.gpus_per_engine(plan))])
    argv = filled(plan)
    with caplog.at_level(logging.INFO):
        assert ee.attach(plan, argv, running=lambda job: True, probe=lambda e: True) == argv
    assert f"1 registered engines left out: {ee.refusal(plan)}" in caplog.text
    smoke = ["python", "-m", "beam_hpc.job.smoke"]
    assert ee.attach(plan, smoke) == smoke
