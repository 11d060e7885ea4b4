"""The launch-parity site: env/local.yaml with everything a site can give a batch job.

A ``module`` shell function defined by the site's ``setup`` (as ``source
/etc/profile.d/modules.sh`` would define it: a batch shell is not a login shell), a module load,
environment, and an extra ``#SBATCH`` line. Every way beam-hpc starts a job must get past these
lines: the run's own jobs and ``execute`` (tests/submission/test_submission_launch_parity.py) and
the conversion job (tests/backends/miles/test_miles_convert.py).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[4]
MODULE = "beamtest/1.0"
SITE_ENV = {"BEAM_PARITY_SITE": "from-the-site", "NCCL_NVLS_ENABLE": "0", "BEAM_MODULE_RAN": "no"}
# what the job must see: the site's env, with BEAM_MODULE_RAN turned to "yes" by the module function
# in this very batch shell (the site's env resets it first, so a value inherited from an earlier
# segment's environment does not count)
SEEN_ENV = {**SITE_ENV, "BEAM_MODULE_RAN": "yes"}
COMMENT = "beam-parity"
# like Environment Modules / Lmod: LOADEDMODULES lists each module once, loading twice is a no-op
MODULE_FUNCTION = ('module() { if [ "$1" = load ]; then export BEAM_MODULE_RAN=yes; case ":$LOADEDMODULES:" in '
                   '*":$2:"*) ;; *) export LOADEDMODULES="${LOADEDMODULES:+$LOADEDMODULES:}$2";; esac; fi; }')
SITE_LINES = {"setup": [MODULE_FUNCTION], "module_loads": [MODULE], "env": SITE_ENV,
              "sbatch_extra": [f"--comment={COMMENT}"]}


def parity_site(path: Path, env: dict[str, str] | None = None) -> Path:
    """env/local.yaml plus the site lines (``SITE_ENV``, then ``env``), written to ``path``."""
    text = (REPO / "env" / "local.yaml").read_text().replace("name: local", "name: parity")
    lines = {**SITE_LINES, "env": {**SITE_ENV, **(env or {})}}
    path.write_text(text + yaml.safe_dump(lines))  # (spot_site edits the partitions line as written)
    return path


def laptop_parity_site(path: Path) -> Path:
    """`execute`'s built-in laptop site (no GPUs, its own Ray ports) with the same lines."""
    from beam_hpc.cli.execute import LAPTOP_SITE

    path.write_text(yaml.safe_dump({**LAPTOP_SITE, "name": "parity-laptop", "python": sys.executable, **SITE_LINES}))
    return path


# -- what every segment's driver saw (beam_hpc.job.runner writes driver.json in its segment directory) ----
def driver_records(run: Path) -> dict[str, dict]:
    """Each segment's driver.json, by segment name."""
    return {p.parent.name: json.loads(p.read_text()) for p in sorted((run / "logs").glob("*/driver.json"))}


def normalized(argv: list[str], run: Path) -> list[str]:
    """A driver's argv with what differs by run and job taken out: the run directory, the Ray
    address (after --ray-address) and the total (compared on its own). A plan's own argv says
    ``{run_dir}``, ``{ray_address}`` and ``{num_rollout}``: they normalize as the filled values do."""
    out = [a.replace(str(run), "<run>").replace("{run_dir}", "<run>") for a in argv]
    for flag, stand_in in (("--ray-address", "<ray>"), ("--num-rollout", "<total>")):
        out[out.index(flag) + 1] = stand_in
    return out


def check_driver_record(seg: str, rec: dict, run: Path, reference: list[str], total: int) -> None:
    """One segment's driver ran the reference command with ``total``, the site's variables (the
    module function's mark included) and the module loaded once, as the batch shell set them."""
    assert normalized(rec["argv"], run) == reference, (seg, rec["argv"])
    assert rec["num_rollout"] == total and rec["argv"][rec["argv"].index("--num-rollout") + 1] == str(total), seg
    assert rec["site_env"] == SEEN_ENV, (seg, rec["site_env"])
    assert rec["loaded_modules"] == MODULE, (seg, rec["loaded_modules"])
    assert os.environ.get("LOADEDMODULES") != MODULE  # the job's, not inherited from the test's shell


def comment_of(job_id: str) -> str | None:
    out = subprocess.run(["scontrol", "show", "job", "--oneliner", job_id], capture_output=True, text=True,
                         check=False).stdout
    fields = dict(tok.split("=", 1) for tok in out.split() if "=" in tok)
    return fields.get("Comment")


def has_extra_line(job_id: str) -> None:
    """The site's extra ``#SBATCH --comment`` reached the job (checked while Slurm still lists it)."""
    assert comment_of(job_id) == COMMENT, f"the site's extra #SBATCH line did not reach job {job_id}"
