"""A stand-in for the `apptainer` binary, which cannot be installed where the tests run.

It accepts exactly the documented grammar of the options beam-hpc uses (the contract at the top of
tests/node/test_container.py: ``exec``, ``--nv``, ``--bind src[:dest[:opts]]``, then an existing image
and the command), rejects anything else, applies the documented environment rules (the image's
variables over the host's, ``APPTAINERENV_X`` over both) and execs the command on the host. With
``FAKE_APPTAINER_RECORD=DIR`` it also writes what each exec got (binds, image, command) to DIR.
"""

from __future__ import annotations

import sys
from pathlib import Path

FAKE_APPTAINER = r'''#!{python}
import os, sys
IMAGE_ENV = {{"RAY_AUTH_MODE": "disabled", "IMAGE_ONLY": "from-image"}}  # as a Dockerfile ENV would
args = sys.argv[1:]
if not args or args[0] != "exec":
    sys.exit("fake apptainer: only `exec` is in the contract")
args = args[1:]
binds, nv = [], False
while args and args[0].startswith("-"):
    opt = args.pop(0)
    if opt == "--nv":
        nv = True
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
env = {{k: v for k, v in os.environ.items() if not k.startswith("APPTAINERENV_")}}
env.update(IMAGE_ENV)
env.update({{k[len("APPTAINERENV_"):]: v for k, v in os.environ.items() if k.startswith("APPTAINERENV_")}})
env["FAKE_APPTAINER_BINDS"] = ",".join(binds)
env["FAKE_APPTAINER_NV"] = str(nv)
env["FAKE_APPTAINER_IMAGE"] = image  # which image ran: the tests check it is the node-local copy
record = os.environ.get("FAKE_APPTAINER_RECORD")  # a directory: one JSON file per exec, for the tests
if record:
    import json, socket
    with open(os.path.join(record, f"{{socket.gethostname()}}.{{os.getpid()}}.json"), "w") as fh:
        json.dump({{"node": socket.gethostname(), "binds": binds, "image": image, "argv": command}}, fh)
os.execvpe(command[0], command, env)
'''




def install_fake_apptainer(bin_dir: Path) -> Path:
    """Write the stand-in as ``bin_dir/apptainer``; put ``bin_dir`` first on PATH to use it."""
    bin_dir.mkdir(parents=True, exist_ok=True)
    fake = bin_dir / "apptainer"
    fake.write_text(FAKE_APPTAINER.format(python=sys.executable))
    fake.chmod(0o755)
    return bin_dir
