"""Tiered routed experts: a MoE model's routed experts kept in a backing tier (host memory, or the checkpoint's
own files) with a cache of expert slots on the device shared by all MoE layers (--moe-cache-size), so a model
whose experts do not fit beside its KV pool still runs, and computes exactly what the resident model does."""
