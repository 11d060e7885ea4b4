"""beam-hpc: run the Beam GRPO/DAPO math-RL recipe as native Slurm batch work.

Import nothing heavy here: `beam-hpc render` must start fast on a login node.
"""

__version__ = "0.1.0"
