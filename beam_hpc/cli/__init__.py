"""`beam-hpc`: the command line, the only layer that prints for people and picks exit codes.
"""
