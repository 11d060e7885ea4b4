"""How a Ray node says which node group it belongs to: one label key and one custom resource
per group (``beam-group=trainer``, resource ``beam_trainer``).

Its own small module because every stage needs the same two names (the plan, the node step that
starts Ray, readiness, both backends' placement) and none of them should import the others for it.
"""

from __future__ import annotations

GROUP_RESOURCE_PREFIX = "beam_"  # Ray custom resource per group: beam_trainer, beam_rollout
GROUP_LABEL_KEY = "beam-group"  # Ray node label key (ray start --labels)
