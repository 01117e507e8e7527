"""--tree=auto: the token tree chosen at run time (adaptive.py's loop) from
measured costs and the acceptance by sibling rank seen so far.

The candidates are fixed for the run (plan.candidate_trees: chains and
Sequoia's best trees at a prior p). The cost model (`predicted_speedups`,
pure): at batch B, from `TreeCosts` (T_target(B, n), one draft level over w
tokens T_draft(B, w), each candidate's judge T_accept, or its calibrated
loop step t_step), tree_theory's tokens per step (steady state) or the tail
model at the current p. `TreeChooser` re-estimates p by rank from each
step's accepted leaf (tree_theory.rank_counts through `rank_tables`) and
picks the best candidate for what is left. Derivations: docs/trees.md.
"""

from __future__ import annotations

import dataclasses
from typing import Mapping, Sequence

import numpy as np

from specjax.decode import acceptance
from specjax.decode import adaptive
from specjax.decode import plan
from specjax.decode import probes
from specjax.decode.acceptance import AcceptRule
from specjax.drafters import base as drafters
from specjax.drafters import registry
from specjax.errors import ConfigError
from specjax.metrics import theory
from specjax.metrics import tree_theory
from specjax.model import steps
from specjax.model import tree as trees
from specjax.model.sampling import SamplingParams

EVERY = adaptive.EVERY
PRIOR_P = tree_theory.PRIOR_P
PRIOR_WEIGHT = tree_theory.PRIOR_WEIGHT


@dataclasses.dataclass(frozen=True)
class TreeCosts:
  """Measured seconds at one batch size B: what the tree chooser needs."""
  batch: int
  t_target: Mapping[int, float]   # n -> T_target(B, n); needs 1 and every candidate's N + 1
  t_draft: Mapping[int, float]    # w -> one draft level over w tokens per row; needs 1
  t_accept: Mapping[str, float] = dataclasses.field(default_factory=dict)  # candidate -> s
  t_step: Mapping[str, float] = dataclasses.field(default_factory=dict)    # candidate -> s

  def draft_s(self, widths: Sequence[int]) -> float:
    """Seconds of the draft levels of these widths (linear interpolation of
    the measured widths; past the widest, proportional to the width)."""
    ws = sorted(self.t_draft)
    total = 0.0
    for w in widths:
      if w > ws[-1]:
        total += self.t_draft[ws[-1]] * w / ws[-1]
      else:
        total += float(theory.verify_time_from_curve(dict(self.t_draft), max(w, ws[0])))
    return total

  def step_s(self, name: str, tree: trees.Tree, catchup: float) -> float:
    if name in self.t_step:
      return self.t_step[name]
    return (self.draft_s(tree.draft_widths()) + catchup * self.draft_s([1])
            + float(theory.verify_time_from_curve(dict(self.t_target), tree.block_size))
            + self.t_accept.get(name, 0.0))

  def to_dict(self):
    return {"batch": self.batch, "t_target_s": {str(k): v for k, v in self.t_target.items()},
            "t_draft_s": {str(k): v for k, v in self.t_draft.items()},
            "t_accept_s": dict(self.t_accept),
            **({"t_step_s": dict(self.t_step)} if self.t_step else {})}

  @classmethod
  def from_dict(cls, d) -> "TreeCosts":
    return cls(int(d["batch"]), {int(k): float(v) for k, v in d["t_target_s"].items()},
               {int(k): float(v) for k, v in d["t_draft_s"].items()},
               {str(k): float(v) for k, v in d.get("t_accept_s", {}).items()},
               {str(k): float(v) for k, v in d.get("t_step_s", {}).items()})


def predicted_speedups(c: TreeCosts, p: Sequence[float], cands: Mapping[str, trees.Tree],
                       n_tokens: int | None = None, rows: int | None = None,
                       drafter: drafters.Drafter | str = "model") -> dict[str, float]:
  """Predicted speedup of each candidate at c.batch (module docstring):
  steady state, or, given n_tokens, what is left of a run of n_tokens per
  row over `rows` live rows (default c.batch) with the tail model."""
  rows = c.batch if rows is None else max(1, int(rows))
  charge = registry.parse(drafter).catches_up
  t1 = float(theory.verify_time_from_curve(dict(c.t_target), 1))
  out = {}
  for name, tree in cands.items():
    paths = tree.paths()
    pmf = tree_theory.accept_pmf(paths, p)
    catchup = float(1.0 - (1.0 - pmf[-1]) ** rows) if charge else 0.0
    step = c.step_s(name, tree, catchup)
    if n_tokens is None:
      out[name] = tree_theory.tokens_per_step(paths, p) * t1 / step
    else:
      out[name] = theory.batch_speedup_at_step(pmf, n_tokens, rows, t1, step)
  return out


def choose(c: TreeCosts, p: Sequence[float], cands: Mapping[str, trees.Tree],
           n_tokens: int | None = None, rows: int | None = None,
           drafter: drafters.Drafter | str = "model") -> str:
  """The candidate with the largest predicted speedup (on a tie the one with
  fewer nodes, then the first given)."""
  pred = predicted_speedups(c, p, cands, n_tokens, rows, drafter)
  order = {k: i for i, k in enumerate(cands)}
  return max(pred, key=lambda k: (pred[k], -cands[k].n, -order[k]))


def rank_tables(tree: trees.Tree, width: int) -> tuple[np.ndarray, np.ndarray]:
  """(accepted, tried) [1 + N, width] by the step's leaf (block index of the
  last accepted node, 0: none): tree_theory.rank_counts of its rank path."""
  paths = tree.paths()
  acc, tried = np.zeros((tree.block_size, width), np.int64), np.zeros((tree.block_size, width),
                                                                      np.int64)
  for leaf in range(tree.block_size):
    a, t = tree_theory.rank_counts(paths, paths[leaf - 1] if leaf else ())
    acc[leaf, :a.size], tried[leaf, :t.size] = a, t
  return acc, tried


def measure_costs(target: steps.Runner, draft: steps.Runner | None, batch: int, capacity: int,
                  depth: int, cands: Mapping[str, trees.Tree],
                  sp: SamplingParams = SamplingParams(), rule: AcceptRule | str = "real",
                  reps: int = 3, drafter: drafters.Drafter | str = "model") -> TreeCosts:
  """T_target(B, 1 and every N + 1), T_draft(B, w) at every level width of
  the candidates, and T_accept per candidate (a chain's accept phase, a
  tree's on the tree judge: probes.tree_accept_cost), measured now (the
  probes compile, untimed)."""
  rule = acceptance.parse_rule(rule) if isinstance(rule, str) else rule
  drafter = registry.parse(drafter)
  deepest = max(t.max_depth for t in cands.values())
  pt = probes.CostProbe(target, capacity, depth, batch=batch)
  pd = probes.draft_probe(drafter, target, draft, deepest, capacity, depth, batch=batch)
  ns = sorted({1} | {t.block_size for t in cands.values()})
  widths = sorted({1} | {w for t in cands.values() for w in t.draft_widths()})
  t_target = {n: t.median for n, t in pt.times(ns, reps, sp=sp).items()}
  if isinstance(pd, probes.CostProbe):
    t_draft = {w: t.median for w, t in pd.times(widths, reps, sp=sp).items()}
  else:  # a model-free drafter: its proposal per token, times the width
    one = pd.times([1], reps, sp=sp)[1].median
    t_draft = {w: one * w for w in widths}
  sc = plan.SpecConfig(target.cfg, draft and draft.cfg, 1, drafter=drafter)
  sc = dataclasses.replace(sc, sp=sp, simulated=rule.simulated)
  t_accept = {name: (probes.accept_cost(dataclasses.replace(sc, gamma=t.n), reps, batch=batch)
                     if t.is_chain else probes.tree_accept_cost(sc, t, reps, batch=batch)).median
              for name, t in cands.items()}
  return TreeCosts(batch, t_target, t_draft, t_accept)


def trees_of(p: plan.Plan) -> dict[str, trees.Tree]:
  """A tree plan's candidates as trees (a chain candidate: its chain)."""
  return {k: sc.tree if sc.tree is not None else trees.chain(sc.gamma)
          for k, sc in p.configs.items()}


@dataclasses.dataclass
class TreeChooser:
  """adaptive.Chooser for --tree=auto: p by sibling rank from the accepted
  leaves so far, then the candidate with the best predicted speedup for
  what is left. rank_accepted / rank_tried: the run's counts by rank."""
  cost: TreeCosts
  plan: plan.Plan
  prior_p: Sequence[float] = PRIOR_P
  prior_weight: float = PRIOR_WEIGHT
  estimates: list = dataclasses.field(default_factory=list)  # p by rank at each choice

  def __post_init__(self):
    self.cands = trees_of(self.plan)
    _check(self.cost, self.cands)
    width = max(t.width for t in self.cands.values())
    self.tables = {k: rank_tables(t, width) for k, t in self.cands.items()}
    self.rank_accepted = np.zeros(width, np.int64)
    self.rank_tried = np.zeros(width, np.int64)

  def start(self, rows):
    check_batch(self.cost, rows)

  def observe(self, name, records):
    leaves = records["leaf"]
    self.rank_accepted += self.tables[name][0][leaves].sum(0)
    self.rank_tried += self.tables[name][1][leaves].sum(0)

  def choose(self, remaining, live):
    p = tree_theory.estimate_p(self.rank_accepted, self.rank_tried, self.prior_p,
                               self.prior_weight)
    self.estimates.append(p.tolist())
    return choose(self.cost, p, self.cands, n_tokens=remaining, rows=live,
                  drafter=self.plan.drafter)


def _check(c: TreeCosts, cands: Mapping[str, trees.Tree]) -> None:
  missing = sorted({t.block_size for t in cands.values()} - set(c.t_target)) + (
      [] if 1 in c.t_target else [1])
  if missing or 1 not in c.t_draft:
    raise ConfigError(f"the auto tree costs lack T_target(n) for n = {missing}"
                      + ("" if 1 in c.t_draft else " and T_draft(1)"))


def check_batch(c: TreeCosts, batch: int) -> None:
  if c.batch != batch:
    raise ConfigError(f"the auto tree costs were measured at batch {c.batch}, the run has "
                      f"{batch} rows")


def calibrate(target, draft, prompts, n_predict: int, cost: TreeCosts, p: plan.Plan,
              **kw) -> TreeCosts:
  """`cost` with t_step: each candidate's seconds per step in the loop
  itself (adaptive.step_times). Call after adaptive.warm_up."""
  return dataclasses.replace(cost, t_step=adaptive.step_times(target, draft, prompts,
                                                              n_predict, p, **kw))
