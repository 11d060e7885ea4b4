"""Strict input: YAML loading, overrides, the recipe schema and site profiles.

Imports no Slurm, Ray, submitit or torch.
"""
