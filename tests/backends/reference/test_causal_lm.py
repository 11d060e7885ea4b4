"""The reference backend's own model, sampler, LoRA and tokenizer against transformers (and PEFT's
rules), the library they replace: a folder transformers wrote loads with the same parameter
names, the logits are bitwise transformers' on every real position, generation is token for
token what transformers' ``generate`` gives with the same Gumbel noise, the chat prompt and its
ids are character and id for id the same. And the point of it all: a process that builds the
policy and samples never imports transformers or torch's compiler."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch")

from beam_hpc.backends.reference.model import causal_lm, lora  # noqa: E402
from beam_hpc.backends.reference.model.chat_tokenizer import ChatTokenizer  # noqa: E402
from beam_hpc.backends.reference.model.sampling import generate, noise_source  # noqa: E402

REPO = Path(__file__).resolve().parents[3]
pytestmark = pytest.mark.slow  # imports transformers to compare against it: several seconds per process


def _llama_folder(tmp_path: Path) -> Path:
    """A random Llama with an untied output layer and biases, saved by transformers (the other
    family and options the tiny Qwen2 does not exercise)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(3)
    cfg = LlamaConfig(vocab_size=50, hidden_size=48, intermediate_size=96, num_hidden_layers=2, num_attention_heads=6,
                      num_key_value_heads=2, head_dim=8, tie_word_embeddings=False, attention_bias=True,
                      rope_theta=500.0, rms_norm_eps=1e-5, max_position_embeddings=64)
    LlamaForCausalLM(cfg).save_pretrained(tmp_path / "llama")
    return tmp_path / "llama"


def _ragged(vocab: int, rows: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab, (int(n),), generator=g).tolist() for n in torch.randint(2, 9, (rows,), generator=g)]


def _hf_generate(model: Any, prompts: list[list[int]], seed: int, max_new: int, temperature: float, eos: int, pad: int) -> list[list[int]]:
    """transformers' generate with the reference sampler's noise as a logits processor (how the
    backend sampled before it had its own loop)."""
    from transformers import GenerationConfig, LogitsProcessor, LogitsProcessorList

    from beam_hpc.backends.reference.model.policy import make_batch

    draw = noise_source(seed)

    class Gumbel(LogitsProcessor):
        def __call__(self, input_ids: Any, scores: Any) -> Any:
            scores = scores.float()
            return scores if temperature == 0 else scores / temperature + draw(tuple(scores.shape), scores.device)

    batch = make_batch(prompts, [[] for _ in prompts], pad)
    P = batch.prompt_width
    cfg = GenerationConfig(max_new_tokens=max_new, do_sample=False, num_beams=1, eos_token_id=eos, pad_token_id=pad)
    with torch.no_grad():
        out = model.generate(input_ids=batch.input_ids[:, :P], attention_mask=batch.attention_mask[:, :P],
                             generation_config=cfg, logits_processor=LogitsProcessorList([Gumbel()]))
    rows = []
    for row in out[:, P:].tolist():
        rows.append(row[: row.index(eos) + 1] if eos in row else row)
    return rows


@pytest.mark.parametrize("which", ["tiny qwen2", "llama"])
def test_logits_and_generation_are_transformers_own(tmp_path, tiny_assets, which) -> None:
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(1)
    folder = Path(tiny_assets.model_dir) if which == "tiny qwen2" else _llama_folder(tmp_path)
    ours = causal_lm.load(folder).eval()
    theirs = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    assert {n for n, _ in ours.named_parameters()} == {n for n, _ in theirs.named_parameters()}
    vocab = ours.config.vocab_size
    eos, pad, new = 1, 0, 12
    prompts = _ragged(vocab, 12, seed=1)
    if which == "tiny qwen2":  # its own problems, so that answers end (EOS) inside the budget
        from beam_hpc.data.tiny import tiny_prompt

        tok = ChatTokenizer(folder)
        eos, pad, new = tok.eos_token_id, tok.pad_token_id, 24
        prompts = [tok.encode(tok.apply_chat_template([{"role": "user", "content": tiny_prompt(10 + 7 * i, 31 + i)}]))
                   for i in range(12)]
    from beam_hpc.backends.reference.model.policy import derive_seed, make_batch, response_logits

    batch = make_batch(prompts, _ragged(vocab, 12, seed=2), pad_id=pad)
    with torch.no_grad():
        a, b = response_logits(ours, batch), response_logits(theirs, batch)
    real = batch.response_mask.bool()
    assert torch.equal(a[real], b[real]) and not torch.isnan(a).any()
    for temperature in (0.0, 1.0):
        mine = generate(ours, prompts, seed_parts=(7, temperature), max_new_tokens=new, temperature=temperature,
                        top_p=1.0, eos_id=eos, pad_id=pad)
        assert mine == _hf_generate(theirs, prompts, derive_seed(7, temperature), new, temperature, eos=eos, pad=pad)
        if which == "tiny qwen2":
            assert any(len(r) < new for r in mine)  # answers end: the rows after EOS are exercised


def test_chat_prompt_ids_and_text_are_transformers_own(tiny_assets) -> None:
    from transformers import AutoTokenizer

    ours, theirs = ChatTokenizer(tiny_assets.model_dir), AutoTokenizer.from_pretrained(tiny_assets.model_dir)
    assert (ours.eos_token_id, ours.pad_token_id, ours.vocab_size) == (theirs.eos_token_id, theirs.pad_token_id, len(theirs))
    for i, text in enumerate(["What is 12 + 30?", "Sum: 99 + 1\nAnswer in \\boxed{}.", "  spaces  and é ∑ 中文"]):
        messages = [{"role": "user", "content": text}]
        prompt = ours.apply_chat_template(messages, add_generation_prompt=bool(i % 2))
        assert prompt == theirs.apply_chat_template(messages, tokenize=False, add_generation_prompt=bool(i % 2))
        ids = ours.encode(prompt)
        assert ids == theirs(prompt, add_special_tokens=False)["input_ids"]
        assert ours.decode([*ids, ours.eos_token_id]) == theirs.decode([*ids, ours.eos_token_id], skip_special_tokens=True)


def test_a_folder_without_a_tokenizer_or_with_another_model_is_refused(tmp_path, tiny_assets) -> None:
    with pytest.raises(FileNotFoundError, match="no tokenizer.json"):
        ChatTokenizer(tmp_path)
    bad = tmp_path / "gpt2"
    bad.mkdir()
    (bad / "config.json").write_text(json.dumps({"model_type": "gpt2"}))
    with pytest.raises(ValueError, match="model_type 'gpt2'"):
        causal_lm.load(bad)


def test_lora_starts_as_the_base_model_and_trains_only_its_adapters(tiny_assets) -> None:
    base = causal_lm.load(tiny_assets.model_dir)
    adapted = lora.add_adapters(causal_lm.load(tiny_assets.model_dir), rank=4, alpha=8, dropout=0.0, targets=["all-linear"])
    trainable = [n for n, p in adapted.named_parameters() if p.requires_grad]
    assert trainable and all(".lora_A." in n or ".lora_B." in n for n in trainable)
    assert not any(n.startswith("lm_head") for n in trainable)  # all-linear leaves the output layer, as PEFT does
    ids = torch.tensor([_ragged(base.config.vocab_size, 1, seed=4)[0]])
    with torch.no_grad():
        assert torch.equal(base(input_ids=ids).logits, adapted(input_ids=ids).logits)  # B starts at zero
    only_q = lora.add_adapters(causal_lm.load(tiny_assets.model_dir), rank=2, alpha=2, dropout=0.0, targets=["q_proj"])
    assert {n.split(".")[-3] for n, p in only_q.named_parameters() if p.requires_grad} == {"q_proj"}
    with pytest.raises(ValueError, match="names no linear layer"):
        lora.add_adapters(causal_lm.load(tiny_assets.model_dir), rank=2, alpha=2, dropout=0.0, targets=["nope"])


def test_a_policy_process_imports_neither_transformers_nor_torchs_compiler(tiny_assets) -> None:
    """What a rollout worker does (set the process up, load tokenizer and LoRA policy, sample,
    score log-probs) in a fresh process: deterministic kernels are on, and neither transformers,
    PEFT nor torch._dynamo / torch._inductor was imported (each costs CPU-seconds per actor)."""
    script = f"""
import sys, torch
from beam_hpc.backends.reference.model.policy import setup_process, load_tokenizer, load_policy, make_batch, response_logits
from beam_hpc.backends.reference.model.sampling import generate
from beam_hpc.config.recipe import load_recipe
setup_process(1)
tok = load_tokenizer({str(tiny_assets.model_dir)!r})
recipe = load_recipe("recipes/tiny.yaml", [f"model.path={str(tiny_assets.model_dir)}", "training.mode=lora",
                                             "training.lora={{rank: 4}}", "training.offload.target=none"])
model = load_policy(recipe)
prompt = tok.encode(tok.apply_chat_template([{{"role": "user", "content": "What is 12 + 30?"}}]))
out = generate(model, [prompt] * 4, seed_parts=(1,), max_new_tokens=8, temperature=1.0, top_p=1.0,
               eos_id=tok.eos_token_id, pad_id=tok.pad_token_id)
response_logits(model, make_batch([prompt] * 4, out, tok.pad_token_id)).sum().backward()
loaded = sorted(m for m in sys.modules if m.split(".")[0] in ("transformers", "peft") or m.startswith(("torch._dynamo", "torch._inductor")))
print(torch.are_deterministic_algorithms_enabled(), loaded[:5])
"""
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120, cwd=REPO)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.split() == ["True", "[]"], out.stdout
