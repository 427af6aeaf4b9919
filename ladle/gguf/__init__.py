"""GGUF files (llama.cpp's format): where one is, its metadata and tensors, what its keys mean, its tokenizer.

A floor below the package root: root files (config, tokenizer) resolve and read GGUF files through it, and it
imports nothing of ladle's. Building a model from one is ladle.models.loading.loader's work.
"""
