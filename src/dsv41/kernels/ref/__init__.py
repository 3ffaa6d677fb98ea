"""Torch twins of the kernels: the executable spec, any device, autograd-safe."""
