"""Speedup against batch on the mixed category, one plot per drafter, from the
mixed-batch sweeps' records kept here (n-gram: chain_no_copies/, batches 4, 8
and 16 in one quiet run at 640e775, after its chain stopped copying the cache;
the EAGLE-3 head: eagle/, eagle16/), drawn by the
sweep's own batch_report.plot_speedup_vs_batch (fixed gammas with the tail
model's prediction, auto, the per-row points).
  python docs/results/rows_sweep/plot.py"""
import os, sys
here = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(here, "..", "..", ".."))
from specjax import workdir as wd
from specjax.bench.sweep import batch_report

SOURCES = {"ngram": ("chain_no_copies",), "eagle3": ("eagle", "eagle16")}
for name, subs in SOURCES.items():
  records = []
  for sub in subs:
    path = os.path.join(here, sub, "results.jsonl")
    if os.path.exists(path):
      records += wd.read_jsonl(path)
  rs = [r for r in records if r["drafter"].startswith(name)]
  if rs:
    batch_report.plot_speedup_vs_batch(os.path.join(here, f"speedup_vs_batch_{name}.png"), rs)
    print(name, sorted({r["batch"] for r in rs}), len(rs), "points")
