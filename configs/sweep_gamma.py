"""The gamma x acceptance sweep.

Default (random weights, no download; 9 minutes on a 2-core AVX2-only AMD EPYC at commit 03bb959,
14 before the rules of one gamma shared their target-only runs and probes):
  python experiments/sweep_gamma.py --config=configs/sweep_gamma.py --workdir=/tmp/specjax_sweep
Quick (3 minutes on the same machine):
  python experiments/sweep_gamma.py --config=configs/sweep_gamma.py:quick --workdir=/tmp/specjax_quick
Real acceptance with the shipped trained pair (held-out stdlib prompts, T=0 and 1):
  python experiments/sweep_gamma.py --config=configs/sweep_gamma.py:real --workdir=/tmp/specjax_real
The batch x gamma surface (batches 1..32, auto gamma; see the README for its time):
  python experiments/sweep_gamma.py --config=configs/sweep_gamma.py:batch --workdir=/tmp/specjax_batch
Every drafter (model, ngram, layerskip:4, eagle) on the shipped target, on the continuation or
the code-editing prompts:
  python experiments/sweep_gamma.py --config=configs/sweep_gamma.py:drafters --workdir=/tmp/specjax_drafters
  python experiments/sweep_gamma.py --config=configs/sweep_gamma.py:drafters \
      --config.prompt_set=editing --workdir=/tmp/specjax_drafters_edit
An Instruct target's prompts as its users send them (each a user turn through the target's chat
template; a target without one is refused):
  python experiments/sweep_gamma.py --config=configs/sweep_gamma.py:drafters --config.chat=True \
      --config.target=/path/to/instruct --config.drafters="('ngram','layerskip:4')" \
      --workdir=/tmp/specjax_chat
Chains next to token trees (tokens/step and speedup measured vs predicted, the crossover batch,
auto vs the best fixed tree; bench/sweep/trees.py, docs/trees.md):
  python experiments/sweep_gamma.py --config=configs/sweep_gamma.py:trees --workdir=/tmp/specjax_trees
  python experiments/sweep_gamma.py --config=configs/sweep_gamma.py:trees_quick --workdir=/tmp/specjax_tq
  python experiments/sweep_gamma.py --config=configs/sweep_gamma.py:trees \
      --config.prompt_set=editing --workdir=/tmp/specjax_trees_edit
Speedup by context depth x batch x gamma on the long-context suite (bench/sweep/contexts.py,
docs/streaming.md "Long prompts"):
  python experiments/sweep_gamma.py --config=configs/sweep_gamma.py:long_context --workdir=/tmp/specjax_long
  python experiments/sweep_gamma.py --config=configs/sweep_gamma.py:long_context_quick --workdir=/tmp/specjax_lq
Per-row lengths (--gamma=auto:rows) beside the fixed gammas and auto, on the task suite's mixed
batches (rows drawn from every category in turn; bench/sweep/rows.py, docs/packed_verify.md):
  python experiments/sweep_gamma.py --config=configs/sweep_gamma.py:taskbench_mixed --workdir=/tmp/specjax_mixed
  python experiments/sweep_gamma.py --config=configs/sweep_gamma.py:taskbench_mixed_quick --workdir=/tmp/specjax_mq
Any gamma sweep gains per-row points with row_budgets:
  python experiments/sweep_gamma.py --config=configs/sweep_gamma.py:batch_quick \
      --config.row_budgets=default,auto,12 --workdir=/tmp/specjax_rows
Override any field:
  python experiments/sweep_gamma.py --config=configs/sweep_gamma.py:quick \
      --config.gammas=1,2,3 --config.accepts="('bernoulli:0.7','always')" --workdir=/tmp/sw
"""

import ml_collections


def get_config(arg: str = "default") -> ml_collections.ConfigDict:
  if arg in ("taskbench", "taskbench_quick"):
    return taskbench_config(arg)
  if arg in ("taskbench_mixed", "taskbench_mixed_quick"):
    return mixed_config(arg)
  if arg in ("long_context", "long_context_quick"):
    return long_context_config(arg)
  c = ml_collections.ConfigDict()
  c.target = "cpu-target"        # target: preset, HF directory or orbax directory
  c.draft = "cpu-draft"          # draft: same forms; must share the target's vocabulary
  c.drafters = ()                # > 1 drafter: compared in one sweep (a dimension); () = c.drafter
  c.prompt_set = "continuation"  # shipped held-out prompts: continuation | editing
  c.drafter = "model"            # model (c.draft) | ngram[:A-B] | layerskip:N | layerskip:LIST
  c.dtype = ""                   # compute/param dtype of both ("" = the models' own)
  c.gammas = (1, 2, 3, 4, 8)     # draft lengths
  c.accepts = ("bernoulli:0.6", "bernoulli:0.8", "fraction:0.8", "always", "real")  # rules
  c.temps = (0.0,)               # sampling temperatures (0 = greedy)
  c.top_k = 0                    # top-k for both models (0 = off)
  c.top_p = 1.0                  # top-p for both models (1 = off)
  c.prompt = ""                  # prompt text (needs a tokenizer); "" = built-in
  c.prompt_tokens = ""           # prompt as comma-separated ids; "" = built-in
  c.heldout_prompts = 0          # > 0: that many shipped held-out prompts instead (run in turn)
  c.chat = False                 # each prompt as a user turn through the target's chat template
  c.n_predict = 64               # tokens generated per run
  c.ctx_size = 256               # context; the cache holds ctx_size + max(gammas) + 1
  c.reps = 3                     # repetitions; target-only and speculative alternate (medians)
  c.seed = 0                     # sampling and random-init seed (draft uses seed + 1)
  c.measure_split = True         # one host-loop run per point for the draft/verify/rest split
  c.batches = (1,)               # rows per run (ragged prompts); > 1 value: the batch outputs
  c.auto_gamma = False           # also points whose gamma is chosen at run time from gammas
  c.auto_calibrate = True        # ... from each gamma's loop step timed after warm-up
  c.auto_every = 8               # ... re-chosen after chunks of 1, 2, 4, .. this many steps
  c.row_budgets = ()             # per-row lengths: a point per budget, gamma auto:rows,max=max(gammas)
                                 # ,budget=..: default (none given) | auto (chosen at run time) | N
                                 # (tokens verified per step; its points at batches B <= N)
  c.trees = ()                   # token trees (model.tree specs, auto): bench/sweep/trees.py
  c.siblings = "topk"            # ... a tree's siblings: the draft's top-k | stochastic (from q)
  c.auto_candidates = ""         # ... auto's candidates: "" the static trees | auto[:N1,..] (--tree=auto's)
  c.taskbench = ()               # task suite categories (mixed: rows of every category in turn):
                                 # bench/sweep/taskbench_run.py
  c.taskbench_category = ""      # ... the category one of its sweeps runs (set by the runner)
  c.taskbench_prompts = 0        # ... conversations per category (0 = all)
  c.taskbench_trees = ()         # ... tree rows, DRAFTER@TREE (a fixed tree, or auto[:N1,..])
  c.taskbench_suite = "dev"      # ... dev (specjax/assets/taskbench) | eval (taskbench_eval) | long
  c.contexts = ()                # context depths: a gamma sweep per context (bench/sweep/contexts.py)
  c.context = 0                  # ... the context one of its sweeps runs (set by the runner)
  c.noise_threshold = 0.15       # flag the run when target-only speed or T(1) spreads more
  if arg == "quick":
    c.gammas = (1, 2, 4, 8)
    c.accepts = ("bernoulli:0.8", "always")
    c.n_predict = 64
    c.ctx_size = 128
    c.reps = 3
    c.measure_split = False
  elif arg == "gpu":  # experiments/gpu_check.py: the seed thread's pair, bf16
    c.target, c.draft, c.dtype = "llama-7b", "llama-160m", "bfloat16"
    c.gammas = (1, 2, 4)          # each (gamma, rule kind) compiles a 7B loop: few points
    c.accepts = ("bernoulli:0.8", "always")
    c.n_predict = 128
    c.ctx_size = 512
    c.measure_split = False
  elif arg == "gpu_batch":  # experiments/gpu_check.py's batch part: where the speedup crosses 1x
    c.target, c.draft, c.dtype = "llama-7b", "llama-160m", "bfloat16"
    c.batches = (1, 8, 32)
    c.gammas = (1, 4)
    c.accepts = ("bernoulli:0.8",)
    c.n_predict = 64
    c.ctx_size = 256
    c.reps = 2
    c.measure_split = False
  elif arg == "real":  # the shipped trained pair: real acceptance (about 10 minutes)
    c.target, c.draft, c.dtype = "stdlib-target", "stdlib-draft", "float32"
    c.gammas = (1, 2, 3, 4, 6, 8)
    c.accepts = ("real",)
    c.temps = (0.0, 1.0)
    c.heldout_prompts = 8
    c.ctx_size = 256
  elif arg in ("batch", "batch_quick"):  # the batch x gamma surface, with auto gamma
    # The shipped pair's shapes (8M / 1.6M params): every (B, gamma) compiles a loop, and
    # compiling is most of the time; simulated acceptance, so the weights do not matter.
    c.target, c.draft = "stdlib-target", "stdlib-draft"
    c.gammas = (1, 2, 4, 8)
    c.accepts = ("bernoulli:0.8", "always")
    c.dtype = "float32"
    c.batches = (1, 2, 4, 8, 16, 32)
    c.auto_gamma = True
    c.n_predict = 32
    c.ctx_size = 96
    c.reps = 2
    c.measure_split = False
    if arg == "batch_quick":  # tests / CI: tiny models, seconds
      c.target, c.draft = "tiny", "tiny-draft"
      c.batches = (1, 4)
      c.gammas = (1, 4)
      c.accepts = ("bernoulli:0.8",)
      c.n_predict, c.ctx_size, c.reps = 16, 64, 1
  elif arg == "drafters":  # every drafter on the shipped target (about 25 minutes per prompt set)
    c.target, c.draft, c.dtype = "stdlib-target", "stdlib-draft", "float32"
    c.drafters = ("model", "ngram", "layerskip:4", "eagle")
    c.gammas = (1, 2, 4, 8)
    c.accepts = ("real",)
    c.temps = (0.0, 1.0)
    c.heldout_prompts = 8
    c.ctx_size = 256
    c.measure_split = False
  elif arg in ("trees", "trees_quick"):  # chains next to token trees (bench/sweep/trees.py)
    # Chains of 1, 2, 4, 8 drafts next to Sequoia's best trees of 4..64 nodes (depth <= 8) at
    # model.tree's default p (0.6, 0.2, 0.1): one fixed topology per size for every point, so
    # measured and predicted differ only by the acceptance, not by the tree; auto chooses
    # among them at run time. The shipped pair, the model drafter and the EAGLE head.
    c.target, c.draft, c.dtype = "stdlib-target", "stdlib-draft", "float32"
    c.drafters = ("model", "eagle")
    c.trees = ("chain:1", "chain:2", "chain:4", "chain:8", "sequoia:4,8", "sequoia:8,8",
               "sequoia:16,8", "sequoia:32,8", "sequoia:64,8", "auto")
    c.accepts = ("real",)
    c.temps = (0.0, 1.0)
    c.batches = (1, 4, 16, 32)
    c.heldout_prompts = 4
    c.n_predict = 48
    c.ctx_size = 256
    c.reps = 2
    c.measure_split = False
    if arg == "trees_quick":  # a few minutes on 2 cores: tiny models, simulated ranks
      c.target, c.draft, c.dtype = "tiny", "tiny-draft", "float32"
      c.drafters = ("model",)
      c.trees = ("chain:1", "chain:4", "sequoia:8,4", "sequoia:16,4", "auto")
      c.accepts = ("siblings:0.8,0.4",)
      c.temps = (0.0,)
      c.batches = (1, 4)
      c.heldout_prompts = 0
      c.n_predict, c.ctx_size, c.reps = 64, 160, 2
  elif arg != "default":
    raise ValueError(f"unknown sweep variant {arg!r}: use default, quick, real, gpu, gpu_batch, batch, "
                     f"batch_quick, drafters, trees, trees_quick, taskbench, taskbench_quick, "
                     f"taskbench_mixed, taskbench_mixed_quick, long_context or long_context_quick")
  return c


def taskbench_config(arg: str) -> ml_collections.ConfigDict:
  """The task suite (bench/sweep/taskbench_run.py; specjax/assets/taskbench): SmolLM2-135M-Instruct,
  every category through its chat template, real acceptance at T = 0 and 1. The report:
  WORKDIR/taskbench.md (a Spec-Bench-shaped leaderboard, the published MATs, the issue's goals),
  taskbench.png. `taskbench_trees` rows (DRAFTER@TREE) run through the trees sweep per category
  (docs/taskbench.md).
    python experiments/sweep_gamma.py --config=configs/sweep_gamma.py:taskbench --workdir=/tmp/specjax_tb
    python experiments/sweep_gamma.py --config=configs/sweep_gamma.py:taskbench_quick --workdir=/tmp/specjax_tbq
  """
  c = get_config("default")
  c.target, c.dtype = "smollm2-135m", "float32"
  c.draft = "smollm2-draft"     # the distilled draft (drafter "model"); loaded only if one runs
  c.taskbench = ("multi_turn", "code_completion", "code_editing", "summarization", "qa", "math")
  c.chat = True
  # Chains: n-gram lookup, the target's first 8 of 30 layers (the quick run's better layerskip),
  # the distilled draft and the EAGLE head trained here (specjax/assets/smollm2-*).
  c.drafters = ("ngram", "layerskip:8", "model", "eagle:smollm2-eagle")
  # Token trees, DRAFTER@TREE, each a leaderboard row of its own (bench/sweep/trees.py per
  # category): the EAGLE head drafting EAGLE-2's dynamic tree, sized for this CPU (top 4
  # per node, 4 levels, the 16 best nodes verified) and at EAGLE-2's published setting
  # (top 10, 6 levels, 60 nodes: the MAT to set beside the paper's), then that tree with the
  # prompt-lookup chain (8 deep) grafted on (drafters/dynamic.py graft_chain).
  c.taskbench_trees = ("eagle:smollm2-eagle@dynamic:4,4,16",
                       "eagle:smollm2-eagle@dynamic:10,6,60",
                       "eagle:smollm2-eagle@dynamic:10,6,60+ngram:8")
  c.gammas = (2, 4)
  c.accepts = ("real",)
  c.temps = (0.0, 1.0)
  c.n_predict = 64
  c.ctx_size = 320
  c.reps = 2
  c.measure_split = False
  if arg == "taskbench_quick":  # a few minutes on 2 cores
    c.taskbench_prompts = 2
    c.drafters = ("ngram", "eagle:smollm2-eagle")
    c.taskbench_trees = c.taskbench_trees[:1]  # the CPU-sized dynamic tree only
    c.gammas = (4,)
    c.temps = (0.0,)
    c.n_predict = 32
    c.ctx_size = 256
    c.reps = 1
  return c


def mixed_config(arg: str) -> ml_collections.ConfigDict:
  """Mixed batches (issue 40): the task suite's category "mixed", rows drawn from the six
  categories in turn (3 conversations each: 18 prompts, so batch 16 holds 16 distinct ones),
  so acceptance differs across a batch's rows; SmolLM2-135M-Instruct, T = 0, batches 4, 8, 16.
  Rows: the best fixed gamma (2, 4), --gamma=auto, per-row lengths (auto:rows,max=4 at the
  default budget and budget=auto), target-only; n-gram and the EAGLE head. The report:
  WORKDIR/taskbench.md's "Mixed batches" (rows_report.py), WORKDIR/mixed/summary.md.
    python experiments/sweep_gamma.py --config=configs/sweep_gamma.py:taskbench_mixed --workdir=/tmp/specjax_mixed
  `:taskbench_mixed_quick`: the tiny pair, batch 2, gamma 1, no auto gamma, prompt_tokens (each
  category those ids): a smoke test of the pipeline.
  """
  c = taskbench_config("taskbench")
  c.taskbench = ("mixed",)
  c.taskbench_trees = ()
  c.taskbench_prompts = 3
  c.drafters = ("ngram", "eagle:smollm2-eagle")
  c.batches = (4, 8, 16)
  c.gammas = (2, 4)
  c.auto_gamma = True
  c.row_budgets = ("default", "auto")
  c.temps = (0.0,)
  if arg == "taskbench_mixed_quick":  # tests / CI: tiny models, few compiled programs
    c.target, c.draft, c.chat = "tiny", "tiny-draft", False
    c.prompt_tokens = "1,5,9,200,3,7,7,7,7,7,7,7,7,7,7,7"  # repeats: n-gram matches
    c.drafters = ("ngram",)
    c.batches = (2,)
    c.gammas = (1,)
    c.auto_gamma = False  # --gamma=auto in a sweep: tests/bench/test_batch_sweep.py
    c.row_budgets = ("auto", "3")
    c.n_predict, c.ctx_size, c.reps = 12, 48, 1
  return c


def long_context_config(arg: str) -> ml_collections.ConfigDict:
  """Speedup against batch at context depths 1 K-8 K (bench/sweep/contexts.py): a gamma
  sweep per context of the long suite's prompts at that context (specjax/assets/taskbench_long,
  built from the stdlib by experiments/make_long_prompts.py), SmolLM2-135M-Instruct, T = 0,
  real acceptance. The report: WORKDIR/contexts.md, contexts.png; each context's sweep in
  WORKDIR/ctx-C/. Hours on 2 CPU cores: every (context, batch, gamma) compiles its loop.
    python experiments/sweep_gamma.py --config=configs/sweep_gamma.py:long_context --workdir=/tmp/specjax_long
  `:long_context_quick`: the tiny pair, contexts 64 and 128 (prompt_tokens tiled), seconds.
  """
  c = get_config("default")
  c.target, c.draft, c.dtype = "smollm2-135m", "smollm2-draft", "float32"
  c.taskbench_suite = "long"
  c.contexts = (1024, 2048, 4096, 8192)
  # The sparse-KV self-draft (4 sinks + the last 256 slots), prompt lookup, the distilled draft.
  c.drafters = ("streaming:256,4", "ngram", "model")
  c.batches = (1, 4, 8)
  c.gammas = (2, 4)
  c.accepts = ("real",)
  c.temps = (0.0,)
  c.taskbench_prompts = 6       # per context: 3 documents, a summary and a question each
  c.n_predict = 64              # <= longsuite.RESERVE - max(gammas) - 1
  c.reps = 2
  c.measure_split = False
  if arg == "long_context_quick":  # tests / CI: tiny models, short contexts, seconds
    c.target, c.draft = "tiny", "tiny-draft"
    c.taskbench_suite = "dev"
    c.prompt_tokens = ",".join(str(t) for t in range(7, 23))  # tiled to context - n_predict
    c.contexts = (64, 128)
    c.drafters = ("streaming:16,2",)  # a drafter per sweep compiles its loops: CI time
    c.batches = (1,)
    c.gammas = (2,)
    c.n_predict, c.reps = 16, 1
  return c
