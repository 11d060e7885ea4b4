"""The image: build it from apptainer.def, stage it onto node-local disk, verify its stack.

- ``build``: ``apptainer build`` with the Miles tag as a build argument, its cache and temp dirs on
  local disk, and a ``.sha256`` file beside the image. For pyxis sites (``--runtime enroot``) the
  same def file is the recipe, applied with enroot (:func:`enroot_build_commands`).
- ``stage``: copy the image once per node to node-local disk, checking the sha256 while copying, so
  hundreds of ranks do not read one SIF from Lustre/GPFS at once; a valid copy already there is
  reused, older staged versions are removed, concurrent stagers on one node take turns on a lock.
- ``verify``: import and version-check the stack the recipe needs; the image's ``%test`` runs it.

Neither Apptainer nor enroot can be installed where this project is tested: ``build`` is tested up
to the command lines it runs and the clear error when the binary is missing
(tests/node/test_apptainer_def.py, tests/node/test_image_enroot.py).
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.metadata
import logging
import os
import re
import shlex
import shutil
import subprocess
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from beam_hpc import files
from beam_hpc.errors import InputError, RuntimeFailure, shorten
from beam_hpc.files import atomic_path, locked, write_atomic

log = logging.getLogger(__name__)

DEFAULT_DEF = "apptainer.def"
DEFAULT_OUTPUT = "beam.sif"
TAG_ARG = "MILES_TAG"  # the def file's %arguments name for the Miles image tag
CHUNK = 8 << 20
# (module, distribution, minimum version): what the recipe's processes import inside the image
REQUIRED_STACK: tuple[tuple[str, str, str | None], ...] = (
    ("torch", "torch", None),
    ("megatron.core", "megatron-core", None),
    ("sglang", "sglang", None),
    ("ray", "ray", "2.52"),  # token authentication
    ("deepspeed", "deepspeed", None),
)


class ImageError(RuntimeFailure):
    """The image cannot be built, staged or used; the message says what to do."""


class ImagePathError(ImageError, InputError):
    """A path given to build or stage is missing or of the wrong kind: bad input (exit 2, as for
    every other path), still an :class:`ImageError` for callers that catch those."""

    exit_code = InputError.exit_code


# -- build ------------------------------------------------------------------------------------------
def apptainer_binary(name: str = "apptainer") -> str:
    path = shutil.which(name)
    if path is None:
        raise ImageError(
            f"{name} not found on PATH: load it (e.g. `module load apptainer`) or install it "
            "(https://apptainer.org/docs/admin/main/installation.html); images are built on a machine "
            "that has Apptainer and the network, then copied to shared storage"
        )
    return path


def build_command(def_file: str | Path, output: str | Path, *, apptainer: str = "apptainer",
                  tag: str | None = None, force: bool = False) -> list[str]:
    cmd = [apptainer, "build"]
    if force:
        cmd.append("--force")
    if tag:
        cmd += ["--build-arg", f"{TAG_ARG}={tag}"]
    return cmd + [str(output), str(def_file)]


def build_env(base: Mapping[str, str], local_dir: str | Path) -> dict[str, str]:
    """Cache and temp dirs on local disk, unless the user chose them already: Apptainer defaults
    them to $HOME and /tmp, and a home directory on a network filesystem makes a multi-GB build
    crawl or fail."""
    env = dict(base)
    for var, sub in (("APPTAINER_CACHEDIR", "cache"), ("APPTAINER_TMPDIR", "tmp")):
        if not env.get(var):
            d = Path(local_dir, sub)
            d.mkdir(parents=True, exist_ok=True)
            env[var] = str(d)
    return env


def default_local_dir() -> Path:
    return Path("/tmp", f"beam-apptainer-{os.getuid()}")


def build_image(def_file: str | Path = DEFAULT_DEF, output: str | Path = DEFAULT_OUTPUT, *,
                tag: str | None = None, local_dir: str | Path | None = None, force: bool = False) -> Path:
    """Build the image; returns its path. ``%files`` paths in the def file are relative to the
    def file's directory, so the build runs there."""
    def_path, out = _checked_paths(def_file, output, example="beam.sif")
    cmd = build_command(def_path, out, apptainer=apptainer_binary(), tag=tag, force=force)
    env = build_env(os.environ, local_dir or default_local_dir())
    log.info("building %s: %s", out, " ".join(cmd))
    res = subprocess.run(cmd, cwd=def_path.parent, env=env, check=False)
    if res.returncode != 0:
        raise ImageError(f"apptainer build failed with exit code {res.returncode}; its output is above")
    write_checksum(out)
    return out


# -- build for enroot (pyxis sites) -----------------------------------------------------------------
ENROOT = "enroot"
DEFAULT_SQUASHFS = "beam.sqsh"
SOURCE_MOUNT = "/mnt/beam-hpc-source"  # the def file's directory inside the build container, read-only


@dataclass(frozen=True)
class DefRecipe:
    """What an enroot build takes from the def file: the base image and the three sections."""

    base: str  # the ``From:`` image with its {{ NAME }} arguments filled in
    files: tuple[tuple[str, str], ...]  # (source relative to the def file, destination in the image)
    post: str
    environment: tuple[str, ...]  # ``NAME=value`` lines for the image's /etc/environment


def read_def(def_file: str | Path, *, tag: str | None = None) -> DefRecipe:
    """The parts of an Apptainer definition file an enroot build applies; ``{{ NAME }}`` is filled
    from ``tag`` (for MILES_TAG) or the file's ``%arguments``, as ``apptainer build`` fills it."""
    header: dict[str, str] = {}
    sections: dict[str, list[str]] = {}
    current: str | None = None
    for raw in Path(def_file).read_text().splitlines():
        if raw.startswith("%"):
            current = raw[1:].split()[0]
            sections[current] = []
        elif current is None:
            key, _, value = raw.partition(":")
            if key.strip() and not key.startswith("#"):
                header[key.strip()] = value.strip()
        else:
            sections[current].append(raw)
    args = dict(line.strip().split("=", 1) for line in sections.get("arguments", []) if "=" in line)
    if tag:
        args[TAG_ARG] = tag

    def fill_args(text: str) -> str:
        return re.sub(r"\{\{\s*(\w+)\s*\}\}", lambda m: args.get(m[1], m[0]), text)

    if header.get("Bootstrap") != "docker" or not header.get("From"):
        raise ImagePathError(f"--def: {shorten(str(def_file))}: an enroot build needs `Bootstrap: docker` and `From:`")
    files = []
    for line in sections.get("files", []):
        parts = line.split("#", 1)[0].split()
        if parts:
            files.append((parts[0], parts[1] if len(parts) > 1 else parts[0]))
    env = tuple(line.strip().removeprefix("export ").strip() for line in sections.get("environment", [])
                if "=" in line and not line.strip().startswith("#"))
    return DefRecipe(fill_args(header["From"]), tuple(files), fill_args("\n".join(sections.get("post", []))), env)


def enroot_build_script(recipe: DefRecipe) -> str:
    """The build container's command script: ``%files`` copied in from the read-only source mount,
    ``%post`` run as root (remapped), ``%environment`` appended to the image's /etc/environment."""
    lines = ["#!/bin/sh", "set -e"]
    for src, dst in recipe.files:
        lines += [f"mkdir -p {shlex.quote(str(Path(dst).parent))}",
                  f"cp -R {shlex.quote(f'{SOURCE_MOUNT}/{src}')} {shlex.quote(dst)}"]
    lines += ["(", recipe.post, ")"]
    lines += [f"echo {shlex.quote(e)} >> /etc/environment" for e in recipe.environment]
    return "\n".join(lines) + "\n"


def enroot_build_commands(def_file: str | Path, output: str | Path, work_dir: str | Path, *,
                          enroot: str = ENROOT, tag: str | None = None, force: bool = False,
                          name: str = "beam-image-build") -> list[list[str]]:
    """The enroot commands of a build, in order (enroot's documented usage, NVIDIA/enroot doc/cmd):
    import the base image to a squashfs, create a container from it, start it writable and
    remapped to root with the build script, export it to ``output``. ``work_dir/build.rc`` must
    hold :func:`enroot_build_script`'s text; ``enroot remove --force NAME`` ends every build."""
    def_path = Path(def_file).resolve()
    recipe = read_def(def_path, tag=tag)
    base = Path(work_dir, "base.sqsh")
    return [
        [enroot, "import", "--output", str(base), f"docker://{recipe.base}"],
        [enroot, "create", "--force", "--name", name, str(base)],
        [enroot, "start", "--root", "--rw", "--mount", f"{def_path.parent}:{SOURCE_MOUNT}:none:x-create=dir,bind,ro",
         "--rc", str(Path(work_dir, "build.rc")), name],
        [enroot, "export", *(["--force"] if force else []), "--output", str(output), name],
    ]


def enroot_env(base: Mapping[str, str], local_dir: str | Path) -> dict[str, str]:
    """enroot's cache, data (the build container) and temp dirs on local disk, unless set already."""
    env = dict(base)
    for var, sub in (("ENROOT_CACHE_PATH", "cache"), ("ENROOT_DATA_PATH", "data"), ("ENROOT_TEMP_PATH", "tmp")):
        if not env.get(var):
            d = Path(local_dir, sub)
            d.mkdir(parents=True, exist_ok=True)
            env[var] = str(d)
    return env


def build_enroot_image(def_file: str | Path = DEFAULT_DEF, output: str | Path = DEFAULT_SQUASHFS, *,
                       tag: str | None = None, local_dir: str | Path | None = None, force: bool = False,
                       dry_run: bool = False, echo: Callable[[str], None] = print) -> Path:
    """Build the squashfs for pyxis from the def file (:func:`enroot_build_commands`). ``dry_run``:
    print the commands (and the build script) for a machine with enroot, run nothing."""
    def_path, out = _checked_paths(def_file, output, example="beam.sqsh")
    if out.exists() and not force and not dry_run:
        raise ImagePathError(f"--output: {shorten(str(out))} exists; pass --force to overwrite it")
    work = Path(local_dir or Path("/tmp", f"beam-enroot-{os.getuid()}"))
    script = enroot_build_script(read_def(def_path, tag=tag))
    enroot = ENROOT if dry_run else shutil.which(ENROOT)
    if enroot is None:
        raise ImageError("enroot not found on PATH: build on a machine with enroot (a compute node of the pyxis "
                         "cluster, e.g. in `srun --pty bash`), or pass --dry-run to print the commands")
    cmds = enroot_build_commands(def_path, out, work, enroot=enroot, tag=tag, force=force)
    if dry_run:
        echo(f"# write this to {work}/build.rc:\n{script}")
        for cmd in cmds:
            echo(shlex.join(cmd))
        echo(shlex.join([ENROOT, "remove", "--force", cmds[1][4]]))
        return out
    work.mkdir(parents=True, exist_ok=True)
    write_atomic(work / "build.rc", script)
    (work / "build.rc").chmod(0o755)
    env = enroot_env(os.environ, work)
    try:
        for cmd in cmds:
            log.info("%s", shlex.join(cmd))
            res = subprocess.run(cmd, env=env, check=False)
            if res.returncode != 0:
                raise ImageError(f"{shlex.join(cmd[:2])} failed with exit code {res.returncode}; its output is above")
    finally:
        subprocess.run([enroot, "remove", "--force", cmds[1][4]], env=env, check=False, capture_output=True)
    write_checksum(out)
    return out


def _checked_paths(def_file: str | Path, output: str | Path, *, example: str) -> tuple[Path, Path]:
    def_path = Path(def_file).resolve()
    if not def_path.is_file():
        raise ImagePathError(f"--def: {shorten(str(def_file))} is not a definition file "
                             f"({'a directory' if def_path.is_dir() else 'no such file'}; the repository ships apptainer.def)")
    out = Path(output).resolve()
    if out.is_dir():
        raise ImagePathError(f"--output: {shorten(str(output))} is a directory; give the image's file name, e.g. {example}")
    if not out.parent.is_dir():
        raise ImagePathError(f"--output: {shorten(str(out.parent))} is not a directory; create it first")
    return def_path, out


# -- checksums and staging --------------------------------------------------------------------------
def sha256_file(path: str | Path) -> str:
    return files.sha256_file(path, CHUNK)


def _sidecar(image: Path) -> Path:
    return image.with_name(image.name + ".sha256")


def write_checksum(image: str | Path, digest: str | None = None) -> str:
    """``<image>.sha256`` in sha256sum's format, written atomically."""
    p = Path(image)
    digest = digest or sha256_file(p)
    write_atomic(_sidecar(p), f"{digest}  {p.name}\n")
    return digest


def recorded_checksum(image: Path) -> str | None:
    try:
        return _sidecar(image).read_text().split()[0]
    except (OSError, IndexError):
        return None


@dataclass(frozen=True)
class StageResult:
    path: Path
    copied: bool  # False: a valid copy was already there
    removed: tuple[Path, ...]  # older staged versions of the same image


def stage(src: str | Path, dest_dir: str | Path) -> StageResult:
    """Copy ``src`` into ``dest_dir`` as ``<stem>-<sha12>.sif``, verified, once per node."""
    source = Path(src)
    if not source.is_file():
        what = "is a directory, not an image" if source.is_dir() else "does not exist"
        raise ImagePathError(f"container.image: {shorten(str(source))} {what}; build it with `beam-hpc image build`")
    dest_root = Path(dest_dir)
    for p in (dest_root, *dest_root.parents):
        if p.exists() and not p.is_dir():
            raise ImagePathError(f"--dest: {shorten(str(dest_dir))} is not a directory ({shorten(str(p))} is a "
                                 "file); give node-local disk, e.g. /tmp/beam-images")
    dest_root.mkdir(parents=True, exist_ok=True)
    expected = recorded_checksum(source) or _known_digest(dest_root, source) or sha256_file(source)
    dest = dest_root / f"{source.stem}-{expected[:12]}{source.suffix or '.sif'}"
    with locked(dest_root / ".stage.lock"):
        removed = tuple(_remove_older(dest_root, source, keep=dest))
        if _valid_copy(dest, expected):
            _remember_digest(dest_root, source, expected)
            return StageResult(dest, False, removed)
        h = hashlib.sha256()
        with atomic_path(dest) as tmp:  # published only once the checksum matched
            with open(source, "rb") as fin, open(tmp, "wb") as fout:
                for block in iter(lambda: fin.read(CHUNK), b""):
                    h.update(block)
                    fout.write(block)
            if h.hexdigest() != expected:
                raise ImageError(f"{source}: sha256 {h.hexdigest()} does not match its recorded {expected}; "
                                 "the image changed or was damaged: rebuild it or remove its .sha256 file")
        st = dest.stat()
        write_atomic(_marker(dest), f"{expected} {st.st_size} {st.st_mtime_ns}\n")
        _remember_digest(dest_root, source, expected)
        return StageResult(dest, True, removed)


def _source_record(dest_root: Path, source: Path) -> Path:
    key = hashlib.sha256(str(source.resolve()).encode()).hexdigest()[:12]
    return dest_root / f".{source.name}-{key}.source"


def _known_digest(dest_root: Path, source: Path) -> str | None:
    """The source image's sha256 as this node verified it before, while the source's size and
    mtime are unchanged. Why: without a ``.sha256`` beside the image, every segment on every node
    would read the whole image from shared storage just to hash it, the very load staging saves."""
    try:
        digest, size, mtime = _source_record(dest_root, source).read_text().split()
        st = source.stat()
    except (OSError, ValueError):
        return None
    return digest if int(size) == st.st_size and int(mtime) == st.st_mtime_ns else None


def _remember_digest(dest_root: Path, source: Path, digest: str) -> None:
    st = source.stat()
    write_atomic(_source_record(dest_root, source), f"{digest} {st.st_size} {st.st_mtime_ns}\n")


def staging_summary(site_container: object, scratch: str | None) -> tuple[str, str, str]:
    """(status, detail, fix) for ``doctor``: whether every node reads the image from shared
    storage, or copies it once to local scratch, verified, and reuses it."""
    image = getattr(site_container, "image", None) or ""
    if not getattr(site_container, "stage_to_local", False):
        return ("warn", f"every node reads {image} from shared storage in every segment",
                "set container.stage_to_local: true (and scratch:) to copy it once per node, verified by sha256")
    if not scratch:
        return ("fail", "container.stage_to_local is set but the site has no scratch (node-local disk)",
                "set scratch: to a node-local directory, e.g. /scratch")
    digest = recorded_checksum(Path(image))
    how = (f"verified against {Path(image).name}.sha256 ({digest[:12]})" if digest else
           f"verified against the sha256 each node computes once (no {Path(image).name}.sha256 beside the image)")
    return ("pass", f"copied once per node to {Path(scratch, 'beam-images')} and reused by later segments, {how}", "")


def _marker(dest: Path) -> Path:
    return dest.with_name(f".{dest.name}.verified")


def _valid_copy(dest: Path, expected: str) -> bool:
    """A copy counts when its verified checksum, size and mtime (recorded at copy time) still hold;
    re-hashing GBs on every node step would cost more than the copy it saves."""
    try:
        digest, size, mtime = _marker(dest).read_text().split()
        st = dest.stat()
    except (OSError, ValueError):
        return False
    return digest == expected and int(size) == st.st_size and int(mtime) == st.st_mtime_ns


def _remove_older(dest_root: Path, source: Path, keep: Path) -> Iterator[Path]:
    for old in dest_root.glob(f"{source.stem}-*{source.suffix or '.sif'}"):
        if old != keep:
            old.unlink(missing_ok=True)
            _marker(old).unlink(missing_ok=True)
            yield old


# -- verify -----------------------------------------------------------------------------------------
@dataclass(frozen=True)
class StackCheck:
    module: str
    version: str | None  # None: not importable
    minimum: str | None
    error: str | None

    @property
    def ok(self) -> bool:
        return self.error is None


def version_tuple(text: str) -> tuple[int, ...]:
    """Leading numeric parts: '2.60.0rc1+cu12' -> (2, 60, 0)."""
    parts = []
    for piece in text.split("+")[0].split("."):
        m = re.match(r"\d+", piece)
        if not m:
            break
        parts.append(int(m.group()))
        if m.end() != len(piece):  # a pre-release suffix ends the numeric part
            break
    return tuple(parts)


def verify_stack(required: Sequence[tuple[str, str, str | None]] = REQUIRED_STACK) -> list[StackCheck]:
    """Import every module of the stack and check minimum versions (heavy imports, on purpose)."""
    out = []
    for module, dist, minimum in required:
        try:
            mod = importlib.import_module(module)
        except Exception as err:  # noqa: BLE001 - any import failure means the image is broken
            out.append(StackCheck(module, None, minimum, f"cannot import {module}: {type(err).__name__}: {err}"))
            continue
        try:
            version = importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            version = str(getattr(mod, "__version__", "unknown"))
        error = None
        if minimum and (version == "unknown" or version_tuple(version) < version_tuple(minimum)):
            error = f"{module} {version} is older than the required {minimum}"
        out.append(StackCheck(module, version, minimum, error))
    return out
