"""The job inside the allocation: the segment (lock, ledger, lifecycle around it), the runner,
launchers, readiness and the smoke driver.
"""
