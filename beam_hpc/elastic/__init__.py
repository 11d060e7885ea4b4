"""Rollout capacity that comes and goes, inside the allocation of an extra rollout job: the node
program (:mod:`extra_node`) that serves a running run's rollouts through the backend's outside worker
(reference: :mod:`beam_hpc.backends.reference.rollouts.outside_worker`; Miles: the SGLang engines of
:mod:`beam_hpc.backends.miles.external_engines`) and the run's record of its extra jobs
(:mod:`registry`), which ``status`` and ``plot`` read. The job's request and script are
:mod:`beam_hpc.submission.rollout_job`'s; the units, the unit service and the published policy
versions are the reference backend's own."""
