"""The recipe's data: ``prepare`` (the data directory and its manifest) from ``sources`` (local
files or the Hub) through ``convert`` (upstream rows -> Miles records), and the tiny synthetic set.
"""
