"""Who computes rollouts and how they are served: the fixed units every rollout is cut into (whose
results do not depend on who computes them), the segment's own rollout worker actors, the unit
service that outside workers lease units from (authenticated before a body is read), the outside
worker program, the published policy versions, and the weight sync from trainer to workers.
It uses ``model`` and never the loop that drives it."""
