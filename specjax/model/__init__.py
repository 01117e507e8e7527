"""The LLaMA model: its shape (config), layers, KV cache, int8 weights, the
partition table of a mesh (sharding), and the jitted decode/verify steps."""
