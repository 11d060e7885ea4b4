"""Contract double of the ``miles`` package (radixark/miles), for tests only.

Miles runs only in its GPU image, so it cannot be installed on these machines. This package holds
just what beam-hpc's driver launcher touches and what the double's driver runs: ``miles.ray.placement_group``
with the same three module globals and call shape as Miles's (see that module); the rollout side of
``--use-fault-tolerance`` (``miles.utils.health_monitor``, whose docstring lists what Miles main does
when an engine dies, ``miles.ray.rollout.server_group`` / ``rollout_manager`` and
``miles.backends.sglang_utils.sglang_engine``, engines that run the SGLang stand-in); beside it, the
entry points ``train_async.py`` and ``train.py`` (``standin_driver``: flags, sentinel, save and resume as
Miles does them) and the converter ``tools/convert_hf_to_torch_dist.py``.
"""
