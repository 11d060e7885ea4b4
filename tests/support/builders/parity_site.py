"""The launch-parity site: env/local.yaml with everything a site can give a batch job.

A ``module`` shell function defined by the site's ``setup`` (as ``source
/etc/profile.d/modules.sh`` would define it: a batch shell is not a login shell), a module load,
environment, and an extra ``#SBATCH`` line. Every batch script beam-hpc writes must get past these
lines: the run's own jobs (tests/submission/test_submission_launch_parity.py) and the conversion
job (tests/backends/miles/test_miles_convert.py).
"""

from __future__ import annotations

import json
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
MODULE = "beamtest/1.0"
SITE_ENV = {"BEAM_PARITY_SITE": "from-the-site", "NCCL_NVLS_ENABLE": "0", "BEAM_MODULE_RAN": "no"}
# what the job must see: the site's env, with BEAM_MODULE_RAN turned to "yes" by the module function
# in this very batch shell (the site's env resets it first, so a value inherited from an earlier
# segment's environment does not count)
SEEN_ENV = {**SITE_ENV, "BEAM_MODULE_RAN": "yes"}
COMMENT = "beam-parity"


def parity_site(path: Path, env: dict[str, str] | None = None) -> Path:
    """env/local.yaml plus a module function, a module load, environment (``SITE_ENV``, then
    ``env``) and an extra #SBATCH line, written to ``path``."""
    text = (REPO / "env" / "local.yaml").read_text().replace("name: local", "name: parity")
    text += (
        "setup:\n"
        # like Environment Modules / Lmod: LOADEDMODULES lists each module once, loading twice is a no-op
        "  - 'module() { if [ \"$1\" = load ]; then export BEAM_MODULE_RAN=yes; case \":$LOADEDMODULES:\" in "
        "*\":$2:\"*) ;; *) export LOADEDMODULES=\"${LOADEDMODULES:+$LOADEDMODULES:}$2\";; esac; fi; }'\n"
        f"module_loads: [{MODULE}]\n"
        f"env: {json.dumps({**SITE_ENV, **(env or {})})}\n"
        f"sbatch_extra: [--comment={COMMENT}]\n"
    )
    path.write_text(text)
    return path
