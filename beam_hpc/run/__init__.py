"""The run directory's own records: ledger, lock, checkpoint layout, metric names, the resume
identity, and the one atomic-write and file-lock helper (files) that every layer uses.
"""
