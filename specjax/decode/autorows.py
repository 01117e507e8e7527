"""--gamma=auto:rows,budget=auto: the verify budget N chosen between chunks
(adaptive.py's loop, one chunk program per candidate N: plan.candidate_budgets).

The cost curve is measured, not modelled: each candidate's seconds per loop
step T(N), timed in the loop itself (adaptive.step_times after warm_up: the
G drafts a row, the packed verify of N tokens, the judge and the chunk's
round trips). Between chunks `BudgetChooser` reads the last step's rows
(each live row's running alpha and what its drafter proposed), gives each
candidate its allocation (allocation.allocate) and expected tokens under
the per-row geometric model (rows_theory.expected_tokens), and picks the
candidate with the most expected tokens per second, E(N) / T(N).
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


# one small program per budget, compiled in BudgetChooser.start (before the run's clock)
allocate_jit = jax.jit(allocation.allocate, static_argnames=("budget", "gamma_max"))


def expected_tokens(alpha, limit, live, budget: int, gamma_max: int) -> float:
  """One step's expected tokens at budget N: the live rows' allocation for
  their alpha and proposals (limit) under the geometric model."""
  alpha, live = np.asarray(alpha, np.float32), np.asarray(live, bool)
  limit = np.where(live, np.asarray(limit, np.int32), 0)
  lengths = np.asarray(allocate_jit(alpha, budget, gamma_max, limit=limit))
  return rows_theory.expected_tokens(alpha[live], lengths[live])


@dataclasses.dataclass
class BudgetChooser:
  """adaptive.Chooser for budget=auto (module docstring). `times`: each
  candidate's seconds per loop step (calibrate)."""
  times: Mapping[str, float]
  plan: plans.Plan
  estimates: list = dataclasses.field(default_factory=list)  # {name: tokens/s} per choice
  alpha: np.ndarray | None = None  # [B] the rows' running alpha at the last step seen
  limit: np.ndarray | None = None  # [B] what each row proposed then
  live: np.ndarray | None = None   # [B] the rows live then

  def __post_init__(self):
    missing = sorted(set(self.plan.configs) - set(self.times))
    if missing or not all(c.per_row for c in self.plan.configs.values()):
      raise ConfigError(f"the budget chooser needs per-row candidates with their step times; "
                        f"missing {missing}")

  def start(self, rows):
    self.alpha = np.full(rows, rows_step.PRIOR_ALPHA, np.float32)
    self.limit = np.full(rows, self.plan.first.gamma, np.int32)
    self.live = np.ones(rows, bool)
    self.predicted()  # compiles each budget's allocation now, not inside the timed loop

  def observe(self, name, records):
    del name
    if not len(records["step"]):
      return
    last = records["step"] == records["step"].max()
    rows = records["row"][last]
    self.live = np.zeros_like(self.live)
    self.live[rows] = True
    self.limit[rows] = records["proposed"][last]
    self.alpha[rows] = records["alpha"][last]  # the estimate that step read (one step old)

  def predicted(self) -> dict[str, float]:
    """Each candidate's expected tokens per second for the rows as last seen."""
    return {k: expected_tokens(self.alpha, self.limit, self.live, sc.budget, sc.gamma)
            / self.times[k] for k, sc in self.plan.configs.items()}

  def choose(self, remaining, live):
    del remaining, live
    pred = self.predicted()
    self.estimates.append(pred)
    return max(pred, key=lambda k: (pred[k], -self.plan.configs[k].budget))


def calibrate(target, draft, prompts, n_predict: int, plan: plans.Plan, **kw) -> dict[str, float]:
  """Each candidate's seconds per loop step, timed in the loop (call after
  adaptive.warm_up): the measured T(N) curve."""
  return adaptive.step_times(target, draft, prompts, n_predict, plan, **kw)
