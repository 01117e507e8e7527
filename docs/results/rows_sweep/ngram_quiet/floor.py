"""Per step: target-only decode vs the per-row loop at N = B (budget=B: the rows' tails alone),
SmolLM2 float32, n-gram, the task suite's mixed rows; interleaved repetitions after one untimed run.
  python docs/results/rows_sweep/ngram_quiet/floor.py BATCH"""
import time, sys
import jax, numpy as np
from specjax.formats import checkpoint
from specjax.model import steps
from specjax.decode import plan, speculative, generation
from specjax.bench.sweep import taskbench, points
tcfg, tparams, tok = checkpoint.load_model("smollm2-135m", dtype="float32")
target = steps.Runner(tcfg, tparams)
B = int(sys.argv[1]) if len(sys.argv) > 1 else 4
prompts = points.batch_prompts(taskbench.mixed_prompts(tok, tcfg.vocab_size, 1), B)[0]
n, cap = 48, 400
def t_only(): 
  r = generation.generate(target, prompts, n, capacity=cap); return r.eval_s / n
def spec(g):
  pl = plan.parse_flags(drafter="ngram", gamma=g).resolve(tcfg, None, batch=B)
  def f():
    r = speculative.run(target, None, prompts, n, pl, capacity=cap)
    return r.eval_s / (int(r.records.step.max()) + 1)
  return f
fns = {"target-only": t_only, f"rows N=B": spec(f"auto:rows,max=4,budget={B}")}
for f in fns.values(): f()
res = {k: [] for k in fns}
for _ in range(4):
  for k, f in fns.items(): res[k].append(1e3 * f())
for k, v in res.items(): print(k, round(float(np.median(v)), 1), [round(x, 1) for x in v])
