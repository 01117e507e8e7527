"""Batch scaling: T(N) of one forward over N new tokens, XLA vs PyTorch vs llama.cpp.

Default (random weights at llama-160m and cpu-target shapes, depths 128 and
1024, every backend; tens of minutes on a 2-core CPU, torch.compile's
compiles included):
  python experiments/batch_scaling.py --config=configs/batch_scaling.py --workdir=/tmp/specjax_scaling
Quick (llama-160m, depth 128, a subset of N, no torch.compile; about a
minute on 2 cores):
  python experiments/batch_scaling.py --config=configs/batch_scaling.py:quick --workdir=/tmp/specjax_scaling_quick
GPU (llama-7b bf16 added; llama.cpp left out: its wheel here is CPU-only):
  python experiments/batch_scaling.py --config=configs/batch_scaling.py:gpu --workdir=/tmp/specjax_scaling_gpu
Override any field (a list of names may also be one comma-separated string;
quote it where absl's parser refuses a bare list, e.g. names with '-'):
  python experiments/batch_scaling.py --config=configs/batch_scaling.py:quick \
      --config.depths=128,512 --config.backends=xla,torch \
      --config.models="'llama-160m,cpu-target'" --workdir=/tmp/sc
Single-threaded on every backend (fair on a busy machine):
  XLA_FLAGS=--xla_cpu_multi_thread_eigen=false python experiments/batch_scaling.py \
      --config=configs/batch_scaling.py:quick --config.threads=1 --workdir=/tmp/sc1
llama.cpp needs the optional extra (builds llama.cpp from source):
  pip install -e '.[llamacpp]'
"""

import ml_collections

ALL_BACKENDS = ("xla", "xla-loop", "torch", "torch-compile", "llama.cpp")


def get_config(arg: str = "default") -> ml_collections.ConfigDict:
  c = ml_collections.ConfigDict()
  c.models = ("llama-160m", "cpu-target")  # shapes: presets (random weights), HF or orbax dirs, GGUF files
  c.dtypes = ("float32",)          # compute = param dtype, the same on every backend
  c.n_tokens = (1, 2, 3, 4, 5, 6, 8, 9, 12, 16, 32, 64)  # N per forward at B = 1; includes 1
  c.depths = (128, 1024)           # tokens already in the KV cache before every call (n_depth)
  c.batches = (1, 2, 4, 8)         # B rows per call; B > 1 is the batched-bench view
  c.batch_n_tokens = (1, 5, 16)    # N measured at B > 1
  c.backends = ALL_BACKENDS        # subset of ALL_BACKENDS; xla (the parity reference) required
  c.reps = 5                       # timed repetitions per backend, point and round
  c.rounds = 2                     # passes over the backends per N (order rotated); times pooled
  c.loop_k = 4                     # xla-loop: forwards per jitted loop
  c.threads = 0                    # torch and llama.cpp threads; 0 = XLA's pool (see XLA_FLAGS above)
  c.torch_attention = "sdpa"       # HF attention implementation: sdpa or eager
  c.compile_dynamic = "auto"       # torch.compile dynamic=: auto (torch's default), true, false
  c.llamacpp_flash_attn = "off"    # llama.cpp flash attention: off (llama-bench's), on, auto
  c.alpha = 0.8                    # acceptance rate for the speedup each curve allows
  c.gamma = 4                      # draft length for that speedup (needs N = gamma + 1 measured)
  c.c = 0.0                        # draft/target cost ratio; 0 = T_draft(1)/T(1) measured on xla
  c.draft = "cpu-draft"            # the draft measured for c (when c = 0)
  c.seed = 0                       # random weights and tokens
  if arg == "quick":
    c.models = ("llama-160m",)
    c.depths = (128,)
    c.n_tokens = (1, 2, 4, 5, 8, 16)
    c.batches = (1, 4)
    c.batch_n_tokens = (1, 5)
    c.backends = ("xla", "xla-loop", "torch", "llama.cpp")
    c.reps = 3
    c.rounds = 1
  elif arg == "tiny":  # tests: the whole path in seconds
    c.models = ("tiny",)
    c.draft = "tiny-draft"
    c.depths = (16,)
    c.n_tokens = (1, 2)
    c.batches = (1, 2)
    c.batch_n_tokens = (2,)
    c.backends = ("xla", "xla-loop", "torch", "llama.cpp")
    c.reps = 1
    c.rounds = 2
    c.loop_k = 2
    c.gamma = 1
  elif arg == "gpu":  # experiments/gpu_check.py-style: add the seed thread's 7B, bf16
    c.models = ("llama-160m", "cpu-target", "llama-7b")
    c.dtypes = ("bfloat16",)
    c.backends = ("xla", "xla-loop", "torch", "torch-compile")
    c.depths = (128, 1024)
  elif arg != "default":
    raise ValueError(f"unknown batch_scaling variant {arg!r}: use default, quick, tiny or gpu")
  return c
