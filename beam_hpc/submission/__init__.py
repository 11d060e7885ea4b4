"""One submission request, scheduled by sbatch, submitit or locally; the resume guard.

Login-node code: nothing inside the allocation imports it.
"""
