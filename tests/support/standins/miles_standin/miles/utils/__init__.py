"""Stand-in for ``miles.utils`` (only ``arguments``): see tests/support/standins/miles_standin/miles/utils/arguments.py."""
