"""The Miles backend: flags, argument builder, checks, launch, placement, checkpoint, convert, reward.
"""
