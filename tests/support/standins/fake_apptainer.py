"""A stand-in for the `apptainer` binary, which cannot be installed where the tests run.

It accepts exactly the documented grammar of the options beam-hpc uses or must avoid (the contract at
the top of tests/node/test_container.py: ``exec``, ``--nv``, ``--bind src[:dest[:opts]]``,
``--contain``/``-c``, ``--containall``/``-C``, ``--no-home``, then an existing image and the command),
rejects anything else, and execs the command on the host with Apptainer's view of the filesystem and
environment.

What Apptainer does that beam-hpc depends on (apptainer/apptainer 917d665,
internal/pkg/runtime/engine/apptainer/container_linux.go: addTmpMount, addHomeMount, createCwdDir;
apptainer.conf's "mount home = yes" and "mount tmp = yes" defaults):
- By default it binds the user's $HOME, the current directory, /tmp and /var/tmp (and /proc, /sys,
  /dev) from the host. ``--contain`` gives empty /tmp, /var/tmp and $HOME instead (and leaves the
  current directory unbound); ``--containall`` is ``--contain`` and more; ``--no-home`` leaves $HOME out.
- ``--bind src[:dest[:opts]]`` mounts host paths (``ro`` read-only), on top of those.
- The host environment is passed in, the image's variables win over the host's, and
  ``APPTAINERENV_X=v`` sets X=v over both.

Here the "container" is a private mount namespace of the host's filesystem (there is no image root
filesystem): the default binds are the host's own paths, and ``--contain``/``--no-home`` cover /tmp,
/var/tmp and $HOME with empty tmpfs; binds then go on top (a target outside those that the host lacks
is not made: listed as unmounted). The checkout and its venv stand for the image's own files (Python
and beam-hpc, which a real image carries in its root filesystem): where they live under a covered
path (a clone under /tmp), they are shown again there. It needs root only where something must be mounted. With
``FAKE_APPTAINER_RECORD=DIR`` it writes, per exec, what it got (binds, image, command) and which of
the paths named in ``FAKE_APPTAINER_PROBE`` (os.pathsep-separated) exist inside, to DIR.
"""

from __future__ import annotations

import sys
from pathlib import Path

FAKE_APPTAINER = r'''#!{python}
import ctypes, os, stat, sys
IMAGE_ENV = {{"RAY_AUTH_MODE": "disabled", "IMAGE_ONLY": "from-image"}}  # as a Dockerfile ENV would
IMAGE_FILES = {image_files!r}  # what stands for the image's own files (Python, beam-hpc): never covered
CLONE_NEWNS, MS_RDONLY, MS_NOSUID, MS_NODEV, MS_REMOUNT, MS_BIND, MS_REC, MS_SLAVE = (
    0x20000, 1, 2, 4, 32, 4096, 16384, 1 << 19)
AT_FDCWD, OPEN_TREE_CLONE, O_CLOEXEC, AT_RECURSIVE, MOVE_MOUNT_F_EMPTY_PATH = -100, 1, 0o2000000, 0x8000, 4
args = sys.argv[1:]
if not args or args[0] != "exec":
    sys.exit("fake apptainer: only `exec` is in the contract")
args = args[1:]
binds, nv, contain, no_home = [], False, False, False
while args and args[0].startswith("-"):
    opt = args.pop(0)
    if opt == "--nv":
        nv = True
    elif opt in ("--contain", "-c", "--containall", "-C"):
        contain = True
    elif opt == "--no-home":
        no_home = True
    elif opt in ("--bind", "-B"):
        spec = args.pop(0)
        for b in spec.split(","):
            parts = b.split(":")
            if not 1 <= len(parts) <= 3 or not os.path.isabs(parts[0]):
                sys.exit(f"fake apptainer: bad bind {{b!r}}")
            if not os.path.exists(parts[0]):
                sys.exit(f"fake apptainer: bind source {{parts[0]}} does not exist")
            binds.append(b)
    else:
        sys.exit(f"fake apptainer: option {{opt}} is not in the contract")
image, command = args[0], args[1:]
if not os.path.isfile(image):
    sys.exit(f"fake apptainer: image {{image}} not found")
home = os.path.expanduser("~")
cwd = os.getcwd()
covered = (["/tmp", "/var/tmp"] if contain else []) + ([home] if contain or no_home else [])


def under(path, roots):
    return any(path == r or path.startswith(r.rstrip("/") + "/") for r in roots)


def mount(src, dst, fstype, flags, data=None):
    if libc.mount(src and src.encode(), dst.encode(), fstype and fstype.encode(), flags, data and data.encode()) != 0:
        err = ctypes.get_errno()
        sys.exit(f"fake apptainer: mount {{src}} on {{dst}}: {{os.strerror(err)}}")


unmounted = []
plan = []  # (source, target, read-only) of binds that change what the process sees
# The image's own files are in its root filesystem, not in the host's /tmp or $HOME: where this
# checkout or its venv lives under a covered path, it is shown again there, as the image would be.
plan += [(f, f, False) for f in IMAGE_FILES if under(f, covered) and os.path.exists(f)]
for b in binds:
    src, dst, opts = (b.split(":") + ["", ""])[:3]
    dst = dst or src
    if dst == src and "ro" not in opts.split(",") and not under(dst, covered):
        continue  # the host's path, already there
    if not under(dst, covered) and not os.path.exists(dst):
        unmounted.append(b)  # no image filesystem to create the target in
        continue
    plan.append((src, dst, "ro" in opts.split(",")))
record = os.environ.get("FAKE_APPTAINER_RECORD")  # a directory: one JSON file per exec, for the tests
if record:  # opened before /tmp or $HOME may be covered
    import json, socket
    record_fh = open(os.path.join(record, f"{{socket.gethostname()}}.{{os.getpid()}}.json"), "w")
if covered or plan:
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.unshare(CLONE_NEWNS) != 0:
        sys.exit(f"fake apptainer: a private mount namespace needs root: {{os.strerror(ctypes.get_errno())}}")
    mount(None, "/", None, MS_REC | MS_SLAVE)
    # detached copies of the sources (open_tree), taken before /tmp or $HOME is covered
    fds = [libc.open_tree(AT_FDCWD, src.encode(), OPEN_TREE_CLONE | O_CLOEXEC | AT_RECURSIVE) for src, _, _ in plan]
    if min(fds, default=0) < 0:
        sys.exit(f"fake apptainer: open_tree: {{os.strerror(ctypes.get_errno())}}")
    for path in covered:
        if os.path.isdir(path):
            mount("tmpfs", path, "tmpfs", MS_NOSUID | MS_NODEV, "mode=1777")
    for fd, (src, dst, ro) in zip(fds, plan):
        if not os.path.exists(dst):  # a target below an empty /tmp or $HOME (judged by the source's fd)
            os.makedirs(dst if stat.S_ISDIR(os.fstat(fd).st_mode) else os.path.dirname(dst), exist_ok=True)
            if not os.path.exists(dst):
                open(dst, "a").close()
        if libc.move_mount(fd, b"", AT_FDCWD, dst.encode(), MOVE_MOUNT_F_EMPTY_PATH) != 0:
            sys.exit(f"fake apptainer: mount {{src}} on {{dst}}: {{os.strerror(ctypes.get_errno())}}")
        if ro:
            mount(None, dst, None, MS_REMOUNT | MS_BIND | MS_RDONLY)
    os.chdir(cwd if not contain and os.path.isdir(cwd) else (home if os.path.isdir(home) else "/"))
env = {{k: v for k, v in os.environ.items() if not k.startswith("APPTAINERENV_")}}
env.update(IMAGE_ENV)
env.update({{k[len("APPTAINERENV_"):]: v for k, v in os.environ.items() if k.startswith("APPTAINERENV_")}})
env["FAKE_APPTAINER_BINDS"] = ",".join(binds)
env["FAKE_APPTAINER_NV"] = str(nv)
env["FAKE_APPTAINER_IMAGE"] = image  # which image ran: the tests check it is the node-local copy
if record:
    probe = [p for p in os.environ.get("FAKE_APPTAINER_PROBE", "").split(os.pathsep) if p]
    with record_fh as fh:
        json.dump({{"node": socket.gethostname(), "binds": binds, "image": image, "argv": command,
                   "unmounted": unmounted, "seen": {{p: os.path.exists(p) for p in probe}}}}, fh)
os.execvpe(command[0], command, env)
'''


def install_fake_apptainer(bin_dir: Path) -> Path:
    """Write the stand-in as ``bin_dir/apptainer``; put ``bin_dir`` first on PATH to use it."""
    bin_dir.mkdir(parents=True, exist_ok=True)
    fake = bin_dir / "apptainer"
    repo = Path(__file__).resolve().parents[3]
    image_files = sorted({str(repo), sys.prefix, sys.base_prefix})
    fake.write_text(FAKE_APPTAINER.format(python=sys.executable, image_files=image_files))
    fake.chmod(0o755)
    return bin_dir
