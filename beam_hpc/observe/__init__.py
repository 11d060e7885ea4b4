"""Read a run directory (status, plot, logs) and check a cluster (doctor); never write a run.
"""
