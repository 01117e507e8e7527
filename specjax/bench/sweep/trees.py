"""The trees sweep's runner (`RUNNER`, issue 25): chains next to token trees
at several batch sizes, measured next to the tree theory's prediction.

Points are (drafter, batch, tree, rule, temperature); a tree is a model.tree
spec or `auto` (autotree choosing among the config's static trees, or among
--tree=auto's candidates: `auto_trees`). Per point: target-only and
speculative tokens/s (medians of alternating repetitions that compile
nothing), tokens per step, the acceptance by sibling rank; every static
point runs autotree's chunked device loop, as auto does. Costs, per
(drafter, batch, sampling settings), once: T_target(B, n), the draft level
per width, each tree's accept on the tree judge (engine.Loop.tree_costs).
Predicted: tree_theory's tokens per step at the rule's or the measured p by
rank, and autotree's speedup from the costs. A dynamic tree is a fixed
point through the engine's device loop; a drafter that cannot draft a kind
of point skips it with one line. docs/trees.md.
"""

from __future__ import annotations

import dataclasses
import functools
import statistics

import numpy as np

from specjax.bench.sweep import engine, points, tree_report
from specjax.bench.sweep.config import AUTO, SweepConfig
from specjax.bench.sweep.harness import Emit, Setup
from specjax.bench.sweep.points import TreePoint, batch_prompts
from specjax.errors import ConfigError, SpecjaxError
from specjax.metrics import schema, stats as stats_lib, tree_theory
from specjax.metrics.timing import CompileWatch
from specjax.workdir import Record


def fixed_trees(cfg: SweepConfig) -> dict:
  """The config's fixed trees by spec (AUTO left out), each parsed once:
  static trees and dynamic ones (dynamic:K,D,N)."""
  return {t: engine.fixed_tree(t, "config.trees:") for t in cfg.trees if t != AUTO}


def static_trees(cands: dict) -> dict:
  """The static trees among `cands` (what autotree measures and chooses from)."""
  return {k: t for k, t in cands.items() if not engine.is_dynamic(t)}


def auto_trees(cfg: SweepConfig) -> dict:
  """What an auto point chooses among: the config's static trees, or with
  config.auto_candidates --tree=auto's candidates (plan.candidate_trees of
  its sizes), a name a static tree of the config holds with another topology
  marked ' (auto)'."""
  fixed = static_trees(fixed_trees(cfg))
  if not cfg.auto_candidates:
    return fixed
  out = {}
  for k, t in engine.auto_candidates(cfg.auto_candidates).items():
    clash = k in fixed and fixed[k].paths() != t.paths()
    out[f"{k} (auto)" if clash else k] = t
  return out


def rule_p(rule: str, width: int = 1) -> list[float] | None:
  """The positional acceptance vector [width] a simulated rule implies on a
  tree (tree_acceptance.accept_table: siblings:P repeats its last value,
  bernoulli:P is P at every rank, always 1), None for the real rule and the
  others (fraction, mean_length: no law by rank)."""
  head, _, body = str(rule).partition(":")
  width = max(1, int(width))
  if head == "siblings":
    probs = [float(x) for x in body.split(",")]
    return [probs[min(r, len(probs) - 1)] for r in range(width)]
  if head == "bernoulli":
    return [float(body)] * width
  if head == "always":
    return [1.0] * width
  return None


@dataclasses.dataclass
class TreeBench:
  """What the points of one drafter share: the loop, its trees, its costs."""
  setup: Setup
  drafter: object  # drafters.base.Drafter
  cands: dict
  costs: dict = dataclasses.field(default_factory=dict)  # (batch, sp) -> engine.TreeCosts
  warm: set = dataclasses.field(default_factory=set)
  dynamic_costs: dict = dataclasses.field(default_factory=dict)  # (batch, sp, tree) -> dict

  @property
  def cfg(self) -> SweepConfig:
    return self.setup.cfg

  @property
  def static(self) -> dict:
    return static_trees(self.cands)

  @functools.cached_property
  def auto(self) -> dict:
    """The auto point's candidates (auto_trees)."""
    return auto_trees(self.cfg)

  @property
  def costed(self) -> dict:
    """The static trees whose costs the points read: the points' and, with an
    auto point, its candidates."""
    return self.static | (self.auto if AUTO in self.cfg.trees else {})

  def rows(self, p: TreePoint) -> list[list[list[int]]]:
    return batch_prompts(self.setup.prompts, p.batch)

  def cost(self, p: TreePoint) -> engine.TreeCosts:
    """The point's costs at its batch (measured on first use, greedy and
    sampled apart: the probes consume the logits as the run does)."""
    k = (p.batch, p.sp)
    if k not in self.costs:
      self.costs[k] = self.setup.loop.tree_costs(p.batch, self.setup.depth, self.costed, p.sp,
                                                 p.accept_rule, self.drafter, self.cfg.reps)
    return self.costs[k]

  def dynamic_cost(self, p: TreePoint) -> dict[str, float]:
    k = (p.batch, p.sp, p.tree)
    if k not in self.dynamic_costs:
      self.dynamic_costs[k] = self.setup.loop.dynamic_costs(
          self.cands[p.tree], p.batch, self.setup.depth, p.sp, p.accept_rule, self.drafter,
          self.cfg.reps)
    return self.dynamic_costs[k]

  def spec(self, p: TreePoint, cost) -> list:
    loop, cfg = self.setup.loop, self.cfg
    if engine.is_dynamic(self.cands.get(p.tree)):
      return [loop.dynamic(rows, self.cands[p.tree], p.sp, p.accept_rule, self.drafter,
                           cfg.siblings) for rows in self.rows(p)]
    cands = self.auto if p.auto else {p.tree: self.cands[p.tree]}
    every, fixed = (cfg.auto_every, None) if p.auto else (cfg.n_predict, [p.tree])
    return [loop.trees(rows, cost, cands, p.sp, p.accept_rule, self.drafter, cfg.siblings,
                       every, fixed) for rows in self.rows(p)]

  def base(self, p: TreePoint) -> list:
    return [self.setup.loop.target_only(rows, p.sp) for rows in self.rows(p)]

  def warm_base(self, p: TreePoint) -> None:
    """Compiles the target-only run of p's batch and sampling once per sweep."""
    if (p.batch, p.sp) not in self.warm:
      self.base(p)
      self.warm.add((p.batch, p.sp))


def timed_reps(bench: TreeBench, p: TreePoint, spec) -> tuple[list, list[dict]]:
  """reps repetitions of target-only and `spec()` alternating (nothing may
  compile): (the last speculative results, per repetition speedup and
  seconds per token)."""
  reps, res = [], None
  for rep in range(bench.cfg.reps):
    with CompileWatch() as cw:
      b = bench.base(p) if rep % 2 == 0 else None
      res = spec()
      b = b if b is not None else bench.base(p)
    if cw.count:
      raise SpecjaxError(f"{cw.count} compilation(s) inside timed repetition {rep} of {p.key} "
                         f"({dict(cw.names)}): shapes changed between runs")
    base_s = sum(r.eval_s for r in b) / sum(r.n_decoded for r in b)
    spec_s = sum(r.eval_s for r in res) / sum(r.stats.n_kept for r in res)
    reps.append({"speedup": base_s / spec_s, "base_s": base_s, "spec_s": spec_s})
  return res, reps


def common_fields(bench: TreeBench, p: TreePoint, reps: list[dict], compile_s: float) -> dict:
  """The record fields every point has: its settings and the measured speeds
  (medians over the repetitions)."""
  med = lambda k: statistics.median(r[k] for r in reps)
  return dict(
      tree=p.tree, batch=p.batch, accept_rule=p.accept_rule, temperature=p.sp.temperature,
      top_k=p.sp.top_k, top_p=p.sp.top_p, seed=bench.cfg.seed, loop="device",
      capacity=bench.setup.loop.capacity, n_prompts=len(bench.setup.prompts),
      reps=bench.cfg.reps, baseline_tps=1 / med("base_s"), spec_tps=1 / med("spec_s"),
      speedup=med("speedup"), baseline_tps_reps=[1 / r["base_s"] for r in reps],
      compile_s=compile_s)


def run_dynamic_point(bench: TreeBench, p: TreePoint) -> Record:
  """A dynamic tree's point: warm-up, the timed repetitions, its record
  (the measured tokens per step over the measured step's parts). A drafter
  that cannot draft it is refused first (ConfigError: the point is skipped)."""
  tree = bench.cands[p.tree]
  bench.drafter.check_tree(tree)
  cost = bench.dynamic_cost(p)
  with CompileWatch() as cw:
    bench.spec(p, None)
    bench.warm_base(p)
  res, reps = timed_reps(bench, p, lambda: bench.spec(p, None))
  pooled = stats_lib.Records.concat([r.records for r in res])
  st = stats_lib.SpecStats.compute(pooled, gamma=tree.max_depth,
                                   n_predict=sum(r.stats.n_predict for r in res))
  step_s = cost["t_draft_s"] + cost["t_verify_s"] + cost["t_accept_s"]
  pred = st.tokens_per_step * cost["t_target_s"] / step_s
  rec = common_fields(bench, p, reps, cw.seconds)
  rec.update(gamma=tree.max_depth, p_by_rank=None, tree_nodes=tree.n,
             predicted_measured_cost=pred, efficiency=rec["speedup"] / pred,
             predicted_step_s=step_s, **cost)
  return schema.run_record(st, **rec)


def run_point(bench: TreeBench, p: TreePoint) -> Record:
  """One point: warm-up (untimed; an auto point compiles every candidate and,
  with config.auto_calibrate, times each in the loop), then the timed
  repetitions. A dynamic tree: run_dynamic_point."""
  if engine.is_dynamic(bench.cands.get(p.tree)):
    return run_dynamic_point(bench, p)
  cost, loop = bench.cost(p), bench.setup.loop
  with CompileWatch() as cw:
    if p.auto:
      for rows in bench.rows(p):
        loop.warm_trees(rows, cost, bench.auto, p.sp, p.accept_rule, bench.drafter)
      if bench.cfg.auto_calibrate:
        cost = loop.calibrate_trees(bench.rows(p)[0], cost, bench.auto, p.sp,
                                    p.accept_rule, bench.drafter)
    bench.spec(p, cost)
    bench.warm_base(p)
  res, reps = timed_reps(bench, p, lambda: bench.spec(p, cost))
  return point_record(bench, p, cost, res, reps, cw.seconds)


def point_record(bench: TreeBench, p: TreePoint, cost: engine.TreeCosts, res: list,
                 reps: list[dict], compile_s: float) -> Record:
  """The point's record: measured, the p by rank, the predictions."""
  pooled = stats_lib.Records.concat([r.records for r in res])
  cands = bench.auto if p.auto else {p.tree: bench.cands[p.tree]}
  depth = max(t.max_depth for t in cands.values())
  st = stats_lib.SpecStats.compute(pooled, gamma=depth,
                                   n_predict=sum(r.stats.n_predict for r in res))
  acc, tried = engine.rank_counts(res)
  rec = common_fields(bench, p, reps, compile_s)
  rec.update(gamma=depth, p_by_rank=[float(a / t) if t else None for a, t in zip(acc, tried)],
             t_target_s=cost.t_target[1])
  if p.auto:
    used = engine.chosen(res)
    rec.update(auto_trees=list(bench.auto),
               trees_used={k: used.count(k) for k in bench.auto if k in used})
    return schema.run_record(st, **rec)
  tree = bench.cands[p.tree]
  prior = rule_p(p.accept_rule, tree.width)
  pv = prior if prior is not None else tree_theory.estimate_p(acc, tried, engine.PRIOR_P, 0.0)
  pv = np.nan_to_num(np.asarray(pv, float), nan=0.0)
  pred = engine.predicted_tree_speedup(cost, pv, p.tree, tree, bench.drafter)
  rec.update(tree_nodes=tree.n, tokens_per_step_predicted=tree_theory.tokens_per_step(
      tree.paths(), pv), predicted_measured_cost=pred, efficiency=rec["speedup"] / pred,
      predicted_step_s=cost.step_s(p.tree, tree, 0.0), t_verify_s=cost.t_target[tree.block_size],
      t_draft_s=cost.draft_s(tree.draft_widths()), t_accept_s=cost.t_accept.get(p.tree))
  return schema.run_record(st, **rec)


def skip_key(p) -> tuple:
  """What a ConfigError skips: this drafter's points of this tree, not its
  other trees of the same kind."""
  return (p.drafter, p.tree)


class TreesRunner:
  """The trees sweep's part of the harness (harness.Runner)."""
  csv_columns = ("tree", "tree_nodes", "tokens_per_step_predicted", *schema.CSV_COLUMNS)

  def check(self, cfg: SweepConfig) -> None:
    if not cfg.trees:
      raise ConfigError("config.trees is empty")
    fixed = fixed_trees(cfg)
    if AUTO in cfg.trees and not auto_trees(cfg):
      raise ConfigError("config.trees: auto chooses among the fixed trees (static ones); "
                        "give some, or config.auto_candidates=auto")
    for a in cfg.accepts:
      for t in fixed.values():
        engine.check_rule(a, t.max_depth)

  def points(self, cfg: SweepConfig, drafters: list[str]) -> list:
    return points.tree_points(cfg, drafters)

  def record_key(self, rec: Record) -> tuple:
    return points.tree_point_key(rec)

  def extra_slots(self, cfg: SweepConfig) -> int:
    # the slots a step writes past the cache's length, less one (SpecConfig.block - 1)
    cands = list(fixed_trees(cfg).values()) + list(auto_trees(cfg).values())
    return max(max(t.block_size, t.fed_slots) for t in cands) - 1

  def measure(self, setup: Setup, todo: list[TreePoint], emit: Emit) -> tuple[dict, list[str]]:
    """The points not done, in order; a drafter that cannot run a tree
    (ConfigError) skips every point of that tree with one line: the
    drafter's other trees of the same kind still run (EAGLE-3 drafts
    dynamic trees but cannot graft a lookup chain onto them)."""
    cands = fixed_trees(setup.cfg)
    benches = {d.spec: TreeBench(setup, d, cands) for d in setup.drafters}
    skipped: dict[tuple, str] = {}
    for p in todo:
      which = skip_key(p)
      if which in skipped:
        continue
      try:
        rec = run_point(benches[p.drafter], p)
      except ConfigError as e:  # a drafter that cannot draft this tree (yet): one line, go on
        skipped[which] = f"drafter {p.drafter}, {p.kind} tree {p.tree}: skipped ({e})"
        print(skipped[which], flush=True)
        continue
      emit(p, rec)
    costs = {d: {f"{b},{sp.temperature:g}": c.to_dict() for (b, sp), c in bench.costs.items()}
             for d, bench in benches.items()}
    dynamic = {d: {f"{b},{sp.temperature:g},{t}": c for (b, sp, t), c in
                   bench.dynamic_costs.items()} for d, bench in benches.items()
               if bench.dynamic_costs}
    return costs | ({"dynamic": dynamic} if dynamic else {}), list(skipped.values())

  def point_line(self, rec: Record) -> str:
    pred = rec.get("predicted_measured_cost")
    return (f"{rec['tokens_per_step']:.2f} tokens/step"
            + (f" (predicted {rec['tokens_per_step_predicted']:.2f})"
               if "tokens_per_step_predicted" in rec else "")
            + f", speedup {rec['speedup']:.3f}x" + (f" (predicted {pred:.3f}x)" if pred else ""))

  def report(self, workdir: str, records: list[Record], costs: dict, setup: Setup,
             notes: list[str]) -> str:
    del costs
    return tree_report.write_report(workdir, records, setup.env, notes)


RUNNER = TreesRunner()
