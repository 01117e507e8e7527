"""The :long_context sweep's report from its contexts run apart (the 1 K
sweep at 42e9a24, whose process was then killed at 4 K; the 4 K sweep of
the streaming draft rerun alone at ec2f558, ctx-4096/; the four drafters
at 4 K, batches 1 and 4, at 332ae5d, ctx-4096-all/, which take the place of
ctx-4096/'s same points; the first 4 K points are in ctx-4096-first/):
contexts.md and contexts.png here, as run_contexts writes them.
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
records = []
# 4 K: the four drafters' run (ctx-4096-all) first, then the streaming run's other points
for c, run in ((1024, "ctx-1024"), (4096, "ctx-4096-all"), (4096, "ctx-4096")):
  path = os.path.join(HERE, run, "results.jsonl")
  if os.path.exists(path):
    rows = [json.loads(x) for x in open(path)]
    lens = [len(p) for p in sweep_prompts(contexts.context_config(cfg, c), tok, tcfg.vocab_size)]
    seen = {(r["context"], r["drafter"], r["batch"], r["gamma"]) for r in records}
    records += [dict(r, context=c, prompt_lens=lens) for r in rows
                if (c, r["drafter"], r["batch"], r["gamma"]) not in seen]
cfg = cfg.replace(contexts=tuple(sorted({r["context"] for r in records})))
contexts.write_report(HERE, records, cfg)
print(open(os.path.join(HERE, contexts.REPORT)).read())
