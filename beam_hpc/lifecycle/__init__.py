"""A segment's life inside Slurm: watchdog, save sentinel, the pure decide rules, cancel.
"""
