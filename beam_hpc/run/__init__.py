"""The run directory's own records: ledger, lock, checkpoint layout, metric names.
"""
