"""The reference backend: the Beam recipe (GRPO with DAPO's refinements) in plain torch on Ray.

Small and real: it runs the embedded default (``recipes/tiny.yaml``) on a laptop and is the
vehicle of every lifecycle test, with the same run-directory contract as the Miles backend
(checkpoint layout, save sentinel, metrics, dumps). Modules: ``driver`` (the loop), ``trainer``
and ``rollout_worker`` (the Ray actors), ``algorithm`` (advantages and loss), ``sampling``,
``policy``, ``prompt_source``, ``checkpoint``, ``offload``, ``metrics_log``, ``tiny_model``.
"""
