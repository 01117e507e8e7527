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
  elif arg in ("smollm2", "smollm2_tiny"):
    return smollm2_config(arg)
  elif arg not in ("default", "eagle", "eagle_tiny"):
    raise ValueError(f"unknown train variant {arg!r}: use default, tiny, eagle, eagle_tiny, "
                     f"smollm2 or smollm2_tiny")
  return c


def smollm2_config(arg: str) -> ml_collections.ConfigDict:
  """Drafts for SmolLM2-135M-Instruct trained on its own replies
  (specjax/train/selfdistill.py; experiments/train_smollm2.py):
    python experiments/train_smollm2.py --workdir=/tmp/specjax_smollm2 --export_dir=specjax/assets
  """
  c = ml_collections.ConfigDict()
  c.target = "smollm2-135m"
  c.seed = 0
  c.max_files = 0                # stdlib files used (0 = all; tests)
  # The prompt mix (train/replies.prompt_mix): prompts per kind; every
  # heldout_every-th is held out for the acceptance measurement. The shipped
  # head was trained on this mix (1,000 steps); the shipped draft on the
  # first, half-sized one (code=280, prose=120, instruct=160, followups=120,
  # stdlib_tokens=80_000, no edits; docs/results/taskbench_log.md). edit: targeted code
  # edits (replies.EDIT_ASKS), answered apart, so adding them keeps the other
  # replies (the head shipped from commit 1ec6b13 to 2983474: edit=0).
  c.mix = ml_collections.ConfigDict(dict(code=640, prose=240, instruct=320, math=60, edit=320))
  c.heldout_every = 20
  c.followups = 240              # second-turn conversations after the first replies
  c.n_new = 192                  # reply length (greedy, up to EOS)
  c.gen_batch = 32
  c.stdlib_tokens = 160_000      # raw stdlib documents, in pieces of doc_len tokens
  c.doc_len = 256
  c.eval_share = 0.03            # sequences held out for the held-out losses
  c.top_k = 32                   # soft labels: the target's top-k probabilities
  c.feat_batch = 4
  c.head_name = "smollm2-eagle"
  # EAGLE-1 head: one decoder layer at the target's width (4.2 M params).
  c.head_train = _train(1000, 8, 256, 2e-3, 25, seed=3, ce_weight=0.1, eval_every=100,
                        eval_batches=4, ckpt_every=50, log_every=10)
  # Distilled draft: 128 wide, 4 layers, the target's vocabulary (7.1 M params,
  # 6.3 M of them the tied embedding); bfloat16 on disk, about 14 MB.
  c.draft = _model(128, 4, 4, 2, 384, max_seq_len=8192)
  c.draft.name = "smollm2-draft"
  c.draft_train = _train(500, 16, 256, 3e-3, 30, seed=4, ce_weight=0.1, eval_every=100,
                         eval_batches=4, ckpt_every=50, log_every=10)
  c.export_dtype = "bfloat16"
  c.alpha_prompts = 24
  c.alpha_gamma = 4
  c.alpha_n_predict = 96
  c.alpha_temps = (0.0, 1.0)
  if arg == "smollm2_tiny":
    c.max_files = 6
    c.mix = ml_collections.ConfigDict(dict(code=4, prose=2, instruct=4, math=2, edit=2))
    c.heldout_every = 4
    c.followups = 2
    c.n_new = 8
    c.gen_batch = 4
    c.stdlib_tokens = 600
    c.doc_len = 64
    c.eval_share = 0.3
    c.top_k = 4
    c.head_train = _train(2, 2, 16, 3e-3, 1, seed=3, ce_weight=0.1, eval_every=2,
                          eval_batches=1, ckpt_every=1, log_every=1)
    c.draft = _model(32, 1, 2, 1, 64, max_seq_len=512)
    c.draft.name = "smollm2-draft"
    c.draft_train = _train(2, 2, 16, 3e-3, 1, seed=4, ce_weight=0.1, eval_every=2,
                           eval_batches=1, ckpt_every=1, log_every=1)
    c.alpha_prompts = 2
    c.alpha_n_predict = 6
    c.alpha_temps = (0.0,)
  # Uniform noise in [-x, x] on the head's input features (EAGLE's
  # augmentation; 0 = off, as the shipped head was trained).
  c.head_train.feature_noise = 0.0
  # The head also reads each pair's current token (drafters/eagle.reads_prev_token: fc 3E -> E),
  # so that one layer can copy from the context; off: EAGLE-1's pair (the shipped head).
  c.head_train.prev_token = False
  # EAGLE-3 head (--stages=head3; specjax/train/eagle3.py, eagle3_stage.py):
  # fuses the target's layers head3_layers (() = 2, L//2, L-3), drafts over
  # the head3_vocab most frequent ids of the target's replies (specials
  # included), trained with training-time test over ttt_steps steps, the
  # loss of step j weighted ttt_decay^(j-1).
  c.head3_name = "smollm2-eagle3"
  c.head3_vocab = 8192
  c.head3_layers = ()
  # "own": the head trains and stores its LM head over the set; "target": it
  # reads the target's rows of the set, frozen, and stores none (a few MB).
  c.head3_lm_head = "own"
  # An EAGLE-1 head (name or path) to start fc and the layer from ("": random).
  c.head3_init = ""
  # The exported head's weights: float32, bfloat16 or int8 (kernels per channel).
  c.head3_dtype = "bfloat16"
  # One step (8 x 256, k = 6, V_d 8,192) took 11.5-22 s on 2 loaded Xeon cores
  # (docs/training.md): 500 steps are 1.6-3 h there.
  c.head3_train = _train(500, 8, 256, 2e-3, 25, seed=5, eval_every=50, eval_batches=4,
                         ckpt_every=25, log_every=5)
  if arg == "smollm2_tiny":
    c.head3_vocab = 256
    c.head3_train = _train(2, 2, 16, 3e-3, 1, seed=5, eval_every=2, eval_batches=1,
                           ckpt_every=1, log_every=1)
  c.head3_train.ttt_steps = 3 if arg == "smollm2_tiny" else 6
  c.head3_train.ttt_decay = 0.8
  return c
