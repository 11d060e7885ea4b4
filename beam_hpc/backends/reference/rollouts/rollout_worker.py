"""The rollout side: a Ray actor on a rollout-group node that samples responses and scores them.

It holds the behaviour policy, takes the weights the trainer pushes (``receive_weights``, over
the transport ``backend_options.weight_sync`` names), and for a unit of prompts returns each
sample's tokens, its behaviour log-probabilities (the ``old_logp`` of the clipped loss) and its
reward from :mod:`beam_hpc.reward.scoring`. Scoring happens here, as Miles scores inside its rollout
manager, so that the trainer only ever sees finished samples.

This class is plain Python; the driver wraps it with ``ray.remote`` and the group resource, so
importing this module starts nothing.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

from beam_hpc.backends.reference.model.policy import (
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
from beam_hpc.backends.reference.rollouts.units import Unit, seed_parts
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


def compute_unit(model: Any, tok: Any, recipe: Recipe, device: str, unit: Unit, version: int,
                 interrupt: Callable[[], None] | None = None) -> dict[str, Any]:
    """One unit's samples: ``samples_per_prompt`` responses to each prompt (a group's responses
    adjacent), with the model already at ``version``. The same function serves the segment's own
    workers and outside ones (beam_hpc.backends.reference.rollouts.outside_worker), so a unit comes out bit for bit alike.

    ``train`` selects the training budget, temperature and penalised reward, and computes the
    behaviour log-probs; otherwise it is an evaluation (no penalty, no log-probs). ``interrupt`` is
    called before every new token; it may raise to abandon the unit (a worker leaving).
    """
    import time

    import torch

    from beam_hpc.backends.reference.model.sampling import generate
    from beam_hpc.reward.scoring import score_response

    r = recipe
    max_new = r.tokens.max_response if unit.train else r.eval_max_response
    temperature = r.training.temperature if unit.train else r.eval.temperature
    top_p = 1.0 if unit.train else r.eval.top_p
    t0 = time.perf_counter()
    flat_prompts = [p for p in unit.prompts for _ in range(unit.samples_per_prompt)]
    flat_labels = [lab for lab in unit.labels for _ in range(unit.samples_per_prompt)]
    responses = generate(
        model,
        flat_prompts,
        seed_parts=seed_parts(r.seed, unit),
        max_new_tokens=max_new,
        temperature=temperature,
        top_p=top_p,
        eos_id=tok.eos_token_id,
        pad_id=tok.pad_token_id,
        device=device,
        interrupt=interrupt,
    )
    texts = [tok.decode(resp, skip_special_tokens=True) for resp in responses]
    scores = [
        score_response(
            text,
            label,
            len(resp),
            max_response_tokens=max_new,
            buffer_tokens=r.reward.overlong_buffer,
            factor=r.reward.overlong_factor,
            apply_penalty=unit.train,
        )
        for text, label, resp in zip(texts, flat_labels, responses, strict=False)
    ]
    old_logp: list[list[float]] = []
    if unit.train:
        batch = make_batch(flat_prompts, responses, tok.pad_token_id, device)
        with torch.no_grad():
            lp = token_logprobs(response_logits(model, batch), batch).cpu()
        old_logp = [lp[i, : len(resp)].tolist() for i, resp in enumerate(responses)]
    return {
        "key": unit.key,
        "prompt_ids": flat_prompts,
        "response_ids": responses,
        "response_text": texts,
        "label": flat_labels,
        "old_logp": old_logp,
        "reward": [s.reward for s in scores],
        "correct": [bool(s.correct) for s in scores],
        "pred": [s.pred for s in scores],
        "penalty": [s.penalty for s in scores],
        "version": version,
        "generate_time_s": time.perf_counter() - t0,
    }


class RolloutWorker:
    """One rollout engine. Methods run in the actor's main thread (math-verify needs that).

    It keeps the pushed weights of the last few versions: a unit names the version it must be
    generated with (in an async run, rollout k+1's units want W_k after W_{k+1} has arrived), and
    the model is switched to it only when a unit asks for another version than it holds.
    """

    KEEP_VERSIONS = 3

    def __init__(self, recipe: dict[str, Any], index: int, model_path: str) -> None:
        self.recipe = Recipe.model_validate(recipe)
        setup_process(threads_of(self.recipe))
        self.index = index
        self.device = device_of(self.recipe)
        self.tok = load_tokenizer(model_path)
        self.model = load_policy(self.recipe, model_path)
        self.model.eval()
        self.version = -1  # the version the model holds now
        self.states: dict[int, Any] = {}  # version -> pushed weights (own copies)
        self.receiver: Any = None  # weight_sync's receiver, made by connect_weights

    def where(self) -> dict[str, Any]:
        return where_am_i("rollout", self.index)

    def connect_weights(self, kind: str, rendezvous: Any, rank: int, late: bool = False) -> None:
        """Make the receiver; with a rendezvous (nccl) join the weight group as ``rank``. ``late``:
        this worker replaces a dead one, after the run's first push (see :meth:`hold_weights`)."""
        from beam_hpc.backends.reference.rollouts.weight_sync import make_receiver

        self.receiver = make_receiver(kind, rendezvous=rendezvous, rank=rank, device=self.device, late=late)
        if rendezvous is not None:
            self.receiver.connect()

    def receive_weights(self, delivery: Any) -> int:
        """Take one push (every push, in order) and keep it: a copy, as the receiver's tensors may
        be views of buffers that the next push overwrites."""
        state, version = self.receiver.recv(delivery)
        self._keep(version, state)
        return version

    def hold_weights(self, version: int, state: dict[str, Any]) -> int:
        """Keep ``version``'s weights handed over directly (not pushed): what a worker started in
        place of a dead one gets of the versions pushed before it joined. Not through the trainer's
        sender, whose every push each live worker must receive in order. These are the bits a push
        carries: the trainer's object-store sender casts nothing (it is made without a dtype)."""
        self._keep(version, {n: t.to(self.device) for n, t in state.items()})
        return version

    def _keep(self, version: int, state: dict[str, Any]) -> None:
        self.states[version] = {n: t.clone() for n, t in state.items()}
        for old in sorted(self.states)[: -self.KEEP_VERSIONS]:
            del self.states[old]

    def use_version(self, version: int) -> None:
        if version != self.version:
            if version not in self.states:
                raise RuntimeError(f"rollout worker {self.index}: no pushed weights of version {version} "
                                   f"(holds {sorted(self.states)}); a unit was queued before its push")
            load_trainable_state(self.model, self.states[version])
            self.version = version

    def close(self) -> None:
        if self.receiver is not None:
            self.receiver.close()

    def generate_unit(self, unit: dict[str, Any]) -> dict[str, Any]:
        u = Unit.from_json(unit)
        self.use_version(u.version)
        return compute_unit(self.model, self.tok, self.recipe, self.device, u, u.version)

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
        """All ``prompts`` as one unit with the weights the model holds now (benchmarks call this)."""
        unit = Unit(purpose, rollout_id, 0, first_sample // samples_per_prompt, prompts, labels, samples_per_prompt,
                    train, self.version)
        return compute_unit(self.model, self.tok, self.recipe, self.device, unit, self.version)
