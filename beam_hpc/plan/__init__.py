"""The Plan: recipe + site -> everything a run needs, by pure code, computed once before submission;
and paths: every run-directory and segment-directory name.

Imports no Slurm, Ray, submitit or torch.
"""
