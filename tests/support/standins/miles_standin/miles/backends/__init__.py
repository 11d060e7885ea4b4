"""Stand-in for ``miles.backends`` (only ``sglang_utils.sglang_engine``), tests only."""
