"""Stand-in for ``miles.ray.rollout`` (only ``server_group``), tests only."""
