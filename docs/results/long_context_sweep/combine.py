"""The :long_context sweep's report from its contexts run apart, as
run_contexts writes them (contexts.md and contexts.png here). A point run
twice keeps the run listed first in RUNS: n-gram at 1 K, 4 K and 8 K from
ctx-ngram/ (its chain's conditional no longer copies the cache, 5fc9a19),
the four drafters at 4 K from ctx-4096-all/ (332ae5d), then the 1 K sweep
(42e9a24), the streaming draft's 4 K sweep (ec2f558) and its 8 K runs (the
first 4 K points are in ctx-4096-first/).
  PYTHONPATH=. python docs/results/long_context_sweep/combine.py
"""
import json
import os

from configs import sweep_gamma
from specjax.bench.sweep import contexts
from specjax.bench.sweep.config import SweepConfig
from specjax.bench.sweep.prompts import sweep_prompts
from specjax.formats import checkpoint

HERE = os.path.dirname(os.path.abspath(__file__))
# the settings the runs used (each context's config.json), not the config's defaults
with open(os.path.join(HERE, "ctx-1024", "config.json")) as f:
  ran = json.load(f)["config"]
cfg = SweepConfig.from_mapping(sweep_gamma.get_config("long_context")).replace(
    n_predict=ran["n_predict"], reps=ran["reps"])
tcfg, _, tok = checkpoint.load_model(cfg.target, dtype=cfg.dtype, role="target")
# (context, the run's directory, its config.taskbench_prompts: 0 for all)
RUNS = ((1024, "ctx-ngram/ctx-1024-g4", 0), (1024, "ctx-ngram/ctx-1024", 0),
        (4096, "ctx-ngram/ctx-4096", 0), (8192, "ctx-ngram/ctx-8192", 4),
        (4096, "ctx-4096-all", 0), (1024, "ctx-1024", 0), (4096, "ctx-4096", 0),
        (8192, "ctx-8192-b1-4", 4), (8192, "ctx-8192-b8", 4))
records = []
for c, run, n_prompts in RUNS:
  path = os.path.join(HERE, run, "results.jsonl")
  if os.path.exists(path):
    rows = [json.loads(x) for x in open(path)]
    at = contexts.context_config(cfg, c).replace(taskbench_prompts=n_prompts)
    lens = [len(p) for p in sweep_prompts(at, tok, tcfg.vocab_size)]
    seen = {(r["context"], r["drafter"], r["batch"], r["gamma"]) for r in records}
    records += [dict(r, context=c, prompt_lens=lens) for r in rows
                if (c, r["drafter"], r["batch"], r["gamma"]) not in seen]
cfg = cfg.replace(contexts=tuple(sorted({r["context"] for r in records})))
contexts.write_report(HERE, records, cfg)
print(open(os.path.join(HERE, contexts.REPORT)).read())
