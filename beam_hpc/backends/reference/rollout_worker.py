"""The rollout side: a Ray actor on a rollout-group node that samples responses and scores them.

It holds the behaviour policy, takes the weights the trainer pushes (``receive_weights``, over
the transport ``backend_options.weight_sync`` names), and for a chunk of prompts returns each
sample's tokens, its behaviour log-probabilities (the ``old_logp`` of the clipped loss) and its
reward from :mod:`beam_hpc.reward.scoring`. Scoring happens here, as Miles scores inside its rollout
manager, so that the trainer only ever sees finished samples.

This class is plain Python; the driver wraps it with ``ray.remote`` and the group resource, so
importing this module starts nothing.
"""

from __future__ import annotations

import os
from typing import Any

from beam_hpc.backends.reference.policy import (
    device_of,
    load_policy,
    load_tokenizer,
    load_trainable_state,
    make_batch,
    response_logits,
    setup_process,
    threads_of,
    token_logprobs,
)
from beam_hpc.config.recipe import Recipe
from beam_hpc.plan.ray_labels import GROUP_LABEL_KEY


def where_am_i(role: str, index: int) -> dict[str, Any]:
    """Which Ray node (id, IP, labels) this actor process runs on: the proof of placement."""
    import ray

    ctx = ray.get_runtime_context()
    node_id = ctx.get_node_id()
    labels: dict[str, str] = {}
    try:
        labels = dict(ctx.get_node_labels())
    except AttributeError:  # older Ray: read the node table instead
        labels = next((n.get("Labels", {}) for n in ray.nodes() if n["NodeID"] == node_id), {})
    return {
        "role": role,
        "index": index,
        "node_id": node_id,
        "node_ip": ray.util.get_node_ip_address(),
        "pid": os.getpid(),
        "group": labels.get(GROUP_LABEL_KEY),
        "labels": {k: v for k, v in labels.items() if not k.startswith("ray.io/")},
    }


class RolloutWorker:
    """One rollout engine. Methods run in the actor's main thread (math-verify needs that)."""

    def __init__(self, recipe: dict[str, Any], index: int, model_path: str) -> None:
        self.recipe = Recipe.model_validate(recipe)
        setup_process(threads_of(self.recipe))
        self.index = index
        self.device = device_of(self.recipe)
        self.tok = load_tokenizer(model_path)
        self.model = load_policy(self.recipe, model_path)
        self.model.eval()
        self.version = -1
        self.receiver: Any = None  # weight_sync's receiver, made by connect_weights

    def where(self) -> dict[str, Any]:
        return where_am_i("rollout", self.index)

    def connect_weights(self, kind: str, rendezvous: Any, rank: int) -> None:
        """Make the receiver; with a rendezvous (nccl) join the weight group as ``rank``."""
        from beam_hpc.backends.reference.weight_sync import make_receiver

        self.receiver = make_receiver(kind, rendezvous=rendezvous, rank=rank, device=self.device)
        if rendezvous is not None:
            self.receiver.connect()

    def receive_weights(self, delivery: Any) -> int:
        """Take one push (every push, in order) and load it: a copy, as the receiver's tensors may
        be views of buffers that the next push overwrites."""
        state, version = self.receiver.recv(delivery)
        load_trainable_state(self.model, state)
        self.version = version
        return version

    def close(self) -> None:
        if self.receiver is not None:
            self.receiver.close()

    def generate(
        self,
        prompts: list[list[int]],
        labels: list[str],
        *,
        purpose: str,
        rollout_id: int,
        first_sample: int,
        samples_per_prompt: int,
        train: bool,
    ) -> dict[str, Any]:
        """``samples_per_prompt`` responses to each prompt (a group's responses adjacent).

        ``train`` selects the training budget, temperature and penalised reward, and computes the
        behaviour log-probs; otherwise it is an evaluation (no penalty, no log-probs).
        """
        import time

        import torch

        from beam_hpc.backends.reference.sampling import generate
        from beam_hpc.reward.scoring import score_response

        r = self.recipe
        max_new = r.tokens.max_response if train else r.eval_max_response
        temperature = r.training.temperature if train else r.eval.temperature
        top_p = 1.0 if train else r.eval.top_p
        t0 = time.perf_counter()
        flat_prompts = [p for p in prompts for _ in range(samples_per_prompt)]
        flat_labels = [lab for lab in labels for _ in range(samples_per_prompt)]
        responses = generate(
            self.model,
            flat_prompts,
            seed_parts=(r.seed, purpose, rollout_id, first_sample),
            max_new_tokens=max_new,
            temperature=temperature,
            top_p=top_p,
            eos_id=self.tok.eos_token_id,
            pad_id=self.tok.pad_token_id,
            device=self.device,
        )
        texts = [self.tok.decode(resp, skip_special_tokens=True) for resp in responses]
        scores = [
            score_response(
                text,
                label,
                len(resp),
                max_response_tokens=max_new,
                buffer_tokens=r.reward.overlong_buffer,
                factor=r.reward.overlong_factor,
                apply_penalty=train,
            )
            for text, label, resp in zip(texts, flat_labels, responses, strict=False)
        ]
        old_logp: list[list[float]] = []
        if train:
            batch = make_batch(flat_prompts, responses, self.tok.pad_token_id, self.device)
            with torch.no_grad():
                lp = token_logprobs(response_logits(self.model, batch), batch).cpu()
            old_logp = [lp[i, : len(resp)].tolist() for i, resp in enumerate(responses)]
        return {
            "prompt_ids": flat_prompts,
            "response_ids": responses,
            "response_text": texts,
            "label": flat_labels,
            "old_logp": old_logp,
            "reward": [s.reward for s in scores],
            "correct": [bool(s.correct) for s in scores],
            "pred": [s.pred for s in scores],
            "penalty": [s.penalty for s in scores],
            "version": self.version,
            "worker": self.index,
            "generate_time_s": time.perf_counter() - t0,
        }
