"""--gamma=auto:rows,budget=auto: the verify budget N chosen between chunks
(adaptive.py's loop, one chunk program per candidate N: plan.candidate_budgets).

T(N) is measured in the loop itself (`calibrate`, made monotone). Between
chunks `BudgetChooser` reads each live row's running alpha (and its
evidence) at the chunk's last step and what it proposed at every step of
the chunk, gives each candidate its allocation and each row's expected
tokens under the per-row geometric model, the drafted part scaled by the
run's accepted over expected drafts (`factor`), and picks the candidate that
finishes the live rows soonest, T(N) x max_b need_b / E_b(N): the batch runs
until its last row is done. Where a row's acceptance is seen at no cost
(rows_step.free_test), that time is averaged over each row's posterior of
alpha (`cautious`). docs/packed_verify.md (budget=auto, the batch's last row,
what a row has not shown).
"""

from __future__ import annotations

import dataclasses
from typing import Mapping

import jax
import numpy as np

from specjax.decode import adaptive
from specjax.decode import allocation
from specjax.decode import plan as plans
from specjax.decode import rows_step
from specjax.decode import rows_theory
from specjax.errors import ConfigError


# one small program per budget, compiled in BudgetChooser.start (before the run's clock):
# the allocation of PROPOSALS proposal vectors [P, B] at once (a chunk's, padded)
allocate_all = jax.jit(jax.vmap(allocation.allocate, in_axes=(None, None, None, 0)),
                       static_argnums=(1, 2))
PROPOSALS = adaptive.EVERY  # a chunk's steps at most: one call for most chunks

FACTOR_PRIOR = 2.0  # predicted drafts of pseudo-evidence that the model is right (factor 1)
DRAWS = 256         # posterior draws of the rows' alphas a cautious choice averages over


def lengths_of(alpha, limits, live, budget: int, gamma_max: int) -> np.ndarray:
  """[P, B] the lengths the allocation gives the live rows at budget N, for
  their alpha [B] and each proposal vector limits [P, B] (a finished row: 0)."""
  limits = np.where(np.asarray(live, bool), np.asarray(limits, np.int32), 0)
  p = limits.shape[0]
  padded = np.zeros((-(-p // PROPOSALS) * PROPOSALS, limits.shape[1]), np.int32)
  padded[:p] = limits
  alpha = np.asarray(alpha, np.float32)
  return np.concatenate([np.asarray(allocate_all(alpha, budget, gamma_max, padded[i:i + PROPOSALS]))
                         for i in range(0, padded.shape[0], PROPOSALS)])[:p]


def tokens_table(alpha, gamma_max: int) -> np.ndarray:
  """[..., B, gamma_max + 1] expected tokens a step of a row at acceptance
  alpha [..., B] given l = 0 .. gamma_max drafts: 1 + alpha + .. + alpha^l
  (metrics.theory.expected_tokens_per_step, for every l at once)."""
  a = np.clip(np.asarray(alpha, float), 0.0, 1.0)[..., None]
  return np.cumsum(a ** np.arange(gamma_max + 1), axis=-1)


def row_tokens(table, lengths, live, factor: float = 1.0) -> np.ndarray:
  """[..., B] each row's expected tokens a step at `lengths` [B] (table:
  tokens_table), its accepted drafts scaled by `factor` (a live row's tail
  token is certain; a finished row emits nothing)."""
  idx = np.broadcast_to(np.asarray(lengths)[..., None], table.shape[:-1] + (1,))
  drafts = np.take_along_axis(table, idx, -1)[..., 0] - 1.0
  return np.where(np.asarray(live, bool), 1.0 + factor * drafts, 0.0)


def finish_rate(need, tokens, step_s: float) -> float:
  """Tokens per second until the last live row is done: the live rows'
  tokens still needed (need [B], 0 for a finished row) over T(N) x the
  steps of the slowest, max_b need_b / E_b (tokens [B]: row_tokens;
  [S, B]: the steps averaged over S draws of the rows' acceptance)."""
  need, tokens = np.asarray(need, float), np.asarray(tokens, float)
  live = need > 0
  if not live.any():
    return 0.0
  steps = np.max(need[live] / tokens[..., live], axis=-1)
  return float(need[live].sum() / (step_s * np.mean(steps)))


def posterior_draws(alpha, weight, draws: int, seed: int = 0) -> np.ndarray:
  """[draws, B] the rows' acceptance drawn from their posteriors: Beta with
  the accepts and rejections behind each running alpha (weight, decayed)
  plus rows_step's prior pseudo-counts (alpha (weight + PRIOR_WEIGHT),
  (1 - alpha) (weight + PRIOR_WEIGHT))."""
  alpha = np.clip(np.asarray(alpha, float), 1e-6, 1 - 1e-6)
  n = np.asarray(weight, float) + rows_step.PRIOR_WEIGHT
  return np.random.default_rng(seed).beta(alpha * n, (1 - alpha) * n, (draws, alpha.size))


def predicted_drafts(records) -> float:
  """The accepted drafts the geometric model expected of a chunk's row-steps,
  each at the alpha its lengths were allotted from and the length it was given."""
  alpha = np.asarray(records["alpha"], np.float64)
  given = np.asarray(records["n_drafted"])
  return rows_theory.expected_tokens(alpha, given) - given.size


def chunk_proposals(records, batch: int) -> tuple[np.ndarray, np.ndarray]:
  """The distinct [B] vectors of what the rows proposed at the chunk's steps
  (0 for a row not recorded at a step), and the share of steps with each."""
  steps, index = np.unique(records["step"], return_inverse=True)
  per_step = np.zeros((steps.size, batch), np.int32)
  per_step[index, records["row"]] = records["proposed"]
  limits, counts = np.unique(per_step, axis=0, return_counts=True)
  return limits, counts / counts.sum()


@dataclasses.dataclass
class BudgetChooser:
  """adaptive.Chooser for budget=auto (module docstring). `times`: each
  candidate's seconds per loop step (calibrate). `cautious`: the finish
  time averaged over the rows' posteriors (posterior_draws), where seeing a
  row's acceptance costs nothing (rows_step.point_mass); otherwise at the
  running alpha, which bets on the prior until a row is given drafts."""
  times: Mapping[str, float]
  plan: plans.Plan
  cautious: bool = False
  estimates: list = dataclasses.field(default_factory=list)  # {name: tokens/s} per choice
  alpha: np.ndarray | None = None  # [B] the rows' running alpha at the last step seen ..
  weight: np.ndarray | None = None  # [B] .. and the evidence behind it
  limits: np.ndarray | None = None  # [P, B] the distinct proposals [B] of the last chunk's steps
  weights: np.ndarray | None = None  # [P] the share of the chunk's steps with each
  live: np.ndarray | None = None   # [B] the rows live at its last step
  accepted: float = 0.0            # drafts accepted in the chunks so far ..
  expected: float = 0.0            # .. and what the model expected of them
  factors: list = dataclasses.field(default_factory=list)  # `factor` at each choice
  emitted: np.ndarray | None = None  # [B] tokens each row has so far (its first included)

  def __post_init__(self):
    missing = sorted(set(self.plan.configs) - set(self.times))
    if missing or not all(c.per_row for c in self.plan.configs.values()):
      raise ConfigError(f"the budget chooser needs per-row candidates with their step times; "
                        f"missing {missing}")

  def start(self, rows):
    self.alpha = np.full(rows, rows_step.PRIOR_ALPHA, np.float32)
    self.weight = np.zeros(rows, np.float32)
    self.limits = np.full((1, rows), self.plan.first.gamma, np.int32)
    self.weights = np.ones(1)
    self.live = np.ones(rows, bool)
    self.emitted = np.ones(rows)
    self.predicted()  # compiles each budget's allocation now, not inside the timed loop

  def observe(self, name, records):
    del name
    if not len(records["step"]):
      return
    last = records["step"] == records["step"].max()
    rows = records["row"][last]
    self.live = np.zeros_like(self.live)
    self.live[rows] = True
    self.alpha[rows] = records["alpha"][last]  # the estimate that step read (one step old)
    self.weight[rows] = records["weight"][last]
    self.limits, self.weights = chunk_proposals(records, self.live.size)
    np.add.at(self.emitted, records["row"], records["kept"])
    self.accepted += float(np.sum(records["n_acc"]))
    self.expected += predicted_drafts(records)

  def factor(self) -> float:
    """Accepted over expected drafts so far, shrunk to 1 by FACTOR_PRIOR."""
    return (self.accepted + FACTOR_PRIOR) / (self.expected + FACTOR_PRIOR)

  def need(self, remaining: int) -> np.ndarray:
    """[B] the tokens each live row still needs (0 for a finished row), from
    `remaining`, the most any live row needs (adaptive.generate's), and the
    tokens each has emitted."""
    if not self.live.any():
      return np.zeros(self.live.size)
    most = self.emitted[self.live].min()  # the live row furthest behind needs `remaining`
    return np.where(self.live, np.maximum(1.0, remaining - (self.emitted - most)), 0.0)

  def predicted(self, remaining: int = 1) -> dict[str, float]:
    """Each candidate's tokens per second until the live rows as last seen
    are done (finish_rate), each needing `remaining` less what it is ahead;
    cautious: over the rows' posterior draws (the same draws for each)."""
    f, need = self.factor(), self.need(remaining)
    true = (posterior_draws(self.alpha, self.weight, DRAWS, seed=len(self.estimates))
            if self.cautious else self.alpha)
    table = tokens_table(true, max(sc.gamma for sc in self.plan.configs.values()))
    out = {}
    for k, sc in self.plan.configs.items():
      lengths = lengths_of(self.alpha, self.limits, self.live, sc.budget, sc.gamma)
      tokens = sum(w * row_tokens(table, l, self.live, f) for l, w in zip(lengths, self.weights))
      out[k] = finish_rate(need, tokens, self.times[k])
    return out

  def choose(self, remaining, live):
    del live
    pred = self.predicted(remaining)
    self.estimates.append(pred)
    self.factors.append(self.factor())
    return max(pred, key=lambda k: (pred[k], -self.plan.configs[k].budget))


def prepare(target, draft, prompts, n_predict: int, plan: plans.Plan, **kw):
  """budget=auto ready to run: every candidate compiled (adaptive.warm_up)
  and its loop step timed (`calibrate`). Returns (compile seconds, T(N) by
  candidate, run: one adaptive run with a fresh BudgetChooser per call)."""
  compile_s = adaptive.warm_up(target, draft, prompts, n_predict, plan, **kw)
  times = calibrate(target, draft, prompts, n_predict, plan, **kw)
  return compile_s, times, lambda: adaptive.generate(
      target, draft, prompts, n_predict, plan, chooser(times, plan), **kw)


def chooser(times: Mapping[str, float], plan: plans.Plan) -> BudgetChooser:
  """A fresh BudgetChooser for a run of `plan`, cautious where its drafts
  are point masses judged for real (rows_step.point_mass)."""
  return BudgetChooser(times, plan, cautious=rows_step.point_mass(plan.first))


def calibrate(target, draft, prompts, n_predict: int, plan: plans.Plan, **kw) -> dict[str, float]:
  """Each candidate's seconds per loop step, timed in the loop (call after
  adaptive.warm_up): the measured T(N) curve, made monotone."""
  return monotone(adaptive.step_times(target, draft, prompts, n_predict, plan, **kw), plan)


def monotone(times: Mapping[str, float], plan: plans.Plan) -> dict[str, float]:
  """T(N) raised to the largest T at any smaller N: a block of more tokens
  costs no less, so a calibration saying otherwise is noise (one run per
  candidate: on a loaded machine 56, 58, 55, 67 ms at N = 1, 2, 3, 5), and
  the noise would otherwise pick the larger block."""
  out, top = {}, 0.0
  for name in sorted(times, key=lambda k: plan.configs[k].budget):
    top = max(top, times[name])
    out[name] = top
  return out
