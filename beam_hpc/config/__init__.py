"""Strict input: YAML loading, overrides, the recipe schema and site profiles.

``strict_yaml`` is the one YAML reader (recipes, sites and ``--set`` values alike); ``recipe``
holds the schema, its value ranges and the overrides; ``site`` the site profiles.

Imports no Slurm, Ray, submitit or torch.
"""
