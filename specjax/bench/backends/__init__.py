"""Backends: ways to run one specjax model, for timing them side by side.

A backend holds the weights of one specjax `params` tree and runs the same
call on them: one forward over N new tokens per row against a KV cache
holding `depth` tokens per row, rolled back to `depth` before every call
(the `Backend` interface and the parity check: `base`). BACKENDS: xla
(`forward_step` dispatched per call, as torch and llama.cpp pay), xla-loop
(`probes.CostProbe`, no dispatch: what the device loop pays), torch and
torch-compile (`pytorch`: HF eager over a DynamicCache; compiled over a
StaticCache, skipped with a note where compile fails), llama.cpp
(`llamacpp`: llama-cpp-python over a GGUF written from the same params).
Optional packages are imported on first use; a backend that cannot run
raises `base.Unavailable`. docs/engines.md; this package re-exports nothing.
"""

BACKENDS = ("xla", "xla-loop", "torch", "torch-compile", "llama.cpp")
