"""Warm JIT caches (beam_hpc.node.jit_cache) on real files and real processes: what one node
compiles reaches the group's other nodes through the run's archive; concurrent saves all land.
The end-to-end check (a real job's Ray actors on two nodes, through the Apptainer stand-in) is
tests/job/test_job_local.py::test_jit_cache_and_image_copy_carry_over_to_another_node."""

from __future__ import annotations

import io
import multiprocessing
import tarfile
from pathlib import Path

from beam_hpc.node import jit_cache


def _names(archive: Path) -> list[str]:
    with tarfile.open(archive) as tar:
        return sorted(m.name for m in tar if m.isfile())


def test_cache_env_points_each_compiler_at_its_own_local_dir(tmp_path):
    local = jit_cache.local_dir(str(tmp_path), "run1", "trainer", "n3")
    assert local == tmp_path / "beam-jit" / "run1" / "trainer" / "n3"
    env = jit_cache.cache_env(local)
    # SGLang (bundled with miles-rl) sets DG_JIT_CACHE_DIR from SGLANG_DG_CACHE_DIR on import and
    # re-points Triton/Inductor under SGLANG_CACHE_DIR for torch.compile: those go node-local too
    assert env == {"TRITON_CACHE_DIR": f"{local}/triton", "TORCHINDUCTOR_CACHE_DIR": f"{local}/inductor",
                   "DG_JIT_CACHE_DIR": f"{local}/deepgemm", "SGLANG_DG_CACHE_DIR": f"{local}/deepgemm",
                   "FLASHINFER_WORKSPACE_BASE": f"{local}/flashinfer", "SGLANG_CACHE_DIR": f"{local}/sglang"}



def test_what_one_node_compiles_seeds_another_node_of_the_group(tmp_path):
    archive = tmp_path / "run" / "jit-cache" / "trainer.tar"
    a, b = tmp_path / "a", tmp_path / "b"
    with jit_cache.warm(archive, a) as (env, seeded):  # first segment, node a: cold
        assert (seeded.seeded, seeded.kept) == (0, 0)
        kernel = Path(env["TRITON_CACHE_DIR"], "5f0c", "add_kernel.cubin")
        kernel.parent.mkdir()
        kernel.write_bytes(b"\x7fELF cubin")
        Path(env["TRITON_CACHE_DIR"], ".tmp-being-written").write_text("x")  # hidden temporaries stay out
    assert _names(archive) == ["triton/5f0c/add_kernel.cubin"]
    with jit_cache.warm(archive, b) as (env, seeded):  # second segment, node b
        assert seeded.seeded == 1
        assert Path(env["TRITON_CACHE_DIR"], "5f0c", "add_kernel.cubin").read_bytes() == b"\x7fELF cubin"
        Path(env["TORCHINDUCTOR_CACHE_DIR"], "fx.graph").write_text("g")
    assert _names(archive) == ["inductor/fx.graph", "triton/5f0c/add_kernel.cubin"]
    before = archive.stat().st_mtime_ns
    with jit_cache.warm(archive, a) as (_env, seeded):  # node a again: keeps its own, gets b's
        assert (seeded.seeded, seeded.kept) == (1, 1)
    assert archive.stat().st_mtime_ns == before  # nothing new: the archive is not rewritten


def test_a_hostile_archive_member_is_skipped_and_the_rest_seeded(tmp_path):
    archive = tmp_path / "trainer.tar"
    with tarfile.open(archive, "w") as tar:
        for name in ("../escape", "triton/ok"):
            info = tarfile.TarInfo(name)
            info.size = 2
            tar.addfile(info, io.BytesIO(b"hi"))
    result = jit_cache.seed(archive, tmp_path / "node")
    assert result.seeded == 1 and (tmp_path / "node" / "triton" / "ok").read_text() == "hi"
    assert not (tmp_path / "escape").exists()


def _node_saves(archive: str, local: str, name: str) -> None:
    with jit_cache.warm(archive, local) as (env, _):
        Path(env["TRITON_CACHE_DIR"], name).write_text(name)


def test_nodes_saving_at_once_all_land(tmp_path):
    archive = tmp_path / "trainer.tar"
    ctx = multiprocessing.get_context("fork")
    procs = [ctx.Process(target=_node_saves, args=(str(archive), str(tmp_path / f"n{i}"), f"k{i}")) for i in range(6)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(60)
    assert [p.exitcode for p in procs] == [0] * 6
    assert _names(archive) == [f"triton/k{i}" for i in range(6)]


def test_an_unreadable_archive_means_a_cold_start_not_a_failure(tmp_path):
    archive = tmp_path / "trainer.tar"
    archive.write_bytes(b"not a tar")
    with jit_cache.warm(archive, tmp_path / "n") as (env, seeded):
        assert seeded.seeded == 0 and (tmp_path / "n" / "triton").is_dir()
        Path(env["TRITON_CACHE_DIR"], "k").write_text("k")
    assert _names(archive) == ["triton/k"]  # replaced by a whole one


def test_doctor_reports_the_image_copy_and_the_caches_with_the_runs_archives(tmp_path):
    from beam_hpc.config.site import site_from_dict
    from beam_hpc.node.image import write_checksum
    from beam_hpc.node.warm_start import doctor_facts

    sif = tmp_path / "beam.sif"
    sif.write_text("image")
    base = {"name": "s", "scratch": str(tmp_path / "scratch")}
    reads_shared = site_from_dict({**base, "container": {"image": str(sif)}})
    (name, status, detail, fix), (jit_name, jit_status, jit_detail, _) = doctor_facts(reads_shared)
    assert (name, status) == ("image copy", "warn") and "from shared storage in every segment" in detail
    assert "stage_to_local: true" in fix
    assert (jit_name, jit_status) == ("jit caches", "pass")
    assert "TRITON_CACHE_DIR, TORCHINDUCTOR_CACHE_DIR, DG_JIT_CACHE_DIR, SGLANG_DG_CACHE_DIR" in jit_detail
    assert "no shared archive yet" in jit_detail

    digest = write_checksum(sif)
    staged = site_from_dict({**base, "container": {"image": str(sif), "stage_to_local": True}})
    run = tmp_path / "run"
    with jit_cache.warm(run / "jit-cache" / "trainer.tar", tmp_path / "n0") as (env, _):
        Path(env["TRITON_CACHE_DIR"], "k").write_text("k")
    (_, status, detail, _), (_, _, jit_detail, _) = doctor_facts(staged, str(run))
    assert status == "pass" and f"verified against beam.sif.sha256 ({digest[:12]})" in detail
    assert "archives trainer.tar: 1 files" in jit_detail
    host = site_from_dict({"name": "h", "container": {"runtime": "host"}})
    assert [(n, s) for n, s, _, _ in doctor_facts(host)] == [("jit caches", "warn")]  # no scratch: the temp dir


def test_an_unwritable_scratch_leaves_the_compilers_defaults_and_fails_nothing(tmp_path):
    blocker = tmp_path / "scratch"
    blocker.write_text("a file where the scratch directory should be")
    with jit_cache.warm(tmp_path / "trainer.tar", blocker / "beam-jit" / "n0") as (env, seeded):
        assert env == {} and seeded.seeded == 0
    assert not (tmp_path / "trainer.tar").exists()
