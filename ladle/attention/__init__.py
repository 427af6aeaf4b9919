"""Attention: the backends (torch reference, CPU, Triton) by name, the selector that gives each KV cache group
one, the metadata they build for a step, and their kernels."""
