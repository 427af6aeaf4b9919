"""Attention: the step's metadata, the backends (torch reference, Triton) and their kernels."""
