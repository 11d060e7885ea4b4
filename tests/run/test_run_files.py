"""beam_hpc.files (the leaf every layer uses): atomic writes (old or new content, never torn) and the flock helper."""

from __future__ import annotations

import json
import multiprocessing
import os
import stat
import time
from pathlib import Path

import pytest

from beam_hpc import files


def test_write_atomic_replaces_whole_and_leaves_no_temporary(tmp_path: Path) -> None:
    p = tmp_path / "sub" / "f.txt"
    files.write_atomic(p, "old\n")
    files.write_atomic(p, b"new\n")
    assert p.read_bytes() == b"new\n"
    assert [c.name for c in p.parent.iterdir()] == ["f.txt"]
    files.write_json_atomic(tmp_path / "o.json", {"b": 1, "a": [1]})
    assert json.loads((tmp_path / "o.json").read_text()) == {"a": [1], "b": 1}


def test_write_atomic_mode_applies_from_the_start(tmp_path: Path) -> None:
    p = tmp_path / "token"
    old = os.umask(0o022)
    try:
        files.write_atomic(p, "secret", mode=0o600)
    finally:
        os.umask(old)
    assert stat.S_IMODE(p.stat().st_mode) == 0o600 and p.read_text() == "secret"


def test_a_failed_write_keeps_the_old_content(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A crash between write and rename (here: fsync failing) leaves the old file, and no temporary."""
    p = tmp_path / "f"
    files.write_atomic(p, "old")

    def boom(fd: int) -> None:
        raise OSError("disk gone")

    monkeypatch.setattr(files.os, "fsync", boom)
    with pytest.raises(OSError, match="disk gone"):
        files.write_atomic(p, "new")
    monkeypatch.undo()
    assert p.read_text() == "old" and sorted(c.name for c in tmp_path.iterdir()) == ["f"]


def test_atomic_path_publishes_on_success_only(tmp_path: Path) -> None:
    p = tmp_path / "data.jsonl"
    with files.atomic_path(p) as tmp:
        assert tmp.parent == p.parent and tmp != p
        tmp.write_text("a\n")
        assert not p.exists()  # nothing under the final name until the block ends
    assert p.read_text() == "a\n"
    with pytest.raises(RuntimeError):
        with files.atomic_path(p) as tmp:
            tmp.write_text("half")
            raise RuntimeError("writer died")
    assert p.read_text() == "a\n" and sorted(c.name for c in tmp_path.iterdir()) == ["data.jsonl"]
    with files.atomic_path(p, durable=False) as tmp:
        tmp.write_text("b\n")
    assert p.read_text() == "b\n"


def _writer(path: str, stop_at: float) -> None:
    i = 0
    while time.time() < stop_at:
        files.write_atomic(path, ("A" if i % 2 else "B") * 65536)
        i += 1


def test_concurrent_readers_see_old_or_new_never_torn(tmp_path: Path) -> None:
    p = tmp_path / "f"
    files.write_atomic(p, "A" * 65536)
    proc = multiprocessing.get_context("fork").Process(target=_writer, args=(str(p), time.time() + 1.0))
    proc.start()
    seen = set()
    while proc.is_alive():
        text = p.read_text()
        assert text in ("A" * 65536, "B" * 65536)
        seen.add(text[0])
    proc.join()
    assert proc.exitcode == 0


def _hold(path: str, held: multiprocessing.synchronize.Event, release: multiprocessing.synchronize.Event) -> None:
    with files.locked(path):
        held.set()
        release.wait(10)


def test_locked_excludes_a_second_process_and_times_out(tmp_path: Path) -> None:
    lock = str(tmp_path / "x.lock")
    ctx = multiprocessing.get_context("fork")
    held, release = ctx.Event(), ctx.Event()
    proc = ctx.Process(target=_hold, args=(lock, held, release))
    proc.start()
    try:
        assert held.wait(10)
        t = time.monotonic()
        with pytest.raises(files.LockTimeout, match="still locked"):
            with files.locked(lock, timeout_s=0.3):
                pass
        assert time.monotonic() - t >= 0.3
    finally:
        release.set()
        proc.join(10)
    with files.locked(lock, timeout_s=5):  # free once the holder let go
        pass
    assert Path(lock).exists()  # never removed: a waiter may have it open


def test_a_dead_holder_does_not_keep_the_lock(tmp_path: Path) -> None:
    lock = str(tmp_path / "x.lock")
    ctx = multiprocessing.get_context("fork")
    held, release = ctx.Event(), ctx.Event()
    proc = ctx.Process(target=_hold, args=(lock, held, release))
    proc.start()
    assert held.wait(10)
    proc.kill()
    proc.join(10)
    with files.locked(lock, timeout_s=5):
        pass


def test_atomic_dir_publishes_whole_and_replaces_whole(tmp_path: Path) -> None:
    out = tmp_path / "model"
    with files.atomic_dir(out) as tmp:
        assert tmp.parent == out.parent and tmp.name.startswith(".model.tmp")
        (tmp / "a.bin").write_bytes(b"v1")
        (tmp / "sub").mkdir()
        (tmp / "sub" / "b.txt").write_text("v1")
        assert not out.exists()  # nothing under the final name until the block ends
    assert (out / "a.bin").read_bytes() == b"v1" and (out / "sub" / "b.txt").read_text() == "v1"
    with files.atomic_dir(out) as tmp:  # a newer folder replaces the old one whole: no file of it stays
        (tmp / "c.bin").write_bytes(b"v2")
    assert sorted(p.name for p in out.iterdir()) == ["c.bin"]
    with pytest.raises(RuntimeError):
        with files.atomic_dir(out) as tmp:
            (tmp / "half").write_bytes(b"x")
            raise RuntimeError("writer died")
    assert sorted(p.name for p in out.iterdir()) == ["c.bin"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model"]  # no staging or set-aside leftovers


def _stage_and_die(path: str) -> None:
    tmp = files.staging_dir(path)
    (tmp / "half.bin").write_bytes(b"x" * 1000)
    os._exit(3)  # killed mid-build: nothing published, nothing cleaned up


def test_a_killed_writer_leaves_the_target_and_its_staging_is_cleared(tmp_path: Path) -> None:
    out = tmp_path / "ckpt"
    with files.atomic_dir(out) as tmp:
        (tmp / "model.pt").write_bytes(b"old")
    proc = multiprocessing.get_context("fork").Process(target=_stage_and_die, args=(str(out),))
    proc.start()
    proc.join(10)
    assert proc.exitcode == 3
    assert sorted(p.name for p in out.iterdir()) == ["model.pt"]  # untouched
    stale = [p.name for p in tmp_path.iterdir() if p.name != "ckpt"]
    assert stale == [f".ckpt.tmp{proc.pid}"]
    assert [p.name for p in files.remove_stale_staging(out)] == stale
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]
    staged = files.staging_dir(out)  # filled by "another process", then published
    (staged / "model.pt").write_bytes(b"new")
    files.publish_dir(staged, out)
    assert (out / "model.pt").read_bytes() == b"new" and sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]
