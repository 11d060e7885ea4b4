"""A segment's life inside Slurm, one module per concern: noticing the end coming (watchdog),
saving the rollout in flight (save), the pure rule book for what follows (decide), acting on it
(actions: resubmit, requeue), stopping a chain from outside (cancel), and what the segment did
(segment_metrics). Slurm itself is asked only through :mod:`beam_hpc.slurm.client`.
"""
