"""Backends: ways to run one specjax model, for timing them side by side.

A backend holds the weights of one specjax `params` tree and runs the same
call on them: one forward over N new tokens per row against a KV cache
already holding `depth` tokens per row, rolled back to `depth` before every
call (the `Backend` interface and the parity check: `base`).

  xla            specjax's jitted `forward_step`, dispatched from the host per
                 call (bench's pp test). Pays Python dispatch, as torch and
                 llama.cpp do: the per-call comparison (`xla`).
  xla-loop       `probes.CostProbe`: k forwards inside one jitted loop, no
                 dispatch (what the on-device speculative loop pays; the
                 cost the sweep uses). Batch 1 only (`xla`).
  torch          HF `LlamaForCausalLM` from `hf.to_torch_model` (the one
                 conversion), eager, a `DynamicCache` cropped back to depth
                 (`pytorch`).
  torch-compile  the same model, `torch.compile`d, over a `StaticCache` of
                 the XLA cache's capacity (`pytorch`). Skipped with a note
                 where compile fails.
  llama.cpp      llama-cpp-python over a GGUF file written from the same
                 params (`gguf_write.write_gguf`), one `llama_decode` of B N
                 tokens with every logit requested (`llamacpp`). Unavailable
                 with a note where the package is missing.

Optional packages (torch, transformers, llama-cpp-python, gguf) are imported
on first use, so every submodule imports without them; a backend that cannot
run raises `base.Unavailable`. Import the submodules themselves: this package
re-exports nothing.
"""

BACKENDS = ("xla", "xla-loop", "torch", "torch-compile", "llama.cpp")
