"""A segment's life inside Slurm, one module per concern: its start (start), noticing the end
coming (watchdog) and acting on it (stopping, with save for the rollout in flight and stall for
hangs), the pure rule book for what follows (decide), the end that carries it out (end, through
actions: resubmit, requeue), stopping a chain from outside (cancel), and what the segment did
(segment_metrics). Slurm itself is asked only through :mod:`beam_hpc.slurm.client`.
"""
