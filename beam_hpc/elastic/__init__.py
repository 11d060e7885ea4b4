"""Rollout capacity that comes and goes: extra Slurm jobs that join a running run."""
