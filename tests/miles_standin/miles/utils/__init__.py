"""Stand-in for ``miles.utils`` (only ``arguments``): see tests/miles_standin/miles/utils/arguments.py."""
