"""What runs on every node: the node step, Ray command lines and environment, the container seam,
the image, NVMe staging, and the doctor's node checks.
"""
