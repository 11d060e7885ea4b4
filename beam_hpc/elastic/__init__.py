"""Rollout capacity that comes and goes: fixed units of rollout work that any worker computes bit
for bit alike, the run's rendezvous and published policy versions, and the outside worker that
joins a running run through them (:mod:`beam_hpc.elastic.worker`)."""
