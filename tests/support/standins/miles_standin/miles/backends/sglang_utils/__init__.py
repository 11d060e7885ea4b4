"""Stand-in for ``miles.backends.sglang_utils`` (only ``sglang_engine``), tests only."""
