"""Slurm on the login node and in the job: the client (every sbatch/scontrol/squeue/scancel call),
script rendering and the submitit heterogeneous-job plugin.
"""
