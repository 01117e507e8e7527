"""The golden set: what the engine emits, recorded before a refactor.

Each case is one speculative run (a pair, a drafter, a draft shape, a
sampling setting, the chain / tree / dynamic / grafted / auto-gamma /
auto-tree loop) with fixed seeds, prompts and costs; its golden entry is
every row's tokens, the loop's steps, tokens/step and the per-step records'
sums. A refactor that claims "no behaviour change" reproduces every entry
exactly (tests/decode/test_golden.py runs the CI subset; this script runs
them all).

  python tests/golden/golden.py --check            # every case against golden.json
  python tests/golden/golden.py --check --pair=stdlib
  python tests/golden/golden.py --write            # record (only before a change)

The auto loops run on given costs (no timing), so their choices are
deterministic too.
"""

from __future__ import annotations

import os

# the test suite's XLA setting (tests/conftest.py), so the script and the test
# run the same programs
if "xla_backend_optimization_level" not in os.environ.get("XLA_FLAGS", ""):
  os.environ["XLA_FLAGS"] = " ".join(
      [os.environ.get("XLA_FLAGS", ""), "--xla_backend_optimization_level=0"]).strip()

import argparse
import dataclasses
import json
import sys
import time
from pathlib import Path

import jax
import numpy as np

from specjax.decode import adaptive
from specjax.decode import autogamma
from specjax.decode import autotree
from specjax.decode import plan
from specjax.decode import speculative
from specjax.formats import checkpoint
from specjax.model import steps
from specjax.model.sampling import SamplingParams

GOLDEN = Path(__file__).with_name("golden.json")

PAIRS = {
    "stdlib": dict(target="stdlib-target", draft="stdlib-draft", eagle="stdlib-eagle",
                   layers=2, texts=("def main(argv):\n    for name in ",
                                    "import os\nimport sys\n\nclass ")),
    "smollm2": dict(target="smollm2-135m", draft="smollm2-draft", eagle="smollm2-eagle",
                    layers=10, texts=("The capital of France is",
                                      "def fibonacci(n):\n    ")),
}
# a static tree given by rank paths (independent of the Sequoia DP)
STATIC = "[[0],[1],[0,0],[0,1],[1,0],[0,0,0],[0,0,1],[0,0,0,0]]"
SAMPLINGS = {"greedy": SamplingParams(), "t1": SamplingParams(temperature=1.0),
             "t07k": SamplingParams(temperature=0.7, top_k=20)}


@dataclasses.dataclass(frozen=True)
class Case:
  pair: str
  drafter: str      # 'model', 'ngram', 'layerskip:N', 'layerskip:LIST', 'eagle'
  shape: str        # 'chain:G', a static tree spec, 'dynamic:..', 'auto-gamma', 'auto-tree'
  sampling: str     # SAMPLINGS key
  siblings: str = "topk"
  n_predict: int = 16
  seed: int = 7

  @property
  def key(self) -> str:
    return "|".join([self.pair, self.drafter, self.shape, self.sampling, self.siblings,
                     str(self.n_predict), str(self.seed)])


def drafter_spec(pair: str, name: str) -> str:
  p = PAIRS[pair]
  if name == "eagle":
    return f"eagle:{p['eagle']}"
  if name == "layerskip-prefix":
    return f"layerskip:{p['layers']}"
  if name == "layerskip-list":
    return f"layerskip:0,{p['layers']}"
  return name


def cases(pair: str) -> list[Case]:
  out = []
  drafters = ("model", "ngram", "layerskip-prefix", "layerskip-list", "eagle")
  for d in drafters:
    for s in ("greedy", "t1"):
      out.append(Case(pair, d, "chain:3", s))
      out.append(Case(pair, d, STATIC, s))
      if d != "ngram":
        out.append(Case(pair, d, "dynamic:3,3,6", s))
    if d != "ngram":
      out.append(Case(pair, d, STATIC, "t1", siblings="stochastic"))
      out.append(Case(pair, d, "chain:2", "t07k"))
  out.append(Case(pair, "eagle", "dynamic:3,3,6+ngram:4", "greedy"))
  out.append(Case(pair, "eagle", "dynamic:3,3,6+ngram:4", "t1"))
  for d in ("model", "ngram", "layerskip-prefix", "layerskip-list"):
    out.append(Case(pair, d, "auto-gamma", "greedy"))
    out.append(Case(pair, d, "auto-gamma", "t1"))
  for d in ("model", "layerskip-list"):
    out.append(Case(pair, d, "auto-tree", "greedy"))
    out.append(Case(pair, d, "auto-tree", "t1"))
  return out


# The CI subset (tests/decode/test_golden.py): each drafter and each shape once.
CI_KEYS = (
    "stdlib|model|chain:3|t1", "stdlib|model|" + STATIC + "|t1|stochastic",
    "stdlib|ngram|" + STATIC + "|greedy", "stdlib|layerskip-prefix|chain:3|t1",
    "stdlib|layerskip-list|dynamic:3,3,6|t1", "stdlib|eagle|dynamic:3,3,6+ngram:4|t1",
    "stdlib|model|auto-gamma|t1", "stdlib|layerskip-list|auto-tree|t1",
)


def ci_cases() -> list[Case]:
  want = set(CI_KEYS)
  found = [c for c in cases("stdlib")
           if "|".join([c.pair, c.drafter, c.shape, c.sampling]
                       + ([c.siblings] if c.siblings != "topk" else [])) in want]
  assert len(found) == len(want), (len(found), len(want))
  return found


class Models:
  """Each pair's target, draft and tokenizer, loaded once (float32)."""

  def __init__(self):
    self._cache = {}

  def get(self, pair: str):
    if pair not in self._cache:
      p = PAIRS[pair]
      tcfg, tparams, tok = checkpoint.load_model(p["target"], dtype="float32")
      dcfg, dparams, _ = checkpoint.load_model(p["draft"], dtype="float32", role="draft")
      prompts = [tok.encode(t) for t in p["texts"]]
      self._cache[pair] = (steps.Runner(tcfg, tparams), steps.Runner(dcfg, dparams), prompts)
    return self._cache[pair]


# Costs for the auto loops: fixed numbers shaped like a CPU's (verify cost
# growing with n), so the choices are a function of the acceptance alone.
def _t_target(n: int) -> float:
  return 1.0 + 0.12 * (n - 1)


GAMMAS = (1, 2, 4)
AUTO_TREES = {"chain:1": "chain:1", "chain:2": "chain:2", "chain:4": "chain:4",
              "kary:2,2": "kary:2,2", "static8": STATIC}


def run(models: Models, case: Case) -> dict:
  """One case -> its golden entry."""
  target, draft, prompts = models.get(case.pair)
  sp = SAMPLINGS[case.sampling]
  drafter = drafter_spec(case.pair, case.drafter)
  if case.shape == "auto-gamma":
    p = plan.resolve(target.cfg, draft.cfg, drafter=drafter, gamma="auto", auto_set=GAMMAS,
                     sp=sp)
    cost = autogamma.BatchCosts(len(prompts), {n: _t_target(n) for n in range(1, 10)}, 0.08)
    res = adaptive.generate(target, draft, prompts, case.n_predict, p,
                            autogamma.GammaChooser(cost, p), seed=case.seed)
    extra = {"chosen": res.chosen}
  elif case.shape == "auto-tree":
    p = plan.resolve(target.cfg, draft.cfg, drafter=drafter, gamma=4, auto_trees=AUTO_TREES,
                     sp=sp)
    cost = autotree.TreeCosts(len(prompts), {n: _t_target(n) for n in range(1, 20)},
                              {w: 0.08 + 0.01 * (w - 1) for w in range(1, 9)})
    res = adaptive.generate(target, draft, prompts, case.n_predict, p,
                            autotree.TreeChooser(cost, p), seed=case.seed)
    extra = {"chosen": res.chosen}
  else:
    gamma = int(case.shape.split(":")[1]) if case.shape.startswith("chain:") else 4
    p = plan.resolve(target.cfg, draft.cfg, drafter=drafter, gamma=gamma, tree=case.shape,
                     siblings=case.siblings, sp=sp)
    res = speculative.run(target, draft, prompts, case.n_predict, p, seed=case.seed)
    extra = {}
  return entry(res, extra)


def entry(res, extra: dict) -> dict:
  rec = res.records  # live row-steps only
  return {"tokens": res.tokens,
          "loop_steps": int(rec.step.max()) + 1 if rec.step.size else 0,
          "row_steps": [int((rec.row == r).sum()) for r in range(len(res.tokens))],
          "tokens_per_step": round(float(res.stats.tokens_per_step), 9),
          "sums": {k: int(np.asarray(getattr(rec, k)).sum())
                   for k in ("n_acc", "n_drafted", "kept", "caught_up")},
          **extra}


def main() -> int:
  ap = argparse.ArgumentParser()
  mode = ap.add_mutually_exclusive_group(required=True)
  mode.add_argument("--write", action="store_true")
  mode.add_argument("--check", action="store_true")
  ap.add_argument("--pair", choices=sorted(PAIRS), action="append")
  ap.add_argument("--ci", action="store_true", help="only the CI subset")
  args = ap.parse_args()
  models = Models()
  golden = json.loads(GOLDEN.read_text()) if GOLDEN.exists() else {}
  todo = ci_cases() if args.ci else [c for p in (args.pair or sorted(PAIRS)) for c in cases(p)]
  bad = 0
  for i, case in enumerate(todo):
    t0 = time.perf_counter()
    got = run(models, case)
    dt = time.perf_counter() - t0
    if args.write:
      golden[case.key] = got
      GOLDEN.write_text(json.dumps(golden, indent=1, sort_keys=True) + "\n")
      status = "written"
    else:
      want = golden.get(case.key)
      status = "MISSING" if want is None else ("ok" if want == got else "DIFFERS")
      bad += status != "ok"
      if status == "DIFFERS":
        for k in want:
          if want[k] != got.get(k):
            print(f"    {k}: golden {want[k]} got {got.get(k)}")
    print(f"[{i + 1}/{len(todo)}] {status:8s} {dt:6.1f}s {case.key}", flush=True)
    jax.clear_caches()  # no case reuses another's programs: a long check keeps few mapped
  print(f"{len(todo) - bad} of {len(todo)} cases reproduce" if args.check else "done")
  return 1 if bad else 0


if __name__ == "__main__":
  sys.exit(main())
