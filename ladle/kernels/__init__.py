"""Triton kernels for the model's non-attention ops on CUDA (fused norms and activations, MoE experts)."""
