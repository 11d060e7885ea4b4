"""The package's version, in a module of its own that imports nothing.

Why not only in ``beam_hpc/__init__.py``: the package face names the public API (``submit``,
``Plan``, ...), which lives in the top layers, so a script renderer in ``slurm`` that imported the
version from there would import upward through the face. Here every layer may read it.
``pyproject.toml`` and ``apptainer.def`` spell the same number; ``tests/node/test_apptainer_def.py``
holds the image label to it.
"""

__version__ = "0.1.0"
