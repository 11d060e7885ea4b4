"""History-free sampling: what a unit generates depends on (run seed, purpose, rollout id, first
prompt index), never on what the process did before or which process it is.

Sampling from softmax(logits / T) is done as argmax(logits / T + Gumbel noise) (the Gumbel-max
trick, exact), with the noise drawn from a ``torch.Generator`` seeded through sha256 from the run
seed, the purpose (train / eval), the rollout id and the unit's first prompt index. A resumed process,
an extra draw anywhere, or a restore order therefore cannot change a trajectory
(verified bitwise across interruption on CPU), and the same code serves sync, async and colocated runs.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from beam_hpc.backends.reference.policy import derive_seed

if TYPE_CHECKING:
    import torch


def _gumbel_processor(generator: torch.Generator, temperature: float, top_p: float,
                      interrupt: Callable[[], None] | None = None) -> Any:
    """A transformers LogitsProcessor; built lazily so this module imports without transformers."""
    import torch
    from transformers import LogitsProcessor

    class GumbelMax(LogitsProcessor):
        def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
            if interrupt is not None:
                interrupt()  # may raise: the caller abandons this generation
            scores = scores.float()
            if temperature == 0:  # greedy: no noise drawn
                return scores
            scores = scores / temperature
            if top_p < 1.0:
                scores = _top_p_mask(scores, top_p)
            noise = -torch.empty(scores.shape, dtype=torch.float32).exponential_(generator=generator).log()
            return scores + noise.to(scores.device)

    return GumbelMax()


def _top_p_mask(scores: torch.Tensor, top_p: float) -> torch.Tensor:
    """Keep the smallest set of tokens whose probability reaches ``top_p`` (nucleus sampling)."""
    import torch

    sorted_scores, order = torch.sort(scores, descending=True, dim=-1)
    cum = torch.softmax(sorted_scores, dim=-1).cumsum(dim=-1)
    drop_sorted = cum - torch.softmax(sorted_scores, dim=-1) >= top_p  # the first token always stays
    drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
    return scores.masked_fill(drop, float("-inf"))


def generate(
    model: Any,
    prompts: list[list[int]],
    *,
    seed_parts: tuple[object, ...],
    max_new_tokens: int,
    temperature: float,
    top_p: float,
    eos_id: int,
    pad_id: int,
    device: str = "cpu",
    interrupt: Callable[[], None] | None = None,
) -> list[list[int]]:
    """Sample one response per prompt (token ids, ending with ``eos_id`` unless the budget ran out).

    ``prompts`` are token-id lists; the batch is left-padded, the layout the trainer uses too.
    ``interrupt`` is called before each new token and may raise to abandon the generation.
    """
    import torch
    from transformers import GenerationConfig, LogitsProcessorList

    from beam_hpc.backends.reference.policy import make_batch

    batch = make_batch(prompts, [[] for _ in prompts], pad_id, device)
    P = batch.prompt_width
    ids = batch.input_ids[:, :P]
    attn = batch.attention_mask[:, :P]
    gen = torch.Generator().manual_seed(derive_seed(*seed_parts))
    cfg = GenerationConfig(
        max_new_tokens=max_new_tokens,
        do_sample=False,  # argmax over Gumbel-perturbed logits *is* the sample
        num_beams=1,
        eos_token_id=eos_id,
        pad_token_id=pad_id,
    )
    with torch.no_grad():
        out = model.generate(
            input_ids=ids,
            attention_mask=attn,
            generation_config=cfg,
            logits_processor=LogitsProcessorList([_gumbel_processor(gen, temperature, top_p, interrupt)]),
        )
    responses = []
    for row in out[:, P:].tolist():
        resp = []
        for t in row:
            resp.append(t)
            if t == eos_id:
                break
        responses.append(resp)
    return responses
