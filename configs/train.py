"""Training the shipped target/draft pair on the standard library's source.

The whole pipeline (about an hour on a 2-core CPU; every stage resumes):
  python experiments/train.py --config=configs/train.py --workdir=/tmp/specjax_train \
      --export_dir=specjax/assets
Tiny (seconds; what the tests run):
  python experiments/train.py --config=configs/train.py:tiny --workdir=/tmp/specjax_tiny
Override any field, e.g. --config.target_train.steps=300.

The EAGLE head of the shipped target (experiments/train_eagle.py):
  python experiments/train_eagle.py --config=configs/train.py:eagle \
      --workdir=/tmp/specjax_eagle --export_dir=specjax/assets
  (eagle_tiny: a few steps on a few files, seconds.)
"""

import ml_collections


def _model(dim, n_layers, n_heads, n_kv_heads, ffn_dim, max_seq_len=1024):
  return ml_collections.ConfigDict(dict(dim=dim, n_layers=n_layers, n_heads=n_heads,
                                        n_kv_heads=n_kv_heads, ffn_dim=ffn_dim,
                                        max_seq_len=max_seq_len))


def _train(steps, batch, seq_len, lr, warmup, seed, ce_weight=0.0, eval_every=150,
           eval_batches=8, ckpt_every=100, log_every=10):
  return ml_collections.ConfigDict(dict(
      steps=steps, batch=batch, seq_len=seq_len, lr=lr, warmup=warmup, min_lr_ratio=0.1,
      weight_decay=0.1, clip=1.0, b1=0.9, b2=0.95, seed=seed, ce_weight=ce_weight,
      eval_every=eval_every, eval_batches=eval_batches, ckpt_every=ckpt_every,
      log_every=log_every, keep=2))


def get_config(arg: str = "default") -> ml_collections.ConfigDict:
  c = ml_collections.ConfigDict()
  c.vocab_size = 4096            # byte-level BPE, trained on the training split
  c.heldout_per_mille = 50       # files held out (by a hash of their path)
  c.max_files = 0                # use only the first N train files (0 = all; tests)
  # Target: 6.9 M params (tied embeddings), GQA 8/4, head_dim 32.
  c.target = _model(256, 8, 8, 4, 688)
  # Draft: 1.6 M params, 2 layers; one decode step costs ~7 % of the target's.
  c.draft = _model(192, 2, 6, 2, 512)
  c.target_train = _train(900, 16, 256, 2e-3, 60, seed=0)
  c.draft_train = _train(600, 16, 256, 3e-3, 40, seed=1)
  # Distillation starts from the cross-entropy draft: KL to the target's
  # soft labels on the training split.
  c.distill_train = _train(600, 16, 256, 1e-3, 30, seed=2)
  c.export_dtype = "bfloat16"    # shipped weights (halves the size); run in float32
  # Acceptance before/after distillation, by the engine (--accept=real).
  c.alpha_prompts = 16           # held-out prompts (batched)
  c.alpha_prompts_saved = 32     # prompts written to heldout_prompts.json (the sweep's)
  c.alpha_prompt_tokens = 64
  c.alpha_gamma = 4
  c.alpha_n_predict = 64
  c.alpha_temps = (0.0, 1.0)
  # EAGLE-1 head of the shipped target (specjax/eagle.py): one decoder
  # layer over fc([embedding ; target feature]); ce_weight is the paper's w.
  c.eagle_target = "stdlib-target"
  # Sized to ~20-25 min at the 350-550 tokens/s measured on 2 shared cores.
  c.eagle_train = _train(120, 16, 256, 3e-3, 10, seed=3, ce_weight=0.1, eval_every=40,
                         ckpt_every=30, log_every=5)
  c.eagle_drafts = ("stdlib-draft",)  # compared with the head (alpha, same prompts)
  if arg in ("eagle_tiny",):
    c.max_files = 4
    c.alpha_prompts = 2
    c.alpha_prompt_tokens = 16
    c.alpha_n_predict = 8
    c.alpha_temps = (0.0,)
    c.eagle_train = _train(4, 2, 32, 3e-3, 1, seed=3, ce_weight=0.1, eval_every=2,
                           eval_batches=1, ckpt_every=2, log_every=2)
  if arg == "tiny":
    c.vocab_size = 300
    c.max_files = 20
    c.alpha_prompts_saved = 2
    c.target = _model(32, 2, 4, 2, 64, max_seq_len=256)
    c.draft = _model(16, 1, 2, 1, 32, max_seq_len=256)
    tiny = dict(eval_every=4, eval_batches=1, ckpt_every=2, log_every=2)
    c.target_train = _train(6, 2, 32, 3e-3, 1, seed=0, **tiny)
    c.draft_train = _train(4, 2, 32, 3e-3, 1, seed=1, **tiny)
    c.distill_train = _train(4, 2, 32, 3e-3, 1, seed=2, **tiny)
    c.alpha_prompts = 2
    c.alpha_prompt_tokens = 16
    c.alpha_n_predict = 8
    c.export_dtype = "float32"
  elif arg not in ("default", "eagle", "eagle_tiny"):
    raise ValueError(f"unknown train variant {arg!r}: use default, tiny, eagle or eagle_tiny")
  return c
