"""The reference backend: the Beam recipe (GRPO with DAPO's refinements) in plain torch on Ray.

Small and real: it runs the embedded default (``recipes/tiny.yaml``) on a laptop and is the
vehicle of every lifecycle test, with the same run-directory contract as the Miles backend
(checkpoint layout, save sentinel, metrics, dumps). Three rooms, each importing only the ones
below it (``tests/test_layout.py`` holds the order):

- ``loop/``: one segment's RL loop: the driver, the trainer actor, the GRPO/DAPO algorithm, the
  optimizer and its NVMe offload, checkpoints, metrics, the prompt order.
- ``rollouts/``: who computes rollouts and how they are served: the fixed units, the segment's own
  rollout worker actors, the authenticated unit service for outside workers, the outside worker
  program, the published policy versions and the weight sync from trainer to workers.
- ``model/``: the causal LM, its sampling, LoRA, the chat tokenizer, the policy loader, and the
  tiny and SmolLM2 models the recipes name.
"""
