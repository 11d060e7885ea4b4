"""Architecture flags: Miles model scripts in both forms (Python ``model_args()`` through Miles's
loader, bash read without bash), derivation from config.json, and the
field-by-field comparison Miles's ``hf_validate_args`` would make after start-up, made first.

The config.json values are the published ones of public models (Hugging Face: Qwen/Qwen3-30B-A3B,
Qwen/Qwen3-8B, Qwen/Qwen2.5-7B, deepseek-ai/DeepSeek-V3, zai-org/GLM-4.5-Air); the expected flags
are the values of Miles's (and slime's) own ``scripts/models/*.sh`` for those families.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from miles_facts import DEEPSEEK_V3, GLM45_AIR, MILES_MAIN, QWEN3_8B, QWEN3_30B_A3B, QWEN25_7B

from beam_hpc.backends.miles import architecture as arch
from beam_hpc.backends.miles import model_script
from beam_hpc.backends.miles.args import build_driver
from beam_hpc.backends.miles.launch import parse_args as launch_parse_args
from beam_hpc.config.recipe import load_recipe
from beam_hpc.config.site import Site
from beam_hpc.errors import InputError

ROOT = Path(__file__).resolve().parents[3]
SITE = Site(name="t", container={"runtime": "host"})


# Miles main's scripts/models/qwen3-30B-A3B.sh, as a user's image would ship it (its shape: a bash
# loop builds MOE_LAYER_FREQ, a ${VAR:-default} for the RoPE base, comments, blank lines).
QWEN3_30B_A3B_SCRIPT = """NLAYERS=48
FIRST_K_DENSE_REPLACE=0

arr=()
for ((i=0; i<NLAYERS; i++)); do
  if (( i < FIRST_K_DENSE_REPLACE )); then
    arr+=(0)
  else
    arr+=(1)
  fi
done

printf -v MOE_LAYER_FREQ "[%s]" "$(IFS=', '; echo "${arr[*]}")"


MODEL_ARGS=(
   --disable-bias-linear
   --qk-layernorm
   --group-query-attention
   --num-attention-heads 32
   --num-query-groups 4
   --kv-channels 128
   --num-layers 48
   --hidden-size 2048
   --ffn-hidden-size 6144

   --normalization RMSNorm
   --position-embedding-type rope
   --norm-epsilon 1e-6
   --rotary-percent 1.0
   --swiglu
   --untie-embeddings-and-output-weights
   --vocab-size 151936

   --rotary-base "${MODEL_ARGS_ROTARY_BASE:-10000000}"

   # moe
   --moe-ffn-hidden-size 768
   --moe-router-score-function softmax
   --moe-token-dispatcher-type alltoall
   --moe-router-topk 8
   --moe-layer-freq $MOE_LAYER_FREQ
   --num-experts 128
   --moe-grouped-gemm
   --moe-token-drop-policy probs
   --moe-router-dtype fp32
   --moe-permute-fusion
   --moe-aux-loss-coeff 0
)
"""

# The values Miles's / slime's scripts give (the architecture part; tuning flags aside).
SCRIPT_VALUES = {
    "qwen3_moe": {"--num-attention-heads": "32", "--num-query-groups": "4", "--kv-channels": "128",
                  "--num-layers": "48", "--hidden-size": "2048", "--ffn-hidden-size": "6144", "--vocab-size": "151936",
                  "--moe-ffn-hidden-size": "768", "--moe-router-topk": "8", "--num-experts": "128",
                  "--moe-router-score-function": "softmax", "--norm-epsilon": "1e-06", "--qk-layernorm": None,
                  "--untie-embeddings-and-output-weights": None, "--moe-grouped-gemm": None},
    "deepseek_v3": {"--num-layers": "61", "--hidden-size": "7168", "--ffn-hidden-size": "18432",
                    "--num-attention-heads": "128", "--kv-channels": "128", "--vocab-size": "129280",
                    "--q-lora-rank": "1536", "--kv-lora-rank": "512", "--qk-head-dim": "128",
                    "--qk-pos-emb-head-dim": "64", "--v-head-dim": "128", "--rotary-scaling-factor": "40",
                    "--rotary-base": "10000", "--num-experts": "256", "--moe-ffn-hidden-size": "2048",
                    "--moe-router-topk": "8", "--moe-shared-expert-intermediate-size": "2048",
                    "--moe-router-score-function": "sigmoid", "--moe-router-group-topk": "4",
                    "--moe-router-num-groups": "8", "--moe-router-topk-scaling-factor": "2.5",
                    "--multi-latent-attention": None, "--moe-router-enable-expert-bias": None},
    "glm4_moe": {"--num-attention-heads": "96", "--num-query-groups": "8", "--kv-channels": "128",
                 "--num-layers": "46", "--hidden-size": "4096", "--ffn-hidden-size": "10944",
                 "--rotary-percent": "0.5", "--vocab-size": "151552", "--rotary-base": "1000000",
                 "--moe-ffn-hidden-size": "1408", "--moe-shared-expert-intermediate-size": "1408",
                 "--moe-router-topk": "8", "--num-experts": "128", "--moe-router-score-function": "sigmoid",
                 "--add-qkv-bias": None},
    "qwen3": {"--num-layers": "36", "--hidden-size": "4096", "--ffn-hidden-size": "12288",
              "--num-attention-heads": "32", "--num-query-groups": "8", "--kv-channels": "128",
              "--vocab-size": "151936", "--rotary-base": "1000000", "--qk-layernorm": None},
    "qwen2": {"--num-layers": "28", "--hidden-size": "3584", "--ffn-hidden-size": "18944",
              "--num-attention-heads": "28", "--num-query-groups": "4", "--vocab-size": "152064",
              "--rotary-base": "1000000", "--add-qkv-bias": None, "--untie-embeddings-and-output-weights": None},
}
CONFIGS = {"qwen3_moe": QWEN3_30B_A3B, "deepseek_v3": DEEPSEEK_V3, "glm4_moe": GLM45_AIR, "qwen3": QWEN3_8B,
           "qwen2": QWEN25_7B}


def _float(v: str | None) -> float | None:
    try:
        return float(v)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        return None


def layer_list(expr: str) -> list[int]:
    """Megatron's --moe-layer-freq list forms ("[1,1,1]", "[0]*3+[1]*58") expanded, without eval."""
    out: list[int] = []
    for part in expr.replace(" ", "").split("+"):
        m = re.fullmatch(r"\[([\d,]*)\](?:\*(\d+))?", part)
        assert m, expr
        out += [int(x) for x in m.group(1).split(",") if x] * int(m.group(2) or 1)
    return out


@pytest.mark.parametrize("family", sorted(CONFIGS))
def test_derived_flags_are_miless_script_values(family: str) -> None:
    args = arch.derive_args(CONFIGS[family])
    f = arch.flag_values(args)
    for flag, want in SCRIPT_VALUES[family].items():
        assert flag in f, (family, flag)
        if want is not None:
            assert f[flag] == want or _float(f[flag]) == _float(want), (family, flag, f[flag], want)
    assert len(args) == sum(1 + (v is not None) for v in f.values()), "a flag repeats"
    arch.compare_with_config(args, CONFIGS[family], source="derived", config_path="config.json")


def test_layer_frequencies() -> None:
    assert layer_list(arch.flag_values(arch.derive_args(DEEPSEEK_V3))["--moe-layer-freq"]) == [0] * 3 + [1] * 58
    assert layer_list(arch.flag_values(arch.derive_args(GLM45_AIR))["--moe-layer-freq"]) == [0] + [1] * 45
    assert layer_list(arch.flag_values(arch.derive_args(QWEN3_30B_A3B))["--moe-layer-freq"]) == [1] * 48


def test_model_script_is_read_without_bash() -> None:
    freq = "[" + ",".join(["1"] * 48) + "]"  # what the script's printf builds
    words = model_script.parse_model_script(QWEN3_30B_A3B_SCRIPT, where="qwen3-30B-A3B.sh",
                                    overrides={"MOE_LAYER_FREQ": freq})
    f = arch.flag_values(words)
    assert f["--rotary-base"] == "10000000"  # the ${VAR:-default}
    assert f["--moe-layer-freq"] == freq and layer_list(freq) == [1] * 48
    derived = arch.flag_values(arch.derive_args(QWEN3_30B_A3B))
    for flag in SCRIPT_VALUES["qwen3_moe"]:
        assert f[flag] == derived[flag] or _float(f[flag]) == _float(derived[flag]), flag
    with_base = model_script.parse_model_script(QWEN3_30B_A3B_SCRIPT, where="s",
                                        overrides={"MOE_LAYER_FREQ": freq, "MODEL_ARGS_ROTARY_BASE": "1000000"})
    arch.compare_with_config(with_base, QWEN3_30B_A3B, source="model.miles_model_script (s)", config_path="c")


def test_script_forms() -> None:
    text = """N_DENSE=3
N_MOE=89   # trailing comment
export MODEL_ARGS=( --num-layers $((N_DENSE + N_MOE)) \\
    --moe-layer-freq [0]*$N_DENSE+[1]*${N_MOE}  # comment with ) in it
    --normalization "RMSNorm" --x '${literal}' --y ${UNSET-dflt}
)
OTHER=(--ignored)
"""
    assert model_script.parse_model_script(text, where="s") == [
        "--num-layers", "92", "--moe-layer-freq", "[0]*3+[1]*89", "--normalization", "RMSNorm",
        "--x", "${literal}", "--y", "dflt"]


@pytest.mark.parametrize(("text", "message"), [
    ("MODEL_ARGS=(\n --moe-layer-freq $FREQ\n)\n", r"\$FREQ is not a plain assignment.*miles_model_script_vars"),
    ("MODEL_ARGS=(\n --n $(python -c 1)\n)\n", "command substitution"),
    ("X=(1)\n", r"no MODEL_ARGS=\( ... \) array"),
    ("MODEL_ARGS=(\n --n 1\n", "never closed"),
    ("MODEL_ARGS=(\n --n $((A / 2))\n)\n", "beyond the arithmetic"),
])
def test_script_refusals(text: str, message: str) -> None:
    with pytest.raises(InputError, match=message):
        model_script.parse_model_script(text, where="s.sh")


MISMATCHES = [
    ("hidden_size", "--hidden-size", "4096"),
    ("num_attention_heads", "--num-attention-heads", "16"),
    ("num_key_value_heads", "--num-query-groups", "8"),
    ("head_dim", "--kv-channels", "64"),
    ("num_hidden_layers", "--num-layers", "24"),
    ("intermediate_size", "--ffn-hidden-size", "1"),
    ("moe_intermediate_size", "--moe-ffn-hidden-size", "1536"),
    ("num_experts", "--num-experts", "64"),
    ("num_experts_per_tok", "--moe-router-topk", "4"),
    ("vocab_size", "--vocab-size", "152064"),
    ("rope_theta", "--rotary-base", "10000000"),
    ("rms_norm_eps", "--norm-epsilon", "1e-05"),
]


@pytest.mark.parametrize(("field", "flag", "bad"), MISMATCHES, ids=[m[0] for m in MISMATCHES])
def test_every_mismatch_is_named(field: str, flag: str, bad: str) -> None:
    args = arch.derive_args(QWEN3_30B_A3B)
    i = args.index(flag)
    args[i + 1] = bad
    with pytest.raises(InputError) as err:
        arch.compare_with_config(args, QWEN3_30B_A3B, source="model.miles_model_args", config_path="/m/config.json")
    msg = str(err.value)
    assert f"{field} in /m/config.json is" in msg and f"{flag} {bad}" in msg and "Fix: correct" in msg


def test_missing_flag_and_tied_embeddings_are_mismatches() -> None:
    args = [a for a in arch.derive_args(QWEN3_8B) if a != "--untie-embeddings-and-output-weights"]
    with pytest.raises(InputError, match="tie_word_embeddings .* is false but --untie-embeddings-and-output-weights is not given"):
        arch.compare_with_config(args, QWEN3_8B, source="s", config_path="c")
    with pytest.raises(InputError, match="num_hidden_layers in c is 36 but not given"):
        arch.compare_with_config(["--hidden-size", "4096"], QWEN3_8B, source="s", config_path="c")
    shared = arch.derive_args(DEEPSEEK_V3)
    shared[shared.index("--moe-shared-expert-intermediate-size") + 1] = "4096"
    with pytest.raises(InputError, match="n_shared_experts x moe_intermediate_size in c is 2048"):
        arch.compare_with_config(shared, DEEPSEEK_V3, source="s", config_path="c")


def test_unsupported_family_names_the_ways() -> None:
    with pytest.raises(InputError, match="model_type 'llama'.*model.miles_model_args.*model.miles_model_script"):
        arch.derive_args({"model_type": "llama"})


# -- through the recipe: render / submit / doctor all build the driver this way ----------------

def write_model(tmp: Path, config: dict) -> Path:
    d = tmp / "model"
    d.mkdir()
    (d / "config.json").write_text(json.dumps(config))
    return d


def driver(tmp: Path, *overrides: str) -> list[str]:
    r = load_recipe(ROOT / "recipes" / "dedicated.yaml", ["model.miles_model_script=null", *overrides])
    return build_driver(r, SITE)[0]


def test_recipe_without_any_source_is_refused(tmp_path: Path) -> None:
    with pytest.raises(InputError, match=r"model.miles_model_args: a Miles recipe needs .*config.json is not readable"
                                         r".*model.miles_model_script.*model.hf_config"):
        driver(tmp_path, f"model.path={tmp_path}/nothing")


def test_recipe_derives_from_config_json(tmp_path: Path) -> None:
    model = write_model(tmp_path, QWEN3_30B_A3B)
    argv = driver(tmp_path, f"model.path={model}")
    f = arch.flag_values(argv[argv.index("--") + 2:])
    assert f["--num-experts"] == "128" and f["--hidden-size"] == "2048"
    hf = driver(tmp_path, "model.path=/elsewhere", f"model.hf_config={model}/config.json")
    assert hf[hf.index("--num-layers"):] == argv[argv.index("--num-layers"):]


def test_recipe_refuses_flags_of_another_model(tmp_path: Path) -> None:
    model = write_model(tmp_path, QWEN3_30B_A3B)
    bad = arch.derive_args(QWEN3_8B)
    with pytest.raises(InputError, match="hidden_size in .*config.json is 2048 but --hidden-size 4096"):
        driver(tmp_path, f"model.path={model}", f"model.miles_model_args={json.dumps(bad)}")


def test_recipe_reads_a_readable_script_and_checks_it(tmp_path: Path) -> None:
    model = write_model(tmp_path, QWEN3_30B_A3B)
    script = tmp_path / "qwen3-30B-A3B.sh"
    script.write_text(QWEN3_30B_A3B_SCRIPT)
    with pytest.raises(InputError, match=r"MOE_LAYER_FREQ is not a plain assignment"):
        driver(tmp_path, f"model.path={model}", f"model.miles_model_script={script}")
    # Miles's default RoPE base is Qwen3-30B-A3B-2507's: the original model's config.json says 1e6
    with pytest.raises(InputError, match="rope_theta in .* is 1000000 but --rotary-base 10000000"):
        driver(tmp_path, f"model.path={model}", f"model.miles_model_script={script}",
               "model.miles_model_script_vars={MOE_LAYER_FREQ: '[1]*48'}")
    argv = driver(tmp_path, f"model.path={model}", f"model.miles_model_script={script}",
                  "model.miles_model_script_vars={MOE_LAYER_FREQ: '[1]*48', MODEL_ARGS_ROTARY_BASE: '1000000'}")
    assert "--model-script" not in argv and argv[argv.index("--moe-layer-freq") + 1] == "[1]*48"


def test_unreadable_script_is_read_by_the_launcher(tmp_path: Path) -> None:
    """The seed recipes' case: the script lives in the image; the launcher reads it in the job."""
    r = load_recipe(ROOT / "recipes" / "dedicated.yaml")
    argv = build_driver(r, SITE)[0]
    assert argv[argv.index("--model-script") + 1] == r.model.miles_model_script
    script = tmp_path / "beam.sh"
    script.write_text("MODEL_ARGS=(\n  --num-layers ${L}\n  --num-experts 64\n)\n")
    cut = argv.index("--")
    launcher = argv[3:cut]
    launcher[launcher.index("--model-script") + 1] = str(script)
    _, rest = launch_parse_args([*launcher, "--model-script-var", "L=4", *argv[cut:]])
    assert rest[-4:] == ["--num-layers", "4", "--num-experts", "64"]
    script.write_text("MODEL_ARGS=(\n  --save /x\n)\n")
    with pytest.raises(Exception, match="--save"):
        launch_parse_args([*launcher, *argv[cut:]])


# -- the Python form (Miles main: scripts/models/*.py) -----------------------------------------

PY_QWEN = MILES_MAIN / "scripts" / "models" / "qwen3-30B-A3B.py"
PY_GLM = MILES_MAIN / "scripts" / "models" / "glm4.5-355B-A32B.py"
PY_TINY = MILES_MAIN / "scripts" / "models" / "beam-tiny.py"


def test_python_script_runs_through_miles_loader() -> None:
    """model_args() called as Miles's load_model_args calls it (the checkout's own loader), its
    environment overrides passed through; the flags describe the published config.json."""
    got = model_script.read_script(str(PY_QWEN))
    assert got.form == "python" and got.loader.endswith("miles/utils/external_utils/model_args_utils.py")
    arch.compare_with_config(got.args, QWEN3_30B_A3B, source="model.miles_model_script (q)", config_path="c")
    f = arch.flag_values(got.args)
    derived = arch.flag_values(arch.derive_args(QWEN3_30B_A3B))
    for flag in SCRIPT_VALUES["qwen3_moe"]:
        assert f[flag] == derived[flag] or _float(f[flag]) == _float(derived[flag]), flag
    assert layer_list(f["--moe-layer-freq"]) == [1] * 48  # moe_layer_freq from model_args_utils
    tiny = arch.flag_values(model_script.read_model_script(
        str(PY_TINY), {"MODEL_ARGS_NUM_LAYERS": "3", "MODEL_ARGS_ROTARY_BASE": "500000"}))
    assert tiny["--num-layers"] == "3" and tiny["--rotary-base"] == "500000"
    assert tiny["--moe-layer-freq"] == "[0,1,1]"
    glm = arch.flag_values(model_script.read_model_script(str(PY_GLM)))  # model_args() takes no parameters
    assert glm["--num-layers"] == "92" and glm["--moe-layer-freq"] == "[0]*3+[1]*89"


def test_python_script_failures_name_the_script(tmp_path: Path) -> None:
    bad = tmp_path / "checkout" / "scripts" / "models"
    bad.mkdir(parents=True)
    loader = tmp_path / "checkout" / "miles" / "utils" / "external_utils"
    loader.mkdir(parents=True)
    (loader / "model_args_utils.py").write_text(
        (MILES_MAIN / "miles" / "utils" / "external_utils" / "model_args_utils.py").read_text())
    (bad / "broken.py").write_text("import os\ndef model_args():\n    return '--num-layers ' + str(int(os.environ['L']))\n")
    with pytest.raises(InputError, match=r"broken.py'?: model_args\(\) failed: KeyError: 'L'.*model.miles_model_script_vars"):
        model_script.read_model_script(str(bad / "broken.py"))
    assert model_script.read_model_script(str(bad / "broken.py"), {"L": "7"}) == ["--num-layers", "7"]
    with pytest.raises(InputError, match="model.miles_model_script_vars: 'A-B' cannot be environment variable names"):
        model_script.read_model_script(str(bad / "broken.py"), {"A-B": "1"})
    alone = tmp_path / "alone.py"  # no Miles checkout around it, and miles-rl 0.0.2 has no loader
    alone.write_text(PY_TINY.read_text())
    with pytest.raises(model_script.LoaderMissing, match="no Miles model_args_utils"):
        model_script.read_model_script(str(alone))


def python_recipe_driver(tmp: Path, script: Path, *overrides: str) -> list[str]:
    model = write_model(tmp, QWEN3_30B_A3B) if not (tmp / "model").exists() else tmp / "model"
    r = load_recipe(ROOT / "recipes" / "dedicated.yaml", [f"model.path={model}", f"model.miles_model_script={script}",
                                                         *overrides])
    return build_driver(r, SITE)[0]


def test_recipe_with_a_readable_python_script_derives_at_submit(tmp_path: Path) -> None:
    argv = python_recipe_driver(tmp_path, PY_QWEN)
    assert "--model-script" not in argv
    assert arch.flag_values(argv[argv.index("--") + 2:])["--num-experts"] == "128"
    with pytest.raises(InputError, match="rope_theta in .*config.json is 1000000 but --rotary-base 10000000"):
        python_recipe_driver(tmp_path, PY_QWEN, "model.miles_model_script_vars={MODEL_ARGS_ROTARY_BASE: '10000000'}")


def test_python_script_without_a_loader_here_is_read_in_the_job(tmp_path: Path) -> None:
    """Readable on the login node but no Miles to run it as Miles does: the launcher reads it in
    the image (here: a checkout copied next to it stands for the image's Miles)."""
    alone = tmp_path / "qwen3-30B-A3B.py"
    alone.write_text(PY_QWEN.read_text())
    argv = python_recipe_driver(tmp_path, alone, "model.miles_model_script_vars={MODEL_ARGS_NUM_LAYERS: '48'}")
    cut = argv.index("--")
    launcher = argv[3:cut]
    assert launcher[launcher.index("--model-script") + 1] == str(alone)
    assert "MODEL_ARGS_NUM_LAYERS=48" in launcher
    with pytest.raises(Exception, match="Python model script.*predates scripts/models/\\*.py"):
        launch_parse_args([*launcher, *argv[cut:]])
    launcher[launcher.index("--model-script") + 1] = str(PY_QWEN)
    _, rest = launch_parse_args([*launcher, *argv[cut:]])
    f = arch.flag_values(rest)
    assert f["--num-layers"] == "48" and f["--moe-layer-freq"] == "[" + ",".join(["1"] * 48) + "]"
