"""Answer checking and DAPO's overlong penalty (no Ray, no torch): the one scorer every backend uses.
"""
