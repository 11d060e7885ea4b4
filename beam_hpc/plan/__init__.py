"""The Plan: recipe + site -> everything a run needs, by pure code, computed once before submission.

Imports no Slurm, Ray, submitit or torch.
"""
