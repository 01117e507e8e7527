"""The sweep's `trees` dimension (issue 25): chains next to token trees, at
several batch sizes, measured next to the tree theory's prediction.

A config with `trees` (configs/sweep_gamma.py:trees, :trees_quick) runs
here instead of the gamma sweep (sweep.run_sweep delegates). Points are
(drafter, batch, tree, acceptance rule, temperature); a tree is a
model.tree spec (chain:G, kary:K,D, sequoia:N,D, a JSON list) or `auto`
(decode/autotree.py choosing among the config's fixed trees). For each
point, in one run on one machine:
  measured   target-only and speculative tokens/s (medians over
             repetitions, the two alternating; nothing may compile in a
             timed repetition), tokens per step, and the positional
             acceptance by sibling rank (accepts / tries per rank, from the
             records' leaf: autotree.rank_tables). Every speculative point
             runs autotree.generate's chunked device loop (a fixed tree: one
             candidate, chunks of 1, 2, 4, .. steps), so chains, trees and
             auto pay the same loop;
  costs      per (drafter, batch, temperature), once: T_target(B, n) at n = 1
             and every 1 + N, the draft level T_draft(B, w) at every level
             width, the accept cost per tree (autotree.measure_costs);
  predicted  tokens per step, tree_theory.tokens_per_step at the rule's p
             (siblings:P / bernoulli:P / always) or, for the real rule, at
             the measured p by rank; speedup, autotree.predicted_speedups
             at that p from the costs (steady state).
An interrupted sweep loses no finished point: each record is appended to
results.jsonl as it finishes and `resume` skips it. A drafter that cannot
draft trees yet gets one line (printed and in summary.md), not a traceback.
tree_report.py writes summary.md and trees.png.

A dynamic tree (dynamic:K,D,N, EAGLE-2's per-row tree: no fixed topology)
runs as a fixed point of its own through speculative.generate's device loop
(not autotree's chunked one; auto never chooses it). Its record: measured as
above (alpha: the i.i.d. rate whose capped geometric over D drafts gives the
measured mean accepted length, as for every tree here), no p by rank and no
predicted tokens per step (no topology to predict them on); its measured-cost
prediction is the measured tokens per step x T_target(B, 1) / the predicted
step, step = T_draft_tree (the whole dynamic proposal: `DynamicCostProbe`) +
T_target(B, 1 + N) + T_accept (a chain's accept over N drafts, as for static
trees).
"""

from __future__ import annotations

import dataclasses
import functools
import os
import statistics
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from specjax import workdir as wd
from specjax.bench.sweep_points import (batch_prompts, check_same_sweep, drafter_specs,
                                         sweep_prompts)
from specjax.decode import acceptance
from specjax.decode import autotree
from specjax.decode import generation
from specjax.decode import probes
from specjax.decode import speculative
from specjax.drafters import registry
from specjax.errors import ConfigError, SpecjaxError
from specjax.formats import checkpoint
from specjax.metrics import schema
from specjax.metrics import stats as stats_lib
from specjax.metrics import tree_theory
from specjax.metrics import timing
from specjax.metrics.timing import CompileWatch
from specjax.model import steps
from specjax.model import tree as trees
from specjax.model.sampling import SamplingParams
from specjax.workdir import Record

AUTO = "auto"
SKIPPED = "skipped.jsonl"  # points a drafter could not run (one line each)


@dataclasses.dataclass(frozen=True)
class TreePoint:
  tree: str          # a model.tree spec, or AUTO
  accept_rule: str
  sp: SamplingParams
  batch: int = 1
  drafter: str = "model"

  @property
  def key(self) -> tuple:
    return (self.drafter, self.batch, self.tree, self.accept_rule, self.sp.temperature)


def record_key(rec: Record) -> tuple:
  return (str(rec.get("drafter") or "model"), int(rec.get("batch", 1)), str(rec["tree"]),
          str(rec["accept_rule"]), float(rec["temperature"]))


def is_dynamic(tree) -> bool:
  return isinstance(tree, trees.DynamicTree)


def fixed_trees(cfg) -> dict[str, trees.Tree | trees.DynamicTree]:
  """The config's fixed trees by spec (AUTO left out), each parsed once:
  static trees and dynamic ones (dynamic:K,D,N)."""
  out = {}
  for spec in cfg.trees:
    if str(spec) != AUTO:
      t = trees.parse(str(spec), 1)
      if not isinstance(t, (trees.Tree, trees.DynamicTree)):
        raise ConfigError(f"config.trees: {spec} is not a fixed tree (use chain:G, kary:K,D, "
                          "sequoia:N,D, a JSON list, dynamic:K,D,N, or auto)")
      out[str(spec)] = t
  return out


def static_trees(cands: dict) -> dict[str, trees.Tree]:
  """The static trees among `cands` (what autotree measures and chooses from)."""
  return {k: t for k, t in cands.items() if not is_dynamic(t)}


def validate(cfg) -> None:
  """Bad tree-sweep settings -> one ConfigError naming the field."""
  if not list(cfg.trees):
    raise ConfigError("config.trees is empty")
  fixed = fixed_trees(cfg)
  if AUTO in cfg.trees and not static_trees(fixed):
    raise ConfigError("config.trees: auto chooses among the fixed trees (static ones); "
                      "give some")
  batches = list(cfg.get("batches", (1,)))
  if not batches or any(int(b) < 1 for b in batches):
    raise ConfigError(f"config.batches must be integers >= 1, got {batches}")
  for spec in drafter_specs(cfg):
    registry.parse(spec)
  for a in cfg.accepts:
    rule = acceptance.parse_rule(a)
    for t in fixed.values():
      rule.resolve(t.max_depth)
  if not list(cfg.temps):
    raise ConfigError("config.temps is empty")
  for t in cfg.temps:
    SamplingParams(float(t), int(cfg.top_k), float(cfg.top_p))
  for name in ("n_predict", "reps"):
    if int(getattr(cfg, name)) < 1:
      raise ConfigError(f"config.{name} must be >= 1, got {getattr(cfg, name)}")


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
  """What the points of one drafter share: models, prompts, capacity, costs."""
  target: steps.Runner
  draft: steps.Runner | None
  drafter: Any
  prompts: list[list[int]]
  capacity: int
  cands: dict[str, trees.Tree]
  cfg: Any
  costs: dict = dataclasses.field(default_factory=dict)  # (batch, sp) -> TreeCosts
  warm: set = dataclasses.field(default_factory=set)
  dynamic_costs: dict = dataclasses.field(default_factory=dict)  # (batch, sp, tree) -> dict

  @property
  def static(self) -> dict[str, trees.Tree]:
    return static_trees(self.cands)

  def cost(self, p: TreePoint) -> autotree.TreeCosts:
    """The point's costs at its batch (measured on first use, greedy and
    sampled apart: the probes consume the logits as the run does)."""
    k = (p.batch, p.sp)
    if k not in self.costs:
      depth = max(len(x) for x in self.prompts)
      self.costs[k] = autotree.measure_costs(
          self.target, self.draft, p.batch, self.capacity, depth, self.static, p.sp,
          p.accept_rule, int(self.cfg.reps), drafter=self.drafter)
    return self.costs[k]

  def dynamic_cost(self, p: TreePoint) -> dict[str, float]:
    """A dynamic tree's costs at its batch (module docstring), measured on
    first use: T_target(B, 1), T_target(B, 1 + N), the whole dynamic
    proposal and the accept phase over N drafts."""
    k = (p.batch, p.sp, p.tree)
    if k not in self.dynamic_costs:
      tree, reps = self.cands[p.tree], int(self.cfg.reps)
      depth = max(len(x) for x in self.prompts)
      pt = probes.CostProbe(self.target, self.capacity, depth, batch=p.batch)
      t_t = {n: t.median for n, t in pt.times([1, tree.block_size], reps, sp=p.sp).items()}
      pd = DynamicCostProbe(self.drafter, self.target, self.draft, tree, self.capacity, depth,
                            batch=p.batch)
      sc = speculative.SpecConfig(self.target.cfg, self.draft and self.draft.cfg, tree.n, p.sp,
                                  acceptance.parse_rule(p.accept_rule).simulated,
                                  drafter=self.drafter)
      self.dynamic_costs[k] = {
          "t_target_s": t_t[1], "t_verify_s": t_t[tree.block_size],
          "t_draft_s": pd.time(reps),
          "t_accept_s": probes.accept_cost(sc, reps, batch=p.batch).median}
    return self.dynamic_costs[k]

  def spec(self, p: TreePoint, cost: autotree.TreeCosts | None) -> list:
    c = self.cfg
    if is_dynamic(self.cands.get(p.tree)):
      tree = self.cands[p.tree]
      return [speculative.generate(self.target, self.draft, rows, int(c.n_predict),
                                   tree.max_depth, sp=p.sp, rule=p.accept_rule,
                                   seed=int(c.seed), capacity=self.capacity,
                                   drafter=self.drafter, tree=tree,
                                   siblings=str(c.get("siblings", "topk")))
              for rows in batch_prompts(self.prompts, p.batch)]
    auto = p.tree == AUTO
    cands = self.static if auto else {p.tree: self.cands[p.tree]}
    kw = dict(sp=p.sp, rule=p.accept_rule, seed=int(c.seed), capacity=self.capacity,
              drafter=self.drafter, siblings=str(c.get("siblings", "topk")))
    return [autotree.generate(self.target, self.draft, rows, int(c.n_predict), cost, cands,
                              every=int(c.get("auto_every", autotree.EVERY)) if auto
                              else int(c.n_predict), fixed=None if auto else [p.tree], **kw)
            for rows in batch_prompts(self.prompts, p.batch)]

  def base(self, p: TreePoint) -> list[generation.GenerationResult]:
    return [generation.generate(self.target, rows, int(self.cfg.n_predict), p.sp,
                                seed=int(self.cfg.seed), capacity=self.capacity)
            for rows in batch_prompts(self.prompts, p.batch)]


@functools.partial(jax.jit, static_argnames=("sc", "k"))
def _repeat_propose_tree(dparams, dstate, tcache, tail, n, key, *, sc, k: int):
  """k dynamic-tree proposals on device; each iteration's lengths differ
  (n - i % 2), so XLA cannot hoist the proposal out of the loop. `tcache`
  is the target's prefilled cache: a drafter that shares it (layerskip:K)
  reads and writes it, as in the engine's step."""
  live = jnp.ones(n.shape, bool)

  def body(i, acc):
    d, _, _ = sc.drafter.propose_tree(dparams, dstate, tcache, tail, n - i % 2, live,
                                      jax.random.fold_in(key, i), sc)
    return acc + jnp.sum(d.tokens)

  return jax.lax.fori_loop(0, k, body, jnp.int32(0))


class DynamicCostProbe:
  """T_draft_tree: one whole dynamic-tree proposal (every level the drafter
  feeds, the selection, the mask) at batch B, on a history of `depth` random
  tokens; k proposals per timed repetition in one jitted loop. The target's
  cache is prefilled with that history as the engine's prefill does
  (speculative.prefill): layerskip:K drafts on the target's own cache."""

  def __init__(self, drafter, target: steps.Runner, draft: steps.Runner | None,
               tree: trees.DynamicTree, capacity: int, depth: int, batch: int = 1,
               seed: int = 0, k: int = probes.PROBE_REPEATS):
    self.sc = speculative.SpecConfig(target.cfg, draft and draft.cfg, tree.max_depth,
                                     drafter=drafter, simulated=True, tree=tree)
    self.k = k
    rng = np.random.RandomState(seed)
    prompt = rng.randint(0, target.cfg.vocab_size, depth - 1).tolist()
    self.dparams = self.sc.drafter.draft_params(target.params, draft)
    prompts = [prompt] * batch
    _, self.tcache = target.prefill(prompts, target.new_cache(batch, capacity))
    first = jnp.asarray([prompt[-1]] * batch)
    self.dstate = self.sc.drafter.init(self.sc, target, self.dparams, prompts, capacity,
                                       first)
    self.tail = jnp.asarray([[prompt[-1], prompt[-1]]] * batch, jnp.int32)
    self.n = jnp.full((batch,), depth, jnp.int32)

  def time(self, reps: int) -> float:
    """Median seconds of one proposal (compiles untimed first)."""
    run = lambda: _repeat_propose_tree(self.dparams, self.dstate, self.tcache, self.tail,
                                       self.n, jax.random.PRNGKey(0), sc=self.sc, k=self.k)
    return timing.measure(run, reps=reps, warmup=1).median / self.k


def _timed_reps(bench: TreeBench, p: TreePoint, spec) -> tuple[list, list[dict]]:
  """reps repetitions of target-only and `spec()` alternating (nothing may
  compile): (the last speculative results, per repetition speedup and
  seconds per token)."""
  reps = []
  res = None
  for rep in range(int(bench.cfg.reps)):
    with CompileWatch() as cw:
      b = bench.base(p) if rep % 2 == 0 else None
      res = spec()
      b = b if b is not None else bench.base(p)
    if cw.count:
      raise SpecjaxError(f"{cw.count} compilation(s) inside timed repetition {rep} of {p.key} "
                         f"({dict(cw.names)}): shapes changed between runs")
    base_s = sum(r.eval_s for r in b) / sum(r.n_eval * len(r.tokens) for r in b)
    spec_s = sum(r.eval_s for r in res) / sum(r.stats.n_kept for r in res)
    reps.append({"speedup": base_s / spec_s, "base_s": base_s, "spec_s": spec_s})
  return res, reps


def _warm_base(bench: TreeBench, p: TreePoint) -> None:
  """Compiles the target-only run of p's batch and sampling once per sweep."""
  if (p.batch, p.sp) not in bench.warm:
    bench.base(p)
    bench.warm.add((p.batch, p.sp))


def _common_fields(bench: TreeBench, p: TreePoint, reps: list[dict],
                   compile_s: float) -> dict:
  """The record fields every point has: its settings and the measured speeds
  (medians over the repetitions)."""
  med = lambda k: statistics.median(r[k] for r in reps)
  return dict(
      tree=p.tree, batch=p.batch, accept_rule=p.accept_rule, temperature=p.sp.temperature,
      top_k=p.sp.top_k, top_p=p.sp.top_p, seed=int(bench.cfg.seed), loop="device",
      capacity=bench.capacity, n_prompts=len(bench.prompts), reps=int(bench.cfg.reps),
      baseline_tps=1 / med("base_s"), spec_tps=1 / med("spec_s"), speedup=med("speedup"),
      compile_s=compile_s)


def run_dynamic_point(bench: TreeBench, p: TreePoint) -> Record:
  """A dynamic tree's point (module docstring): warm-up, then the timed
  repetitions, then its record. A drafter that cannot draft it (ngram: no
  draft distribution to rank one with) is refused first, before any cost is
  measured (ConfigError: run_tree_sweep skips the points with one line)."""
  bench.drafter.check_tree(bench.cands[p.tree])
  cost = bench.dynamic_cost(p)
  with CompileWatch() as cw:
    bench.spec(p, None)
    _warm_base(bench, p)
  compile_s = cw.seconds
  res, reps = _timed_reps(bench, p, lambda: bench.spec(p, None))
  return dynamic_record(bench, p, cost, res, reps, compile_s)


def dynamic_record(bench: TreeBench, p: TreePoint, cost: dict[str, float], res: list,
                   reps: list[dict], compile_s: float) -> Record:
  """The dynamic point's record: measured, and the measured-cost prediction
  at the measured tokens per step (module docstring)."""
  tree = bench.cands[p.tree]
  pooled = stats_lib.Records.concat([r.records for r in res])
  st = stats_lib.SpecStats.compute(pooled, gamma=tree.max_depth,
                                   n_predict=sum(r.stats.n_predict for r in res))
  step_s = cost["t_draft_s"] + cost["t_verify_s"] + cost["t_accept_s"]
  pred = st.tokens_per_step * cost["t_target_s"] / step_s
  rec = _common_fields(bench, p, reps, compile_s)
  rec.update(gamma=tree.max_depth, p_by_rank=None, tree_nodes=tree.n,
             predicted_measured_cost=pred, efficiency=rec["speedup"] / pred,
             predicted_step_s=step_s, **cost)
  return schema.run_record(st, **rec)


def run_point(bench: TreeBench, p: TreePoint) -> Record:
  """One point: warm-up (untimed; an auto point compiles every candidate and,
  with config.auto_calibrate, times each in the loop), then reps
  repetitions of target-only and speculative runs alternating. A dynamic
  tree: run_dynamic_point."""
  if is_dynamic(bench.cands.get(p.tree)):
    return run_dynamic_point(bench, p)
  cost = bench.cost(p)
  with CompileWatch() as cw:
    if p.tree == AUTO:
      for rows in batch_prompts(bench.prompts, p.batch):
        kw = dict(sp=p.sp, rule=p.accept_rule, seed=int(bench.cfg.seed),
                  capacity=bench.capacity, drafter=bench.drafter)
        autotree.warm_up(bench.target, bench.draft, rows, int(bench.cfg.n_predict), cost,
                         bench.static, **kw)
      if bool(bench.cfg.get("auto_calibrate", True)):
        cost = autotree.calibrate(bench.target, bench.draft,
                                  batch_prompts(bench.prompts, p.batch)[0],
                                  int(bench.cfg.n_predict), cost, bench.static, sp=p.sp,
                                  rule=p.accept_rule, seed=int(bench.cfg.seed),
                                  capacity=bench.capacity, drafter=bench.drafter)
    bench.spec(p, cost)
    _warm_base(bench, p)
  compile_s = cw.seconds
  res, reps = _timed_reps(bench, p, lambda: bench.spec(p, cost))
  return point_record(bench, p, cost, res, reps, compile_s)


def point_record(bench: TreeBench, p: TreePoint, cost: autotree.TreeCosts,
                 res: list[autotree.AutoTreeResult], reps: list[dict],
                 compile_s: float) -> Record:
  """The point's record: measured, the p by rank, the predictions."""
  pooled = stats_lib.Records.concat([r.records for r in res])
  cands = bench.static if p.tree == AUTO else {p.tree: bench.cands[p.tree]}
  depth = max(t.max_depth for t in cands.values())
  st = stats_lib.SpecStats.compute(pooled, gamma=depth,
                                   n_predict=sum(r.stats.n_predict for r in res))
  acc = np.sum([r.rank_accepted for r in res], 0)
  tried = np.sum([r.rank_tried for r in res], 0)
  p_meas = [float(a / t) if t else None for a, t in zip(acc, tried)]
  rec = _common_fields(bench, p, reps, compile_s)
  rec.update(gamma=depth, p_by_rank=p_meas, t_target_s=cost.t_target[1])
  if p.tree == AUTO:
    used = [k for r in res for k in r.trees_used]
    rec.update(auto_trees=list(bench.static),
               trees_used={k: used.count(k) for k in bench.static if k in used})
    return schema.run_record(st, **rec)
  tree = bench.cands[p.tree]
  prior = rule_p(p.accept_rule, tree.width)
  pv = prior if prior is not None else tree_theory.estimate_p(acc, tried, autotree.PRIOR_P, 0.0)
  pv = np.nan_to_num(np.asarray(pv, float), nan=0.0)
  step_s = cost.step_s(p.tree, tree, 0.0)
  pred = autotree.predicted_speedups(cost, pv, {p.tree: tree}, drafter=bench.drafter)[p.tree]
  rec.update(tree_nodes=tree.n, tokens_per_step_predicted=tree_theory.tokens_per_step(
      tree.paths(), pv), predicted_measured_cost=pred, efficiency=rec["speedup"] / pred,
      predicted_step_s=step_s, t_verify_s=cost.t_target[tree.block_size],
      t_draft_s=cost.draft_s(tree.draft_widths()), t_accept_s=cost.t_accept.get(p.tree))
  return schema.run_record(st, **rec)


def points(cfg) -> list[TreePoint]:
  specs = [registry.parse(x).spec for x in drafter_specs(cfg)]
  return [TreePoint(str(t), a, SamplingParams(float(temp), int(cfg.top_k), float(cfg.top_p)),
                    int(b), d)
          for d in specs for b in sorted(int(b) for b in cfg.batches) for temp in cfg.temps
          for t in cfg.trees for a in cfg.accepts]


def run_tree_sweep(cfg, workdir: str, resume: bool = False, progress: bool = True,
                   only: int | None = None) -> list[Record]:
  """Runs every point of a trees config (`only`: at most that many new points,
  for tests of the resume); returns all records (finished + new)."""
  validate(cfg)
  os.makedirs(workdir, exist_ok=True)
  jsonl = os.path.join(workdir, wd.RESULTS)
  done = wd.read_jsonl(jsonl) if resume else []
  if done:
    check_same_sweep(workdir, cfg)
  wd.restart_jsonl(jsonl, done)  # whole records only: a torn line is dropped
  env = wd.environment()
  wd.write_config(workdir, cfg.to_dict(), env, schema=schema.SCHEMA_VERSION)
  cands = fixed_trees(cfg)
  specs = [registry.parse(x) for x in drafter_specs(cfg)]
  tcfg, tparams, tok = checkpoint.load_model(cfg.target, dtype=cfg.dtype, seed=int(cfg.seed))
  target, draft = steps.Runner(tcfg, tparams), None
  if any(d.needs_draft_model for d in specs):
    dcfg, dparams, _ = checkpoint.load_model(cfg.draft, dtype=cfg.dtype, seed=int(cfg.seed) + 1,
                                             role="draft")
    speculative.check_vocabularies(tcfg, dcfg)
    draft = steps.Runner(dcfg, dparams)
  prompts = sweep_prompts(cfg, tok, tcfg.vocab_size)
  capacity = generation.plan_capacity(tcfg, max(len(x) for x in prompts), int(cfg.n_predict),
                                      extra=max(max(t.n, getattr(t, "n_fed", 0))
                                                for t in cands.values()),
                                      ctx_size=int(cfg.ctx_size))
  benches = {d.spec: TreeBench(target, draft if d.needs_draft_model else None, d, prompts,
                               capacity, cands, cfg) for d in specs}
  finished = {record_key(r) for r in done}
  skipped = {}
  records, n_new = list(done), 0
  for p in points(cfg):
    if p.key in finished or (only is not None and n_new >= only):
      continue
    kind = (p.drafter, "auto" if p.tree == AUTO else "chain" if p.tree.startswith("chain")
            else "dynamic" if p.tree.startswith("dynamic") else "tree")
    if kind in skipped:
      continue
    try:
      rec = run_point(benches[p.drafter], p)
    except ConfigError as e:  # a drafter that cannot draft trees (yet): one line, go on
      skipped[kind] = f"drafter {p.drafter}, {kind[1]} points: skipped ({e})"
      print(skipped[kind], flush=True)
      continue
    d_cfg = benches[p.drafter].drafter.draft_config(tcfg, draft and draft.cfg)
    rec.update(target=tcfg.name, draft=d_cfg.name if d_cfg is not None else None,
               drafter=p.drafter, precision=tcfg.precision, env=env,
               prompt_set=str(cfg.get("prompt_set", "continuation")))
    wd.append_jsonl(jsonl, [rec])
    records.append(rec)
    n_new += 1
    if progress:
      pred = rec.get("predicted_measured_cost")
      print(f"point {len(records)}: {p.drafter} B={p.batch} {p.tree} {p.accept_rule} "
            f"T={p.sp.temperature:g}: {rec['tokens_per_step']:.2f} tokens/step"
              + (f" (predicted {rec['tokens_per_step_predicted']:.2f})"
                 if "tokens_per_step_predicted" in rec else "")
              + f", speedup {rec['speedup']:.3f}x"
              + (f" (predicted {pred:.3f}x)" if pred else ""), flush=True)
  wd.write_json(os.path.join(workdir, "costs.json"), {
      d: {f"{b},{sp.temperature:g}": c.to_dict() for (b, sp), c in bench.costs.items()}
      for d, bench in benches.items()}
      | ({"dynamic": {d: {f"{b},{sp.temperature:g},{t}": c
                          for (b, sp, t), c in bench.dynamic_costs.items()}
                      for d, bench in benches.items() if bench.dynamic_costs}}
         if any(b.dynamic_costs for b in benches.values()) else {}))
  from specjax.bench import tree_report  # matplotlib only when writing the report
  tree_report.write_report(workdir, records, env, list(skipped.values()))
  return records
