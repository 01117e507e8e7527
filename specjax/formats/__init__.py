"""Checkpoints and tokenizers on disk: HF directories and safetensors, orbax,
GGUF reading and writing, and the one loader that dispatches between them."""
