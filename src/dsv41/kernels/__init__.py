"""Kernels behind one boundary: `ops` dispatches to Triton (CUDA) or the torch twins in `ref`."""
