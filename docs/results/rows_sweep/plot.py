"""Speedup against batch on the mixed category, one plot per drafter, from the
mixed-batch sweeps' records kept here (mixed/: n-gram at batches 4 and 8,
9a6661b; b16/: n-gram at 16; eagle/, eagle16/: the EAGLE-3 head), drawn by the
sweep's own batch_report.plot_speedup_vs_batch (fixed gammas with the tail
model's prediction, auto, the per-row points).
  python docs/results/rows_sweep/plot.py"""
import os, sys
here = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(here, "..", "..", ".."))
from specjax import workdir as wd
from specjax.bench.sweep import batch_report

records = []
for sub in ("mixed", "b16", "eagle", "eagle16"):
  path = os.path.join(here, sub, "results.jsonl")
  if os.path.exists(path):
    records += wd.read_jsonl(path)
for name, prefix in (("ngram", "ngram"), ("eagle3", "eagle3")):
  rs = [r for r in records if r["drafter"].startswith(prefix)]
  if rs:
    batch_report.plot_speedup_vs_batch(os.path.join(here, f"speedup_vs_batch_{name}.png"), rs)
    print(name, sorted({r["batch"] for r in rs}), len(rs), "points")
