"""The sweeps' one door into the engine (decode/, drafters/, model/tree.py).

Every run, probe and engine name the harness and its runners use goes
through here: `Loop` binds the run's fixed settings (the models, capacity,
n_predict, seed) to the engine's generate functions and cost probes, and the
module functions parse the engine's vocabulary (drafters, rules, trees). An
engine API change is a change of this file, not of the runners.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Mapping, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from specjax.decode import acceptance, adaptive, autogamma, autorows, autotree, generation, plan
from specjax.decode import probes, rows_step, rows_theory, speculative
from specjax.drafters import registry
from specjax.errors import ConfigError
from specjax.metrics import theory, timing
from specjax.model import kv_cache as kvc
from specjax.model import steps
from specjax.model import tree as trees

GAMMA_EVERY = autogamma.EVERY
PRIOR_P = autotree.PRIOR_P
PROBE_REPEATS = probes.PROBE_REPEATS
BatchCosts, TreeCosts = autogamma.BatchCosts, autotree.TreeCosts
CostProbe, ProposeProbe, PackedProbe = probes.CostProbe, probes.ProposeProbe, probes.PackedProbe
ROWS_DEFAULT = "default"  # a per-row point's budget when none is given (rows_step.default_budget)
check_vocabularies, plan_capacity = plan.check_vocabularies, generation.plan_capacity
predicted_gamma_speedups, choose_gamma = autogamma.predicted_speedups, autogamma.choose


def drafter(spec):
  """A drafter from its spec (drafters/registry.py); ConfigError if unknown."""
  return registry.parse(spec)


def check_rule(rule: str, gamma: int | None = None) -> None:
  """The rule parses (and applies at `gamma` drafts, when given)."""
  r = acceptance.parse_rule(rule)
  if gamma is not None:
    r.resolve(gamma)


def is_simulated(rule: str) -> bool:
  return acceptance.parse_rule(rule).simulated


def accept_pmf(rule: str, gamma: int, alpha: float) -> np.ndarray:
  """The law of accepted drafts per step: a simulated rule's own, the capped
  geometric at `alpha` for the real rule."""
  r = acceptance.parse_rule(rule).resolve(gamma)
  if r.simulated:
    return theory.accept_pmf_from_position_probs(acceptance.position_probs(r, gamma))
  return theory.geometric_accept_pmf(alpha, gamma)


def fixed_tree(spec: str, where: str):
  """A fixed tree (static, or dynamic:K,D,N) from its spec; ConfigError
  naming `where` for anything else (auto:...)."""
  if str(spec).strip().startswith("auto") or not isinstance(
      t := trees.parse(spec, 1), (trees.Tree, trees.DynamicTree)):
    raise ConfigError(f"{where} {spec} is not a fixed tree (use chain:G, kary:K,D, "
                      "sequoia:N,D, a JSON list, dynamic:K,D,N, or auto)")
  return t


def auto_candidates(spec: str) -> dict | None:
  """--tree=auto's candidates for an auto[:N1,..] spec, name -> Tree
  (plan.candidate_trees of its sizes); None for any other spec."""
  sizes = plan.parse_auto_sizes(spec)
  return None if sizes is None else plan.candidate_trees(sizes)


def check_auto_tree(d, spec: str) -> None:
  """Drafter `d` can run --tree=`spec` (auto: it drafts every candidate, its
  state continued across them); ConfigError, one line, if not."""
  plan.parse_flags(drafter=d, tree=spec)


def rows_spec(gamma_max: int, budget: str) -> str:
  """The --gamma spelling of per-row lengths: auto:rows,max=G[,budget=N|auto]
  (budget ROWS_DEFAULT: none given, rows_step.default_budget)."""
  return f"{plan.AUTO}:{plan.ROWS},max={gamma_max}" + (
      "" if budget == ROWS_DEFAULT else f",budget={budget}")


def parse_rows(spec: str) -> tuple[int, int | str] | None:
  """(gamma_max, budget: 0 the default, N, or 'auto') of a per-row spec; None for others."""
  return plan.parse_rows(spec)


def check_rows(spec: str, d, rule: str) -> None:
  """Drafter `d` can run per-row lengths `spec` under `rule` (ConfigError, one line)."""
  plan.parse_flags(drafter=d, gamma=spec, rule=rule)


def rows_budget(spec: str, batch: int) -> int | str:
  """The verify budget N a fixed per-row spec runs at `batch` ('auto' for budget=auto)."""
  g, n = plan.parse_rows(spec)
  return n if n == plan.AUTO else n or rows_step.default_budget(batch, g)


def rows_theory_of(res, budget, gamma_max: int, batch: int) -> rows_theory.RowsTheory:
  """A per-row run's tokens per step beside the geometric model's
  (rows_theory.compare; budget: N, or each loop step's)."""
  return rows_theory.compare(res.records, budget, gamma_max, batch)


def is_dynamic(tree) -> bool:
  return isinstance(tree, trees.DynamicTree)


def draft_name(d, target: steps.Runner, draft: steps.Runner | None) -> str | None:
  """The name of the model `d` drafts with (None for a model-free drafter)."""
  cfg = d.draft_config(target.cfg, draft and draft.cfg)
  return cfg.name if cfg is not None else None


@dataclasses.dataclass(frozen=True)
class Loop:
  """The engine bound to a sweep's fixed settings: every run and probe."""
  target: steps.Runner
  draft: steps.Runner | None
  capacity: int
  n_predict: int
  seed: int

  # ------------------------------------------------------------ runs

  def target_only(self, rows, sp: SamplingParams):
    return generation.generate(self.target, rows, self.n_predict, sp, seed=self.seed,
                               capacity=self.capacity)

  def chain(self, rows, gamma: int, sp, rule: str, d, loop: str = "device"):
    return speculative.generate(self.target, self.draft, rows, self.n_predict, gamma, sp=sp,
                                rule=rule, seed=self.seed, capacity=self.capacity, loop=loop,
                                drafter=d)

  def _kw(self, every: int | None = None) -> dict:
    return dict(seed=self.seed, capacity=self.capacity,
                **({} if every is None else {"every": every}))

  def gamma_plan(self, gammas, sp, rule: str, d) -> plan.Plan:
    return plan.resolve(self.target.cfg, self.draft and self.draft.cfg, drafter=d,
                        gamma="auto", auto_set=gammas, rule=rule, sp=sp)

  def tree_plan(self, cands, sp, rule: str, d, siblings: str = "topk") -> plan.Plan:
    return plan.resolve(self.target.cfg, self.draft and self.draft.cfg, drafter=d,
                        auto_trees=cands, rule=rule, sp=sp, siblings=siblings)

  def auto_chain(self, rows, cost, gammas, sp, rule: str, d, every: int, fixed=None):
    """adaptive's loop with gamma chosen (or `fixed`: a forced schedule of gammas)."""
    p = self.gamma_plan(gammas, sp, rule, d)
    autogamma.check_batch(cost, len(rows))
    chooser = (adaptive.Fixed([f"chain:{g}" for g in fixed]) if fixed is not None
               else autogamma.GammaChooser(cost, p))
    return adaptive.generate(self.target, self.draft, rows, self.n_predict, p, chooser,
                             **self._kw(every))

  def warm_chain(self, rows, gammas, sp, rule: str, d, every: int) -> float:
    """Compiles every gamma's chunk program (the compile seconds)."""
    return adaptive.warm_up(self.target, self.draft, rows, self.n_predict,
                            self.gamma_plan(gammas, sp, rule, d), **self._kw(every))

  def gamma_costs(self, batch: int, depth: int, gammas, sp, rule: str, d,
                  reps: int) -> autogamma.BatchCosts:
    """What auto gamma chooses from at `batch` (autogamma.measure_costs)."""
    return autogamma.measure_costs(self.target, self.draft, batch, self.capacity, depth, gammas,
                                   sp, rule, reps, drafter=d)

  def calibrate_chain(self, rows, cost, gammas, sp, rule: str, d, every: int):
    return autogamma.calibrate(self.target, self.draft, rows, self.n_predict, cost,
                               self.gamma_plan(gammas, sp, rule, d), **self._kw(every))

  def trees(self, rows, cost, cands, sp, rule: str, d, siblings: str, every: int, fixed=None):
    """adaptive's loop with the tree chosen among `cands` (or `fixed` names);
    either way the accepts and tries by sibling rank are counted."""
    p = self.tree_plan(cands, sp, rule, d, siblings)
    autotree.check_batch(cost, len(rows))
    chooser = (FixedTrees(cost, p, names=list(fixed)) if fixed is not None
               else autotree.TreeChooser(cost, p))
    return adaptive.generate(self.target, self.draft, rows, self.n_predict, p, chooser,
                             **self._kw(every))

  def warm_trees(self, rows, cost, cands, sp, rule: str, d) -> None:
    del cost
    adaptive.warm_up(self.target, self.draft, rows, self.n_predict,
                     self.tree_plan(cands, sp, rule, d), **self._kw())

  def calibrate_trees(self, rows, cost, cands, sp, rule: str, d):
    return autotree.calibrate(self.target, self.draft, rows, self.n_predict, cost,
                              self.tree_plan(cands, sp, rule, d), **self._kw())

  def dynamic(self, rows, tree, sp, rule: str, d, siblings: str):
    return speculative.generate(self.target, self.draft, rows, self.n_predict, tree.max_depth,
                                sp=sp, rule=rule, seed=self.seed, capacity=self.capacity,
                                drafter=d, tree=tree, siblings=siblings)

  def rows_plan(self, spec: str, sp, rule: str, d, batch: int) -> plan.Plan:
    """--gamma=`spec` (auto:rows..) resolved at `batch` (budget=auto: a candidate per budget)."""
    return plan.parse_flags(drafter=d, gamma=spec, rule=rule, sp=sp).resolve(
        self.target.cfg, self.draft and self.draft.cfg, batch=batch)

  def per_row(self, rows, spec: str, sp, rule: str, d, every: int, times=None):
    """Per-row lengths: a fixed budget's device loop, or budget=auto's chunks
    with the budget chosen from `times` (calibrate_rows: each candidate's step)."""
    p = self.rows_plan(spec, sp, rule, d, len(rows))
    if p.auto != plan.ROWS:
      return speculative.run(self.target, self.draft, rows, self.n_predict, p, seed=self.seed,
                             capacity=self.capacity)
    return adaptive.generate(self.target, self.draft, rows, self.n_predict, p,
                             autorows.chooser(times, p), **self._kw(every))

  def warm_rows(self, rows, spec: str, sp, rule: str, d, every: int) -> float:
    """Compiles budget=auto's every candidate's chunk program (the compile seconds)."""
    return adaptive.warm_up(self.target, self.draft, rows, self.n_predict,
                            self.rows_plan(spec, sp, rule, d, len(rows)), **self._kw(every))

  def calibrate_rows(self, rows, spec: str, sp, rule: str, d, every: int) -> dict[str, float]:
    """budget=auto's T(N): each candidate's seconds per loop step, in the loop
    (autorows.calibrate: never falling with N)."""
    return autorows.calibrate(self.target, self.draft, rows, self.n_predict,
                              self.rows_plan(spec, sp, rule, d, len(rows)), **self._kw(every))

  # ------------------------------------------------------------ probes

  def cost_probe(self, m: steps.Runner, depth: int, batch: int = 1) -> probes.CostProbe:
    return probes.CostProbe(m, self.capacity, depth, k=PROBE_REPEATS, batch=batch)

  def packed_probe(self, depth: int, batch: int, gamma_max: int) -> probes.PackedProbe:
    return probes.PackedProbe(self.target, self.capacity, depth, batch, gamma_max,
                              k=PROBE_REPEATS)

  def draft_probe(self, d, gamma: int, depth: int, batch: int = 1):
    return probes.draft_probe(d, self.target, self.draft, gamma, self.capacity, depth,
                              batch=batch, k=PROBE_REPEATS)

  def spec_config(self, gamma: int, sp, rule: str, d) -> plan.SpecConfig:
    return plan.SpecConfig(self.target.cfg, self.draft and self.draft.cfg, gamma, sp,
                           is_simulated(rule), drafter=d)

  def accept_s(self, gamma: int, sp, rule: str, d, reps: int, batch: int = 1) -> float:
    """A chain's accept phase and its bookkeeping (median seconds)."""
    return probes.accept_cost(self.spec_config(gamma, sp, rule, d), reps, batch=batch).median

  def tree_accept_s(self, tree, sp, rule: str, d, reps: int, batch: int = 1) -> float:
    """A tree's accept phase, timed on the tree judge (median seconds)."""
    return probes.tree_accept_cost(self.spec_config(tree.max_depth, sp, rule, d), tree, reps,
                                   batch=batch).median

  def tree_costs(self, batch: int, depth: int, cands: Mapping[str, trees.Tree], sp,
                 rule: str, d, reps: int) -> autotree.TreeCosts:
    """autotree's costs at `batch` (a tree's accept timed on the tree judge)."""
    return autotree.measure_costs(self.target, self.draft, batch, self.capacity, depth, cands,
                                  sp, rule, reps, drafter=d)

  def dynamic_costs(self, tree, batch: int, depth: int, sp, rule: str, d,
                    reps: int) -> dict[str, float]:
    """A dynamic tree's step parts: T_target(B, 1), T_target(B, 1 + N), the
    whole proposal (DynamicCostProbe) and the tree judge's accept."""
    pt = probes.CostProbe(self.target, self.capacity, depth, batch=batch)
    t_t = {n: t.median for n, t in pt.times([1, tree.block_size], reps, sp=sp).items()}
    pd = DynamicCostProbe(d, self.target, self.draft, tree, self.capacity, depth, batch=batch)
    return {"t_target_s": t_t[1], "t_verify_s": t_t[tree.block_size],
            "t_draft_s": pd.time(reps),
            "t_accept_s": self.tree_accept_s(tree, sp, rule, d, reps, batch)}


@dataclasses.dataclass
class FixedTrees(autotree.TreeChooser):
  """A forced schedule of trees (chunk c runs names[c % len]) that counts
  the accepts and tries by sibling rank as the chooser does: what a fixed
  tree's point reports."""
  names: Sequence[str] = ()
  chunk: int = 0

  def choose(self, remaining, live):
    del remaining, live
    self.chunk += 1
    return self.names[(self.chunk - 1) % len(self.names)]


def chosen(res) -> list[str]:
  """The candidate each loop step ran, over adaptive runs."""
  return [k for r in res for k in r.chosen]


def gammas_chosen(res) -> list[int]:
  return [autogamma.gamma_of(k) for k in chosen(res)]


def last_estimates(res) -> list:
  """Each run's last estimate (alpha, or p by rank); None where it chose nothing."""
  return [r.estimates[-1] if r.estimates else None for r in res]


def rank_counts(res) -> tuple[np.ndarray, np.ndarray]:
  """(accepted, tried) by sibling rank, summed over tree runs."""
  return (np.sum([r.chooser.rank_accepted for r in res], 0),
          np.sum([r.chooser.rank_tried for r in res], 0))


def predicted_tree_speedup(cost: autotree.TreeCosts, p, name: str, tree, d) -> float:
  return autotree.predicted_speedups(cost, p, {name: tree}, drafter=d)[name]


@functools.partial(jax.jit, static_argnames=("sc", "k"), donate_argnames=("tcache",))
def _repeat_propose_tree(dparams, dstate, tcache, tail, n, key, *, sc, k: int):
  """k dynamic-tree proposals on device; each iteration's lengths differ
  (n - i % 2, the target cache's with them), so XLA cannot hoist the
  proposal out of the loop. `tcache`, the target's prefilled cache, is
  carried as the engine's step carries it: a drafter that writes it
  (layerskip:K, streaming) writes in place, not into a copy per iteration.
  Returns (a checksum, tcache)."""
  live = jnp.ones(n.shape, bool)
  base = tcache.lengths

  def body(i, carry):
    acc, tc = carry
    dr, _, tc = sc.drafter.propose_tree(dparams, dstate, kvc.rollback(tc, base - i % 2), tail,
                                        n - i % 2, live, jax.random.fold_in(key, i), sc)
    return acc + jnp.sum(dr.tokens), tc

  acc, tcache = jax.lax.fori_loop(0, k, body, (jnp.int32(0), tcache))
  return acc, kvc.rollback(tcache, base)


class DynamicCostProbe:
  """T_draft_tree: one whole dynamic-tree proposal (every level the drafter
  feeds, the selection, the mask) at batch B, on a history of `depth` random
  tokens; k proposals per timed repetition in one jitted loop. The target's
  cache is prefilled with that history as the engine's prefill does
  (speculative.prefill): layerskip:K drafts on the target's own cache."""

  def __init__(self, d, target: steps.Runner, draft: steps.Runner | None, tree, capacity: int,
               depth: int, batch: int = 1, seed: int = 0, k: int = PROBE_REPEATS):
    self.sc = plan.SpecConfig(target.cfg, draft and draft.cfg, tree.max_depth,
                              drafter=d, simulated=True, tree=tree)
    self.k = k
    prompt = np.random.RandomState(seed).randint(0, target.cfg.vocab_size, depth - 1).tolist()
    self.dparams = self.sc.drafter.draft_params(target.params, draft)
    prompts = [prompt] * batch
    _, self.tcache = target.prefill(prompts, target.new_cache(batch, capacity))
    self.dstate = self.sc.drafter.init(self.sc, target, self.dparams, prompts, capacity,
                                       jnp.asarray([prompt[-1]] * batch))
    self.tail = jnp.asarray([[prompt[-1], prompt[-1]]] * batch, jnp.int32)
    self.n = jnp.full((batch,), depth, jnp.int32)

  def time(self, reps: int) -> float:
    """Median seconds of one proposal (compiles untimed first)."""
    def run():
      acc, self.tcache = _repeat_propose_tree(self.dparams, self.dstate, self.tcache, self.tail,
                                              self.n, jax.random.PRNGKey(0), sc=self.sc, k=self.k)
      return acc

    return timing.measure(run, reps=reps, warmup=1).median / self.k


def batch_costs(loop: Loop, probe_t, probe_d, batch: int, gammas: Sequence[int], sp,
                rule: str, d, reps: int) -> autogamma.BatchCosts:
  """T_target(B, n) at n = 1, every gamma and gamma + 1, T_draft(B, 1) and
  the accept cost at every gamma: what auto gamma chooses from at `batch`."""
  ns = sorted({1} | set(gammas) | {g + 1 for g in gammas})
  t_target = {n: t.median for n, t in probe_t.times(ns, reps, sp=sp).items()}
  t_draft = probe_d.times([1], reps, sp=sp)[1].median
  return autogamma.BatchCosts(batch, t_target, t_draft,
                              {g: loop.accept_s(g, sp, rule, d, reps, batch) for g in gammas})
