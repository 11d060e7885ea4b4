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

from beam_hpc.backends.reference.model.policy import derive_seed

if TYPE_CHECKING:
    import torch


def noise_source(seed: int) -> Callable[[tuple[int, ...], torch.device], torch.Tensor]:
    """Gumbel noise for one generation, drawn on the CPU from a generator seeded with ``seed``
    (the same numbers whatever the device), then moved to the logits' device.
    ``benchmarks/two_gpu.py`` swaps this for a device-side draw to time the difference."""
    import torch

    generator = torch.Generator().manual_seed(seed)

    def draw(shape: tuple[int, ...], device: torch.device) -> torch.Tensor:
        return (-torch.empty(shape, dtype=torch.float32).exponential_(generator=generator).log()).to(device)

    return draw


def _sample(scores: torch.Tensor, noise: Callable[[tuple[int, ...], torch.device], torch.Tensor],
            temperature: float, top_p: float) -> torch.Tensor:
    """The next token of each row: argmax of the Gumbel-perturbed scores (or of the scores alone
    at temperature 0, where no noise is drawn)."""
    scores = scores.float()
    if temperature == 0:
        return scores.argmax(dim=-1)
    scores = scores / temperature
    if top_p < 1.0:
        scores = _top_p_mask(scores, top_p)
    return (scores + noise(tuple(scores.shape), scores.device)).argmax(dim=-1)


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

    from beam_hpc.backends.reference.model.causal_lm import CausalLM, KVCache, from_transformers
    from beam_hpc.backends.reference.model.policy import make_batch

    if not isinstance(model, CausalLM):  # the tiny model's builder evaluates a transformers model
        model = from_transformers(model)
    batch = make_batch(prompts, [[] for _ in prompts], pad_id, device)
    keys = batch.attention_mask[:, : batch.prompt_width]
    positions = (keys.cumsum(dim=1) - 1).clamp(min=0)
    noise = noise_source(derive_seed(*seed_parts))
    weight = next(model.parameters())
    rows = len(prompts)
    cache = KVCache(model.config, rows, batch.prompt_width + max_new_tokens, weight.dtype, weight.device)
    finished = torch.zeros(rows, dtype=torch.bool, device=keys.device)
    columns: list[torch.Tensor] = []
    with torch.no_grad():
        logits = model.run(batch.input_ids[:, : batch.prompt_width], keys, positions, cache)[:, -1]
        at = positions[:, -1:]
        for _ in range(max_new_tokens):
            if interrupt is not None:
                interrupt()  # may raise: the caller abandons this generation
            token = _sample(logits, noise, temperature, top_p).to(keys.device)
            token = torch.where(finished, torch.full_like(token, pad_id), token)
            columns.append(token)
            finished |= token == eos_id
            if bool(finished.all()) or len(columns) == max_new_tokens:
                break
            keys = torch.cat([keys, torch.ones_like(keys[:, :1])], dim=1)
            at = at + 1
            logits = model.run(token[:, None], keys, at, cache)[:, -1]
    responses = []
    for row in torch.stack(columns, dim=1).tolist() if columns else [[] for _ in prompts]:
        resp = []
        for t in row:
            resp.append(t)
            if t == eos_id:
                break
        responses.append(resp)
    return responses
