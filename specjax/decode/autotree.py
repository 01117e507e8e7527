"""--tree=auto: the token tree chosen at run time from measured costs and the
acceptance by sibling rank seen so far (decode/autogamma.py, for trees).

Candidates (`candidate_trees`, fixed for the whole run so nothing compiles
after the warm-up): the chains of 1, 2, 4, 8 drafts and Sequoia's best trees
(tree_theory.best_tree) of the AutoTree's sizes (4 .. 64 nodes, depth <=
AutoTree.max_depth) at a positional acceptance vector known before the run
(tree_theory.PRIOR_P unless given, e.g. a previous run's estimate). A best
tree that repeats an earlier candidate's topology is dropped.

The chooser (`choose`, pure): for each candidate the predicted speedup at
batch B from costs measured at B (`TreeCosts`):
  T_target(B, n)     a target forward over n tokens (a verify of 1 + N tokens;
                     a tree mask has the same shapes as the chain's)
  T_draft(B, w)      one draft level over w tokens per row (read off the
                     measured widths by linear interpolation)
  T_accept(B, name)  the accept phase and its bookkeeping (0 when unknown)
  t_step(name)       the loop's own step at that candidate (`calibrate`),
                     replacing the sum of the parts where known
  step = sum over levels T_draft(B, w_level) + T_target(B, N + 1) + T_accept
         + P(some row accepted a full path) T_draft(B, 1) (the catch-up,
         only for a drafter that autogamma.catches_up)
and tree_theory's tokens per step (steady state) or the tail model
(theory.batch_speedup_at_step on tree_theory.accept_pmf, what is left of
the run) at the current estimate of p.

p by rank: each step's record holds `leaf`, the block index of the last
accepted node of the tree that step ran; its rank path gives the step's
tries and accepts by rank (tree_theory.rank_counts: the children of each
accepted node tried in rank order up to the accepted one, all of them where
the step ended). Summed over the live steps so far, tree_theory.estimate_p
with `prior_weight` pseudo-trials at `prior_p` per rank.

At run time (`generate`): the device loop in chunks (speculative.spec_chunk,
one program per candidate whatever the chunk's length; `warm_up` compiles
them all) of 1, 2, 4, .. `every` steps, the host re-estimating p and
re-choosing between chunks. SpecState does not depend on the tree: the
target cache keeps the kept sequence minus the last token whatever the
tree, the draft model's cache the same (minus one after a fully accepted
path: the next draft phase catches up, a chain's or a tree's alike). The
output buffer is as wide as the deepest candidate needs and the cache holds
the largest verify block, so no shape changes between chunks.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Mapping, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from specjax.decode import acceptance
from specjax.decode import autogamma
from specjax.decode import generation
from specjax.decode import probes
from specjax.decode import speculative
from specjax.decode import tree_step
from specjax.decode.acceptance import AcceptRule
from specjax.drafters import base as drafters
from specjax.drafters import registry
from specjax.errors import ConfigError
from specjax.metrics import theory
from specjax.metrics import tree_theory
from specjax.metrics.stats import Records, SpecStats
from specjax.metrics.timing import CompileWatch, block
from specjax.model import sharding
from specjax.model import steps
from specjax.model import tree as trees
from specjax.model.sampling import SamplingParams

CHAINS = (1, 2, 4, 8)
EVERY = autogamma.EVERY
PRIOR_P = tree_theory.PRIOR_P
PRIOR_WEIGHT = tree_theory.PRIOR_WEIGHT


def candidate_trees(auto: trees.AutoTree = trees.AutoTree(),
                    p: Sequence[float] = PRIOR_P,
                    chains: Sequence[int] = CHAINS) -> dict[str, trees.Tree]:
  """name -> Tree: the chains 'chain:g' (g <= auto.max_depth) and the best
  trees 'sequoia:n,d' of auto.sizes at p, duplicates of an earlier topology
  dropped (module docstring)."""
  chains = [g for g in chains if g <= auto.max_depth]
  cands = tree_theory.candidates(p, auto.sizes, auto.max_depth, chains)
  out, seen = {}, set()
  for name, paths in cands.items():
    if paths in seen:
      continue
    seen.add(paths)
    out[name] = trees.chain(len(paths)) if name.startswith("chain:") else trees.from_paths(
        paths, name)
  return out


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
  charge = autogamma.catches_up(drafter)
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
  the candidates, and T_accept per candidate (a tree's priced as a chain's
  accept over as many drafts: the same [B, 1 + N, V] distributions), measured
  now (the probes compile, untimed)."""
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
  sc = speculative.SpecConfig(target.cfg, draft and draft.cfg, 1, drafter=drafter)
  t_accept = {}
  for name, t in cands.items():
    t_accept[name] = probes.accept_cost(dataclasses.replace(
        sc, gamma=t.n, sp=sp, simulated=rule.simulated), reps, batch=batch).median
  return TreeCosts(batch, t_target, t_draft, t_accept)


@dataclasses.dataclass
class AutoTreeResult(speculative.SpecResult):
  trees_used: list[str] = dataclasses.field(default_factory=list)  # per step
  ps: list[list[float]] = dataclasses.field(default_factory=list)  # p estimate at each choice
  rank_accepted: list[int] = dataclasses.field(default_factory=list)  # per rank, whole run
  rank_tried: list[int] = dataclasses.field(default_factory=list)


def _check(c: TreeCosts, batch: int, cands: Mapping[str, trees.Tree], drafter) -> None:
  if c.batch != batch:
    raise ConfigError(f"the auto tree costs were measured at batch {c.batch}, the run has "
                      f"{batch} rows")
  missing = sorted({t.block_size for t in cands.values()} - set(c.t_target)) + (
      [] if 1 in c.t_target else [1])
  if missing or 1 not in c.t_draft:
    raise ConfigError(f"the auto tree costs lack T_target(n) for n = {missing}"
                      + ("" if 1 in c.t_draft else " and T_draft(1)"))
  if not drafter.gamma_free_state and len(cands) > 1:
    raise ConfigError(f"drafter {drafter.spec} keeps state shaped by gamma: the tree cannot be "
                      "chosen at run time (use model or layerskip)")
  if (any(not t.is_chain for t in cands.values())
      and type(drafter).propose_tree is drafters.Drafter.propose_tree):
    raise ConfigError(f"drafter {drafter.spec} cannot draft a token tree yet: --tree=auto "
                      "needs one that does (model, layerskip)")


def _spec_config(target, draft, tree: trees.Tree, sp, rule, drafter, siblings):
  """A chain runs as the chain (tree None), any other tree as a tree."""
  return speculative.SpecConfig(target.cfg, draft and draft.cfg, tree.max_depth, sp,
                                rule.simulated, drafter=drafter,
                                tree=None if tree.is_chain else tree, siblings=siblings)


def generate(target: steps.Runner, draft: steps.Runner | None, prompts, n_predict: int,
             cost: TreeCosts, cands: Mapping[str, trees.Tree] | None = None,
             sp: SamplingParams = SamplingParams(), rule: AcceptRule | str = "real",
             seed: int = 0, eos_id: int | None = None, every: int = EVERY,
             prior_p: Sequence[float] = PRIOR_P, prior_weight: float = PRIOR_WEIGHT,
             ctx_size: int | None = None, capacity: int | None = None,
             fixed: Sequence[str] | None = None, drafter: drafters.Drafter | str = "model",
             siblings: str = "topk") -> AutoTreeResult:
  """Speculative generation with the tree re-chosen among `cands` (default
  candidate_trees()) every `every` steps (chunks of 1, 2, 4, .. every).

  Same keys, capacity rule and outputs as speculative.generate (for one
  candidate it emits that tree's tokens). `fixed` (tests, warm-up,
  calibrate) forces the candidate of each chunk in turn instead of choosing.
  """
  drafter = registry.parse(drafter)
  cands = dict(candidate_trees() if cands is None else cands)
  if not cands:
    raise ConfigError("--tree=auto needs at least one candidate tree")
  if every < 1:
    raise ConfigError(f"every (steps per tree choice) must be >= 1, got {every}")
  _check(cost, len(prompts), cands, drafter)
  rule = acceptance.parse_rule(rule) if isinstance(rule, str) else rule
  scs = {k: _spec_config(target, draft, t, sp, rule, drafter, siblings) for k, t in cands.items()}
  probs = {k: jnp.asarray(acceptance.position_probs(rule, t.max_depth) if t.is_chain
                          else tree_step.accept_probs(rule, t)) for k, t in cands.items()}
  width = max(t.width for t in cands.values())
  tables = {k: rank_tables(t, width) for k, t in cands.items()}
  deepest = max(t.max_depth for t in cands.values())
  biggest = max(cands, key=lambda k: (cands[k].block_size, cands[k].max_depth))
  dparams = drafter.draft_params(target.params, draft)
  eos = generation.NO_EOS if eos_id is None else int(eos_id)
  extra = max(t.block_size for t in cands.values()) - 1
  cap = generation.plan_capacity(target.cfg, max(len(p) for p in prompts), n_predict,
                                 extra=extra, ctx_size=ctx_size, capacity=capacity)
  key = jax.random.PRNGKey(seed)
  b = len(prompts)
  used, ps = [], []
  acc_total, tried_total = np.zeros(width, np.int64), np.zeros(width, np.int64)
  with CompileWatch() as cw:
    t0 = time.perf_counter()
    st, first = speculative.prefill(target, dparams, prompts, cap, key, scs[biggest])
    prompt_s = time.perf_counter() - t0
    out = jnp.full((b, n_predict + deepest + 1), eos, jnp.int32).at[:, 0].set(first)
    step_key = jax.random.fold_in(key, 1)
    t0 = time.perf_counter()
    count, done, rec = speculative.loop_start(out, eos, n_predict)
    i, start, chunk = jnp.int32(0), 0, 0
    remaining, rows = n_predict - 1, b
    while start < n_predict:
      if fixed is not None:
        name = fixed[chunk % len(fixed)]
      else:
        p = tree_theory.estimate_p(acc_total, tried_total, prior_p, prior_weight)
        name = choose(cost, p, cands, n_tokens=max(1, remaining), rows=rows, drafter=drafter)
        ps.append(p.tolist())
      i, st, out, count, done, rec = speculative.spec_chunk(
          target.params, dparams, st, out, count, done, i, rec, step_key, probs[name],
          jnp.int32(min(every, 2 ** chunk)), sc=scs[name], n_predict=n_predict, eos_id=eos)
      end = int(i)  # waits for the chunk
      used += [name] * (end - start)
      done_h, count_h, live, leaf = jax.device_get((done, count, rec["live"], rec["leaf"]))
      leaves = leaf[start:end][live[start:end].astype(bool)]
      acc_total += tables[name][0][leaves].sum(0)
      tried_total += tables[name][1][leaves].sum(0)
      live_rows = ~done_h
      if end == start or end >= n_predict or not live_rows.any():
        break
      remaining = n_predict - int(count_h[live_rows].min())
      rows = int(live_rows.sum())
      start, chunk = end, chunk + 1
    block(out)
    eval_s = time.perf_counter() - t0
  out, count = sharding.to_host(out), sharding.to_host(count)
  rec = {k: np.asarray(sharding.to_host(v))[:len(used)] for k, v in rec.items()}
  tokens = [out[r, :count[r]].tolist() for r in range(b)]
  records = Records.from_arrays(rec)
  depth = np.asarray([cands[k].max_depth for k in used], np.int64)
  records = dataclasses.replace(records, gamma=depth[records.step])
  stats = SpecStats.compute(records, gamma=deepest, n_predict=int(count.sum()), eval_s=eval_s)
  return AutoTreeResult(tokens=tokens, stats=stats, prompt_s=prompt_s, eval_s=eval_s,
                        compile_s=cw.seconds, records=records, trees_used=used, ps=ps,
                        rank_accepted=acc_total.tolist(), rank_tried=tried_total.tolist())


def calibrate(target: steps.Runner, draft: steps.Runner | None, prompts, n_predict: int,
              cost: TreeCosts, cands: Mapping[str, trees.Tree] | None = None,
              **kw) -> TreeCosts:
  """`cost` with t_step: each candidate's seconds per step in the auto loop
  itself (one run forcing it), for these prompts. Call after `warm_up` (a
  run that compiles raises)."""
  cands = dict(candidate_trees() if cands is None else cands)
  t_step = {}
  for name in cands:
    r = generate(target, draft, prompts, n_predict, cost, cands, fixed=[name], **kw)
    if r.compile_s:
      raise RuntimeError(f"calibrate compiled {name}'s program: call warm_up first")
    t_step[name] = r.eval_s / max(1, len(r.trees_used))
  return dataclasses.replace(cost, t_step=t_step)


def warm_up(target: steps.Runner, draft: steps.Runner | None, prompts, n_predict: int,
            cost: TreeCosts, cands: Mapping[str, trees.Tree] | None = None, **kw) -> float:
  """Compiles every candidate's chunk program (a run forcing each in turn);
  returns the compile seconds. Later runs of the same shapes compile
  nothing, whatever trees they choose."""
  cands = dict(candidate_trees() if cands is None else cands)
  return sum(generate(target, draft, prompts, n_predict, cost, cands, fixed=[name],
                      **kw).compile_s for name in cands)
