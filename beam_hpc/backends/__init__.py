"""Backends: the programs that run the recipe once Ray is up (reference in torch, Miles in production)."""
