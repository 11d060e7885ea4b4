"""beam_hpc.node.image staging: a real copy to a node-local directory, sha256-checked, once per node."""

from __future__ import annotations

import os

import pytest

from beam_hpc.node.image import ImageError, recorded_checksum, sha256_file, stage, write_checksum


def _image(path, payload: bytes):
    path.write_bytes(payload)
    write_checksum(path)
    return path


def test_stage_copies_once_verifies_and_replaces_older_versions(tmp_path):
    shared, local = tmp_path / "shared", tmp_path / "local"
    shared.mkdir()
    sif = _image(shared / "beam.sif", os.urandom(3 << 20))
    first = stage(sif, local)
    digest = recorded_checksum(sif)
    assert first.copied and first.path == local / f"beam-{digest[:12]}.sif"
    assert sha256_file(first.path) == digest == sha256_file(sif)
    again = stage(sif, local)
    assert not again.copied and again.path == first.path  # already there and valid: skipped

    _image(sif, os.urandom(1 << 20))  # a rebuilt image
    newer = stage(sif, local)
    assert newer.copied and newer.path != first.path and newer.removed == (first.path,)
    assert sorted(p.name for p in local.iterdir() if not p.name.startswith(".")) == [newer.path.name]


def test_a_damaged_local_copy_is_copied_again(tmp_path):
    sif = _image(tmp_path / "beam.sif", b"a" * 4096)
    staged = stage(sif, tmp_path / "local").path
    staged.write_bytes(b"b" * 4096)  # same size, different content and mtime
    assert stage(sif, tmp_path / "local").copied
    assert staged.read_bytes() == b"a" * 4096


def test_a_source_that_no_longer_matches_its_checksum_is_refused(tmp_path):
    sif = _image(tmp_path / "beam.sif", b"original")
    sif.write_bytes(b"tampered")
    with pytest.raises(ImageError, match="does not match its recorded"):
        stage(sif, tmp_path / "local")
    assert not [p for p in (tmp_path / "local").iterdir() if p.suffix == ".sif"]


def test_missing_image_names_the_setting(tmp_path):
    with pytest.raises(ImageError, match="container.image: .* does not exist"):
        stage(tmp_path / "nope.sif", tmp_path / "local")


def test_without_a_checksum_file_a_node_hashes_the_source_once_then_trusts_its_record(tmp_path):
    """No .sha256 beside the image: the first stage hashes it (while copying, verified); later
    segments on the node reuse the copy without reading the whole image from shared storage again,
    as long as the source's size and mtime are those it hashed."""
    sif = tmp_path / "beam.sif"
    sif.write_bytes(b"a" * 4096)
    first = stage(sif, tmp_path / "local")
    assert first.copied and recorded_checksum(sif) is None
    st = sif.stat()
    sif.write_bytes(b"b" * 4096)  # same size; mtime put back: only a re-hash could tell
    os.utime(sif, ns=(st.st_atime_ns, st.st_mtime_ns))
    again = stage(sif, tmp_path / "local")
    assert not again.copied and again.path == first.path
    sif.write_bytes(b"c" * 4096)  # a real change moves the mtime: hashed again, copied again
    assert stage(sif, tmp_path / "local").copied
