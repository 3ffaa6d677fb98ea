"""Triton kernels (import only through `dsv41.kernels.ops`, which falls back to the torch twins)."""
