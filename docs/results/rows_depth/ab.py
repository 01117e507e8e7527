"""Per-row loop step with the EAGLE-3 head (smollm2-eagle3), SmolLM2 f32, mixed rows,
drafted to the longest length (01b476e) against gamma_max for every row (the same
drafter class with drafts_to_depth off: its own compiled program), beside target-only.
Interleaved repetitions after one untimed run each; medians of ms per loop step.
  python docs/results/rows_depth/ab.py BATCH BUDGETS      e.g. 4 4,6"""
import sys, time
import jax, numpy as np
from specjax.formats import checkpoint
from specjax.model import steps
from specjax.decode import plan, speculative, generation
from specjax.bench.sweep import taskbench, points
tcfg, tparams, tok = checkpoint.load_model("smollm2-135m", dtype="float32")
target = steps.Runner(tcfg, tparams)
B = int(sys.argv[1]); budgets = [int(x) for x in sys.argv[2].split(",")]
prompts = points.batch_prompts(taskbench.mixed_prompts(tok, tcfg.vocab_size, 1), B)[0]
n, cap = 48, 480
import dataclasses
from specjax.drafters import registry
D = registry.parse("eagle3:smollm2-eagle3")
FullDepth = type("FullDepth", (type(D),), {"drafts_to_depth": False})
DFULL = FullDepth(**{f.name: getattr(D, f.name) for f in dataclasses.fields(D)})
def spec(budget, first):
  pl = plan.parse_flags(drafter=D if first else DFULL, gamma=f"auto:rows,max=4,budget={budget}").resolve(tcfg, None, batch=B)
  def f():
    r = speculative.run(target, None, prompts, n, pl, capacity=cap)
    return r.eval_s / (int(r.records.step.max()) + 1), r
  return f
def base():
  r = generation.generate(target, prompts, n, capacity=cap); return r.eval_s / n, r
fns = {"target-only": base}
for b in budgets:
  fns[f"N={b} depth"] = spec(b, True)
  fns[f"N={b} full"] = spec(b, False)
for k, f in fns.items():
  f()  # compile
res = {k: [] for k in fns}; toks = {}
for _ in range(3):
  for k, f in fns.items():
    t, r = f(); res[k].append(1e3 * t); toks[k] = r.tokens
for k, v in res.items(): print(f"{k}: {np.median(v):.1f} ms/step {[round(x,1) for x in v]}")
for b in budgets: print(b, "same tokens:", toks[f"N={b} depth"] == toks[f"N={b} full"])
