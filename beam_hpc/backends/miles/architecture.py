"""The model's architecture flags for Miles: from the recipe, a Miles model script, or config.json.

Why: Megatron builds the network only from flags (``--num-layers``, ``--hidden-size``, ...), and
Miles compares them with the HF ``config.json`` (``hf_validate_args``) only once the job holds its
nodes and Ray is up; a recipe without them, or with the wrong ones, fails there, after the queue
wait. Here the flags are settled, and compared with ``config.json`` field by field, before anything
is written or allocated: every plan (``backends.registry.plan_for``: ``render``, ``submit``,
``doctor``) builds the Miles command through ``args.build_driver``, which calls :func:`resolve`.

The sources, in order (:func:`resolve`): the recipe's ``model.miles_model_args``, a Miles model
script (``model.miles_model_script``, read through :mod:`beam_hpc.backends.miles.model_script`, or
*deferred* into the job when it cannot be read here), or flags derived from ``config.json``
(:func:`derive_args`). No Miles, Megatron or torch import in this process: a Python model script
runs in a child process (``model_script.run_python_script``).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from beam_hpc.backends.miles.model_script import LoaderMissing, form_of, read_model_script, read_script
from beam_hpc.config.recipe import ModelSpec
from beam_hpc.errors import InputError, shorten

MODEL_SCRIPT_OPTION = "--model-script"  # the launcher's option for a script read inside the job
MODEL_SCRIPT_VAR_OPTION = "--model-script-var"  # NAME=VALUE, repeatable
FAMILIES = ("qwen2", "qwen3", "qwen3_moe", "deepseek_v3", "glm4_moe")
SOURCES_HELP = (
    "give them one of three ways: model.miles_model_args (the flags themselves), "
    "model.miles_model_script (a Miles scripts/models/<name>.py or .sh, e.g. in the image's Miles checkout), "
    "or a readable HF config.json (model.hf_config, else <model.path>/config.json) of a family "
    f"beam-hpc derives them for ({', '.join(FAMILIES)})"
)


@dataclass(frozen=True)
class Architecture:
    """The architecture flags and where they came from.

    ``args`` go into the Plan's Miles argv; ``deferred_script`` is a model script read only inside
    the job (not readable where the Plan was made), with ``script_vars`` for it.
    """

    args: tuple[str, ...]
    source: str
    deferred_script: str | None = None
    script_vars: dict[str, str] = field(default_factory=dict)
    config_path: str | None = None  # the config.json compared with, if any
    script_form: str | None = None  # "python" / "bash" when a model script is the source


# -- derivation from config.json ---------------------------------------------------------------

def _num(v: Any) -> str:
    if isinstance(v, float) and v.is_integer() and abs(v) >= 1:
        return str(int(v))
    return repr(v) if isinstance(v, float) else str(v)


def _layer_freq(layers: int, dense_first: int) -> str:
    """Megatron's ``--moe-layer-freq`` as a Python list expression: dense layers first, then MoE."""
    return f"[0]*{dense_first}+[1]*{layers - dense_first}" if dense_first else f"[1]*{layers}"


def derive_args(config: dict[str, Any], *, where: str = "config.json") -> list[str]:
    """Megatron architecture flags for a supported HF ``config.json``; raises InputError otherwise.

    Only for the families that map cleanly onto Megatron (:data:`FAMILIES`: Qwen2 and Qwen3 dense,
    Qwen3 MoE, DeepSeek-V3, GLM-4.5 MoE); the flag sets follow Miles's and slime's own
    ``scripts/models/*.sh`` for those families, read for facts.
    """
    c = config.get("text_config", config)
    kind = c.get("model_type", "")
    if kind not in FAMILIES:
        raise InputError(
            f"model: {where} has model_type {kind or '(none)'!r}; beam-hpc derives Megatron flags only for "
            f"{', '.join(FAMILIES)}. {SOURCES_HELP[0].upper() + SOURCES_HELP[1:]}"
        )
    try:
        return _DERIVE[kind](c)
    except KeyError as err:
        raise InputError(f"model: {where} ({kind}) lacks {err.args[0]!r}, which the Megatron flags need; "
                         "give them in model.miles_model_args") from None


def _common(c: dict[str, Any]) -> list[str]:
    out = ["--num-layers", _num(c["num_hidden_layers"]), "--hidden-size", _num(c["hidden_size"]),
           "--ffn-hidden-size", _num(c["intermediate_size"]), "--num-attention-heads", _num(c["num_attention_heads"]),
           "--swiglu", "--normalization", "RMSNorm", "--norm-epsilon", _num(c["rms_norm_eps"]),
           "--disable-bias-linear", "--position-embedding-type", "rope",
           "--rotary-base", _num(c.get("rope_theta", (c.get("rope_parameters") or {}).get("rope_theta", 10000))),
           "--vocab-size", _num(c["vocab_size"])]
    if not c.get("tie_word_embeddings", False):
        out.append("--untie-embeddings-and-output-weights")
    return out


def _gqa(c: dict[str, Any]) -> list[str]:
    out = ["--group-query-attention", "--num-query-groups", _num(c["num_key_value_heads"])]
    if "head_dim" in c:
        out += ["--kv-channels", _num(c["head_dim"])]
    return out


def _qwen2(c: dict[str, Any]) -> list[str]:
    return [*_common(c), *_gqa(c), "--add-qkv-bias"]


def _qwen3(c: dict[str, Any]) -> list[str]:
    return [*_common(c), *_gqa(c), "--qk-layernorm"]


def _moe_tail(c: dict[str, Any], experts: int, dense_first: int) -> list[str]:
    return ["--num-experts", _num(experts), "--moe-ffn-hidden-size", _num(c["moe_intermediate_size"]),
            "--moe-router-topk", _num(c["num_experts_per_tok"]),
            "--moe-layer-freq", _layer_freq(c["num_hidden_layers"], dense_first),
            "--moe-token-dispatcher-type", "alltoall", "--moe-grouped-gemm", "--moe-permute-fusion",
            "--moe-router-dtype", "fp32", "--moe-aux-loss-coeff", "0"]


def _qwen3_moe(c: dict[str, Any]) -> list[str]:
    if c.get("mlp_only_layers") or c.get("decoder_sparse_step", 1) != 1:
        raise InputError("model: Qwen3-MoE with mlp_only_layers or decoder_sparse_step != 1 is not derived; "
                         "give the flags in model.miles_model_args")
    return [*_qwen3(c), "--rotary-percent", "1.0", *_moe_tail(c, c["num_experts"], 0),
            "--moe-router-score-function", "softmax", "--moe-token-drop-policy", "probs"]


def _sigmoid_router(c: dict[str, Any]) -> list[str]:
    """The DeepSeek-style router both DeepSeek-V3 and GLM-4.5 use (aux-loss-free expert bias)."""
    return ["--moe-shared-expert-intermediate-size", _num(c["moe_intermediate_size"] * c.get("n_shared_experts", 1)),
            "--moe-router-pre-softmax", "--moe-router-score-function", "sigmoid", "--moe-router-enable-expert-bias",
            "--moe-router-bias-update-rate", "0", "--moe-router-load-balancing-type", "seq_aux_loss",
            "--moe-router-topk-scaling-factor", _num(c.get("routed_scaling_factor", 1.0))]


def _deepseek_v3(c: dict[str, Any]) -> list[str]:
    rope = c.get("rope_scaling") or {}
    out = [*_common(c), "--kv-channels", _num(c["qk_nope_head_dim"]),
           "--multi-latent-attention", "--q-lora-rank", _num(c["q_lora_rank"]), "--kv-lora-rank", _num(c["kv_lora_rank"]),
           "--qk-head-dim", _num(c["qk_nope_head_dim"]), "--qk-pos-emb-head-dim", _num(c["qk_rope_head_dim"]),
           "--v-head-dim", _num(c["v_head_dim"]), "--qk-layernorm",
           "--mscale", _num(float(rope.get("mscale", 1.0))), "--mscale-all-dim", _num(float(rope.get("mscale_all_dim", 1.0))),
           "--attention-softmax-in-fp32", "--no-rope-fusion"]
    if rope.get("factor"):
        out += ["--rotary-scaling-factor", _num(rope["factor"])]
    out += _moe_tail(c, c["n_routed_experts"], c.get("first_k_dense_replace", 0)) + _sigmoid_router(c)
    if c.get("n_group", 1) > 1:
        out += ["--moe-router-num-groups", _num(c["n_group"]), "--moe-router-group-topk", _num(c["topk_group"])]
    return out


def _glm4_moe(c: dict[str, Any]) -> list[str]:
    out = [*_common(c), *_gqa(c), "--rotary-percent", _num(float(c.get("partial_rotary_factor", 1.0)))]
    if c.get("attention_bias"):
        out.append("--add-qkv-bias")
    if c.get("use_qk_norm"):
        out.append("--qk-layernorm")
    return out + _moe_tail(c, c["n_routed_experts"], c.get("first_k_dense_replace", 0)) + _sigmoid_router(c)


_DERIVE = {"qwen2": _qwen2, "qwen3": _qwen3, "qwen3_moe": _qwen3_moe, "deepseek_v3": _deepseek_v3,
           "glm4_moe": _glm4_moe}


# -- comparison with config.json ---------------------------------------------------------------

def flag_values(args: list[str] | tuple[str, ...]) -> dict[str, str | None]:
    """``--flag value`` / ``--flag=value`` / ``--switch`` -> {flag: value or None}; last one wins."""
    out: dict[str, str | None] = {}
    i = 0
    while i < len(args):
        a = args[i]
        if a.startswith("--") and "=" in a:
            k, v = a.split("=", 1)
            out[k] = v
        elif a.startswith("--"):
            nxt = args[i + 1] if i + 1 < len(args) else None
            if nxt is not None and not nxt.startswith("--"):
                out[a] = nxt
                i += 1
            else:
                out[a] = None
        i += 1
    return out


def compare_with_config(args: list[str] | tuple[str, ...], config: dict[str, Any], *, source: str,
                        config_path: str) -> None:
    """Refuse flags that describe another model than ``config.json``, as Miles's ``hf_validate_args``
    would after start-up; the message names the field, both values and the fix.

    Compared: hidden size, attention heads, KV groups, head size, layers, FFN size, MoE FFN size,
    shared-expert size, experts, top-k, vocabulary, and the three that ``hf_validate_args`` also
    checks (RoPE base, RMSNorm epsilon, tied embeddings)."""
    c = config.get("text_config", config)
    f = flag_values(args)
    mla = "--multi-latent-attention" in f
    heads = f.get("--num-attention-heads")
    groups = f.get("--num-query-groups") if "--group-query-attention" in f else heads
    experts_key = "num_experts" if "num_experts" in c else "n_routed_experts"
    checks: list[tuple[str, str, str | None]] = [
        ("hidden_size", "--hidden-size", f.get("--hidden-size")),
        ("num_attention_heads", "--num-attention-heads", heads),
        ("num_hidden_layers", "--num-layers", f.get("--num-layers")),
        ("intermediate_size", "--ffn-hidden-size", f.get("--ffn-hidden-size")),
    ]
    if not mla:
        checks.append(("num_key_value_heads", "--num-query-groups", groups))
        if "head_dim" in c:
            checks.append(("head_dim", "--kv-channels", f.get("--kv-channels")))
    if experts_key in c and c[experts_key]:
        checks += [(experts_key, "--num-experts", f.get("--num-experts")),
                   ("moe_intermediate_size", "--moe-ffn-hidden-size", f.get("--moe-ffn-hidden-size")),
                   ("num_experts_per_tok", "--moe-router-topk", f.get("--moe-router-topk"))]
        if c.get("n_shared_experts") and "--moe-shared-expert-intermediate-size" in f:
            checks.append(("n_shared_experts x moe_intermediate_size", "--moe-shared-expert-intermediate-size",
                           f["--moe-shared-expert-intermediate-size"]))
    optional = [("vocab_size", "--vocab-size"), ("rope_theta", "--rotary-base"), ("rms_norm_eps", "--norm-epsilon")]
    checks += [(k, flag, f[flag]) for k, flag in optional if flag in f]
    errors = []
    for key, flag, given in checks:
        want = (c["moe_intermediate_size"] * c["n_shared_experts"] if key.startswith("n_shared")
                else c.get(key))
        if want is None:
            continue
        if given is None or not _same(want, given):
            shown = "not given" if given is None else f"{flag} {given}"
            errors.append(f"{key} in {config_path} is {_num(want)} but {shown}")
    tied = bool(c.get("tie_word_embeddings", False))
    # absent: the default is the model class's own (True in transformers' base class, False in
    # Qwen2's), which a bare config.json does not say, so there is nothing to compare with
    if "tie_word_embeddings" in c and tied == ("--untie-embeddings-and-output-weights" in f):
        errors.append(f"tie_word_embeddings in {config_path} is {str(tied).lower()} but "
                      f"--untie-embeddings-and-output-weights is {'given' if tied else 'not given'}")
    if errors:
        raise InputError(
            f"model architecture flags from {source} do not describe the model of {config_path}: "
            + "; ".join(errors)
            + ". Fix: correct those flags in " + source.split(" (")[0]
            + ", or point model.path / model.hf_config at the model they describe (Miles's hf_validate_args "
            "would stop the run at start-up, after the allocation, with the same complaint)"
        )


def _same(want: Any, given: str) -> bool:
    try:
        if isinstance(want, bool):
            return str(want).lower() == given.lower()
        if isinstance(want, int):
            return int(given) == want
        return float(given) == float(want)
    except ValueError:
        return False


# -- resolution --------------------------------------------------------------------------------

def config_path(model: ModelSpec) -> Path:
    """Where the model's HF config.json is: ``model.hf_config``, else ``<model.path>/config.json``."""
    if model.hf_config:
        p = Path(model.hf_config)
        return p / "config.json" if p.is_dir() else p
    return Path(model.path) / "config.json"


def read_config(model: ModelSpec) -> tuple[dict[str, Any] | None, str]:
    """(config.json's mapping or None when it cannot be read here, its path)."""
    p = config_path(model)
    try:
        data = json.loads(p.read_text())
    except FileNotFoundError:
        if model.hf_config:
            raise InputError(f"model.hf_config: {shorten(str(p))} does not exist; point it at the model's config.json") from None
        return None, str(p)
    except (OSError, ValueError) as err:
        if model.hf_config:
            raise InputError(f"model.hf_config: {shorten(str(p))} cannot be read as JSON ({err})") from None
        return None, str(p)
    if not isinstance(data, dict):
        raise InputError(f"model: {shorten(str(p))} is not a JSON object")
    return data, str(p)


def resolve(model: ModelSpec) -> Architecture:
    """The architecture flags for a Miles recipe, checked against config.json where it is readable.

    Three sources, in this order:

    1. ``model.miles_model_args``: flags written in the recipe;
    2. ``model.miles_model_script``: a Miles ``scripts/models/<name>.py`` (its ``model_args()``
       called through Miles's own ``load_model_args``) or ``<name>.sh`` (its ``MODEL_ARGS=( ... )``
       array read without bash), with ``model.miles_model_script_vars`` (environment overrides for
       the Python form, variables for the bash form); explicit flags are added to the script's. A
       script that cannot be read here (it lives in the image's Miles checkout, which a login node
       does not see), or a Python script whose Miles loader is not reachable here, is *deferred*:
       the driver gets ``--model-script PATH`` and reads it inside the container with the image's
       Python (:func:`expand_deferred`), and the in-job preflight (``backends.miles.preflight``)
       checks the result before Ray starts;
    3. derived from the model's HF ``config.json`` (``model.hf_config``, else
       ``<model.path>/config.json``, :func:`derive_args`).

    Whichever source, when ``config.json`` is readable the flags are compared with it
    (:func:`compare_with_config`).
    """
    explicit = list(model.miles_model_args)
    vars_ = dict(model.miles_model_script_vars)
    config, cpath = read_config(model)
    script = model.miles_model_script
    deferred = Architecture(tuple(explicit), f"model.miles_model_script ({script}, read in the job)",
                            deferred_script=script, script_vars=vars_,
                            script_form=form_of(script) if script else None)
    if script and not Path(script).is_file():
        # Not visible here (the image's checkout): read inside the job, checked there before Ray.
        return deferred
    if script:
        try:
            from_script = read_model_script(script, vars_)
        except LoaderMissing:  # readable, but no Miles here to run its model_args() as Miles does
            return deferred
        _no_overlap(from_script, explicit, script)
        args, source = from_script + explicit, f"model.miles_model_script ({script})"
    elif explicit:
        args, source = explicit, "model.miles_model_args"
    elif config is not None:
        args, source = derive_args(config, where=cpath), f"config.json ({cpath})"
    else:
        raise InputError(f"model.miles_model_args: a Miles recipe needs the model's architecture flags (Megatron "
                         f"builds the network from them; {cpath} is not readable here); " + SOURCES_HELP)
    if config is not None:
        compare_with_config(args, config, source=source, config_path=cpath)
    return Architecture(tuple(args), source, config_path=cpath if config is not None else None,
                        script_form=form_of(script) if script else None)


def reconcile(own: list[str], model_args: list[str]) -> list[str]:
    """beam-hpc's flags minus the practice flags the architecture flags already set to the same
    value (``flags.ALSO_IN_MODEL_SCRIPTS``: Miles's MLA scripts carry --attention-softmax-in-fp32,
    some carry dropout 0); a different value is refused, naming the recipe field."""
    from beam_hpc.backends.miles.flags import ALSO_IN_MODEL_SCRIPTS, SOURCES

    theirs, mine = flag_values(model_args), flag_values(own)
    drop = []
    for flag in ALSO_IN_MODEL_SCRIPTS:
        if flag not in theirs:
            continue
        if flag not in mine or not _same_value(mine[flag], theirs[flag]):
            shown = "off" if flag not in mine else f"{flag} {mine[flag]}"
            raise InputError(f"{SOURCES[flag]}: the model's architecture flags set {flag}"
                             f"{' ' + str(theirs[flag]) if theirs[flag] is not None else ''} but the recipe gives {shown}; "
                             f"set {SOURCES[flag]} to match the model script")
        drop.append(flag)
    return _without(own, drop)


def _same_value(a: str | None, b: str | None) -> bool:
    if a is None or b is None:
        return a is b
    try:
        return float(a) == float(b)
    except ValueError:
        return a == b


def _without(argv: list[str], flags: list[str]) -> list[str]:
    """``argv`` without each of ``flags`` and its value (``--flag v`` or a bare switch)."""
    out, skip = [], False
    for i, a in enumerate(argv):
        if skip:
            skip = False
            continue
        if a in flags:
            skip = i + 1 < len(argv) and not argv[i + 1].startswith("--")
            continue
        out.append(a)
    return out


def _no_overlap(from_script: list[str], explicit: list[str], script: str) -> None:
    both = sorted(set(flag_values(from_script)) & set(flag_values(explicit)))
    if both:
        raise InputError(f"model.miles_model_args: {', '.join(both)} also set by model.miles_model_script ({script}); "
                         "argparse would keep one silently: set each flag in one place (model.miles_model_script_vars "
                         "for the script's variables)")


# -- the driver side: a deferred script --------------------------------------------------------

def launcher_options(arch: Architecture) -> list[str]:
    """The launcher options that carry a deferred script into the job."""
    if arch.deferred_script is None:
        return []
    out = [MODEL_SCRIPT_OPTION, arch.deferred_script]
    for k, v in sorted(arch.script_vars.items()):
        out += [MODEL_SCRIPT_VAR_OPTION, f"{k}={v}"]
    return out


def expand_deferred(script: str | None, script_vars: list[str] | None, miles_argv: list[str]) -> list[str]:
    """Miles's argv with the deferred script's flags appended (what the driver runs and the
    preflight checks: one function, so they cannot differ). Runs where the image's Python runs."""
    return expand_deferred_with_form(script, script_vars, miles_argv)[0]


def expand_deferred_with_form(script: str | None, script_vars: list[str] | None,
                              miles_argv: list[str]) -> tuple[list[str], str | None]:
    """:func:`expand_deferred` and the script's form (``python``/``bash``; None without a script),
    which the in-job preflight reports."""
    if not script:
        return list(miles_argv), None
    overrides = dict(v.split("=", 1) for v in (script_vars or []))
    try:
        found = read_script(script, overrides)
    except LoaderMissing as err:
        raise InputError(f"model.miles_model_script: {script} is a Python model script, but {err}: the image's Miles "
                         "predates scripts/models/*.py (Miles #1910); name its <name>.sh instead, or build the image "
                         "from a newer Miles") from None
    from_script = list(found.args)
    own = reconcile(miles_argv, from_script)  # practice flags the script repeats with the same value
    clash = sorted(set(flag_values(from_script)) & set(flag_values(own)))
    if clash:
        raise InputError(f"model.miles_model_script: {script} sets {', '.join(clash)}, which the recipe already sets "
                         "(beam-hpc or model.miles_model_args); set each flag in one place")
    return [*own, *from_script], found.form
