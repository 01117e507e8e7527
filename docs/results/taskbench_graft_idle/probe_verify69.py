"""The 69-token verify and the head's proposal of `dynamic:10,6,60+ngram:8`, timed
alone in a fresh process (docs/taskbench.md, "The graft on an idle machine"): four
probe instances at the longest code-editing prompt's depth (82 tokens) in the sweep's
capacity (388 slots), 3 repetitions each. Run from the checkout with specjax installed:

  python docs/results/taskbench_graft_idle/probe_verify69.py
"""
from specjax.bench.sweep import engine
from specjax.decode import probes
from specjax.model import steps
from specjax.drafters import registry
from specjax.formats import checkpoint
from specjax.model import tree as tree_lib
tcfg, tparams, tok = checkpoint.load_model("smollm2-135m", dtype="float32")
target = steps.Runner(tcfg, tparams)
drafter = registry.parse("eagle:smollm2-eagle")
tr = tree_lib.parse("dynamic:10,6,60+ngram:8", 4)
for i in range(4):
  pt = probes.CostProbe(target, 388, 82, seed=i)
  t = {n: x.median for n, x in pt.times([1, tr.block_size], 3).items()}
  pd = engine.DynamicCostProbe(drafter, target, None, tr, 388, 82, seed=i)
  td = pd.time(3)
  print(f"instance {i}: T1 {1e3*t[1]:6.1f} Tverify(69) {1e3*t[69]:6.1f} Tdraft {1e3*td:6.1f} "
        f"step {1e3*(t[69]+td):6.1f} ms", flush=True)
