"""The embedded default's model: a 0.8M-parameter Qwen2 with its own tokenizer, made here.

Why build instead of download: the embedded default must run with no network, and RL needs a
policy that already answers in the ``\\boxed{}`` format some of the time (a random model never
earns a reward, so GRPO has nothing to normalise). So: a byte-level BPE tokenizer trained on
arithmetic chat strings (digits one per token, Qwen-style chat template), a Qwen2-shaped model,
and a short supervised warm start on additions (never the evaluation problems), stopped once
greedy accuracy on held-out sums reaches ``STOP_AT`` (inside ``TARGET``, 20-60%), so that RL has
both a reward signal and room to improve. Deterministic (seeded, fixed thread count), cached in
``model.path`` (staged and renamed whole, under a file lock, so concurrent runs build it once).

The package ships the result (``tiny_shipped/``) with the key of what made it (:func:`build_key`);
``build`` copies it when the key matches instead of spending ~2-3 CPU minutes. After a change:
``python -m beam_hpc.backends.reference.model.tiny_model --refresh-shipped``.
"""

from __future__ import annotations

import ast
import hashlib
import json
import logging
import random
import shutil
import time
from pathlib import Path
from typing import Any

from beam_hpc import files

BUILD_THREADS = 1  # not 2: with other work on the cores, OpenMP spin-waits make 2 threads ~10x slower
VOCAB_SIZE = 384
PAD, BOS, EOS = "<|endoftext|>", "<|im_start|>", "<|im_end|>"
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
TARGET = (0.20, 0.60)  # greedy held-out accuracy window for the warm start
STOP_AT = 0.35  # mid-jump: at ~20% sampled accuracy most groups of 8 still hold a correct answer
SFT_BATCH = 64
SFT_LR = 2e-3
SFT_MAX_STEPS = 900
EVAL_EVERY = 25
EVAL_FROM = 250  # below this step accuracy is ~0 in every build seen; evaluating there only costs time
HELD_OUT = 200
BUILD_INFO = "build_info.json"

log = logging.getLogger(__name__)


def user_prompt(a: int, b: int) -> str:
    """The problem text, exactly as the tiny data set asks it."""
    from beam_hpc.data.tiny import tiny_prompt

    return tiny_prompt(a, b)


def answer_text(a: int, b: int) -> str:
    """The warm start's answer: the sum written out, then boxed (the format RL rewards)."""
    return f"{a} + {b} = {a + b}. The answer is \\boxed{{{a + b}}}."


def _pairs(rng: random.Random, n: int, exclude: set[tuple[int, int]]) -> list[tuple[int, int]]:
    out = []
    while len(out) < n:
        pair = (rng.randint(10, 99), rng.randint(10, 99))
        if pair not in exclude:
            out.append(pair)
    return out


def pairs_in(texts: set[str]) -> set[tuple[int, int]]:
    """The (a, b) pairs whose problem text is in ``texts``, in either order (e.g. the evaluation
    set, which the warm start must not see)."""
    found = {(a, b) for a in range(10, 100) for b in range(10, 100) if user_prompt(a, b) in texts}
    return found | {(b, a) for a, b in found}


def build_tokenizer(out_dir: Path, corpus: list[str]) -> Any:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Digits(individual_digits=True), pre_tokenizers.ByteLevel(add_prefix_space=False)]
    )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        special_tokens=[PAD, BOS, EOS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(corpus, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token=PAD, bos_token=BOS, eos_token=EOS)
    fast.chat_template = CHAT_TEMPLATE
    fast.padding_side = "left"
    fast.save_pretrained(out_dir)
    return fast


def _chat(tok: Any, a: int, b: int) -> str:
    return tok.apply_chat_template([{"role": "user", "content": user_prompt(a, b)}], tokenize=False, add_generation_prompt=True)


def _greedy_accuracy(model: Any, tok: Any, pairs: list[tuple[int, int]]) -> float:
    from beam_hpc.backends.reference.model.sampling import generate

    prompts = [tok(_chat(tok, a, b), add_special_tokens=False)["input_ids"] for a, b in pairs]
    model.eval()
    responses = generate(
        model, prompts, seed_parts=("sft-eval",), max_new_tokens=24, temperature=0.0, top_p=1.0,
        eos_id=tok.eos_token_id, pad_id=tok.pad_token_id,
    )
    model.train()
    good = sum(f"\\boxed{{{a + b}}}" in tok.decode(r, skip_special_tokens=True) for (a, b), r in zip(pairs, responses, strict=False))
    return good / len(pairs)


def _sft(
    model: Any, tok: Any, rng: random.Random, held_out: list[tuple[int, int]], exclude: set[tuple[int, int]], history: list[dict[str, float]]
) -> float:
    """Answer-only cross-entropy until held-out accuracy reaches STOP_AT; returns that accuracy."""
    import torch

    from beam_hpc.backends.reference.model.policy import make_batch, response_logits, token_logprobs

    opt = torch.optim.AdamW(model.parameters(), lr=SFT_LR, weight_decay=0.0)
    exclude = exclude | set(held_out)
    t0 = time.perf_counter()
    acc = 0.0
    for step in range(1, SFT_MAX_STEPS + 1):
        pairs = _pairs(rng, SFT_BATCH, exclude)
        prompts = [tok(_chat(tok, a, b), add_special_tokens=False)["input_ids"] for a, b in pairs]
        answers = [tok(answer_text(a, b), add_special_tokens=False)["input_ids"] + [tok.eos_token_id] for a, b in pairs]
        batch = make_batch(prompts, answers, tok.pad_token_id)
        logp = token_logprobs(response_logits(model, batch), batch)
        loss = -(logp * batch.response_mask).sum() / batch.response_mask.sum()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        if step >= EVAL_FROM and step % EVAL_EVERY == 0:
            acc = _greedy_accuracy(model, tok, held_out)
            history.append({"step": step, "loss": float(loss.detach()), "accuracy": acc, "seconds": time.perf_counter() - t0})
            log.info("tiny model warm start: step %d, loss %.3f, held-out accuracy %.1f%%", step, float(loss.detach()), 100 * acc)
            if acc >= STOP_AT:
                break
    return acc


SHIPPED = Path(__file__).with_name("tiny_shipped")
KEY_FILE = "build_key.txt"


def build_key(seed: int, exclude: set[tuple[int, int]]) -> str:
    """What determines the built model: this module's code, the seed and the excluded pairs.
    Import lines, the module docstring and the module's own name (in messages that name the file)
    are left out: none changes a weight, and moving the module must not make the shipped build stale."""
    source = Path(__file__).read_text()
    parts = Path(__file__).with_suffix("").parts
    dotted = ".".join(parts[len(parts) - 1 - parts[::-1].index("beam_hpc"):])  # also right under `python -m`
    for own_name in (dotted, dotted.replace(".", "/") + ".py"):
        source = source.replace(own_name, "<this module>")
    first = ast.parse(source).body[0]
    skip = (first.end_lineno or 0) if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant) else 0
    code = "\n".join(line for line in source.splitlines()[skip:]
                     if not line.lstrip().startswith(("import ", "from ")))
    h = hashlib.sha256(code.encode())
    h.update(json.dumps([seed, sorted(exclude)]).encode())
    return h.hexdigest()[:16]


def _shipped_matches(key: str) -> bool:
    try:
        return (SHIPPED / KEY_FILE).read_text().strip() == key
    except OSError:
        return False


def build(model_dir: str | Path, seed: int = 0, exclude_texts: set[str] | None = None) -> Path:
    """Build the tokenizer and warm-started model into ``model_dir`` unless it is already there.
    Problems whose text is in ``exclude_texts`` (the evaluation set) are never trained on."""
    out = Path(model_dir)
    if (out / BUILD_INFO).is_file():
        return out
    with files.locked(out.parent / f".{out.name}.lock"):
        if (out / BUILD_INFO).is_file():  # built by another process while we waited
            return out
        files.remove_stale_staging(out)  # left by a killed build; we hold the lock
        exclude = pairs_in(exclude_texts or set())
        key = build_key(seed, exclude)
        with files.atomic_dir(out) as tmp:
            if _shipped_matches(key):
                shutil.copytree(SHIPPED, tmp, dirs_exist_ok=True)
                log.info("tiny model: copied the shipped build (key %s)", key)
            else:
                _build_into(tmp, seed, exclude)
                (tmp / KEY_FILE).write_text(key + "\n")
    return out


def _build_into(out: Path, seed: int, exclude: set[tuple[int, int]]) -> None:
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    t0 = time.perf_counter()
    saved_threads = torch.get_num_threads()
    torch.set_num_threads(BUILD_THREADS)
    try:
        rng = random.Random(seed)
        corpus_pairs = _pairs(rng, 4000, set())
        corpus = [f"<|im_start|>user\n{user_prompt(a, b)}<|im_end|>\n<|im_start|>assistant\n{answer_text(a, b)}<|im_end|>\n" for a, b in corpus_pairs]
        tok = build_tokenizer(out, corpus)
        config = Qwen2Config(
            vocab_size=len(tok),
            hidden_size=128,
            intermediate_size=384,
            num_hidden_layers=4,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=256,
            tie_word_embeddings=True,
            bos_token_id=tok.bos_token_id,
            eos_token_id=tok.eos_token_id,
            pad_token_id=tok.pad_token_id,
        )
        torch.manual_seed(seed)
        model = Qwen2ForCausalLM(config)
        held_out = _pairs(random.Random(seed + 1), HELD_OUT, exclude)
        history: list[dict[str, float]] = []
        acc = _sft(model, tok, rng, held_out, exclude, history)
        if not TARGET[0] <= acc <= TARGET[1]:
            raise RuntimeError(
                f"tiny model warm start ended at {acc:.0%} held-out accuracy, outside {TARGET}; "
                "tune SFT_LR / SFT_MAX_STEPS in beam_hpc/backends/reference/model/tiny_model.py"
            )
        model.generation_config.pad_token_id = tok.pad_token_id
        model.generation_config.eos_token_id = tok.eos_token_id
        model.save_pretrained(out)
        info = {
            "seed": seed,
            "params": sum(p.numel() for p in model.parameters()),
            "held_out_accuracy": acc,
            "excluded_pairs": len(exclude),
            "sft_log": history,
            "build_seconds": time.perf_counter() - t0,
        }
        (out / BUILD_INFO).write_text(json.dumps(info, indent=2))
    finally:
        torch.set_num_threads(saved_threads)


def refresh_shipped(seed: int = 0) -> Path:
    """Rebuild the shipped copy for the tiny data set's evaluation problems (seed 0)."""
    import tempfile

    from beam_hpc.data.prepare import prepare
    from beam_hpc.data.tiny import write_tiny_sources

    with tempfile.TemporaryDirectory() as tmp:
        data = Path(tmp, "data")
        prepare(data, from_local=write_tiny_sources(Path(tmp, "src")), progress=False)
        texts = {json.loads(line)["prompt"][0]["content"] for line in (data / "aime-2025.jsonl").read_text().splitlines()}
        built = build(Path(tmp, "model"), seed=seed, exclude_texts=texts)
        with files.atomic_dir(SHIPPED) as tmp_shipped:
            shutil.copytree(built, tmp_shipped, dirs_exist_ok=True)
    return SHIPPED


if __name__ == "__main__":
    import sys

    if sys.argv[1:] != ["--refresh-shipped"]:
        raise SystemExit("usage: python -m beam_hpc.backends.reference.model.tiny_model --refresh-shipped")
    logging.basicConfig(level=logging.INFO)
    print(refresh_shipped())
