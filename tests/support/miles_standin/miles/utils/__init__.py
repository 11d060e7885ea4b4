"""Stand-in for ``miles.utils`` (only ``arguments``): see tests/support/miles_standin/miles/utils/arguments.py."""
