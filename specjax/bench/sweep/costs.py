"""The sweep's cost model: measured step costs in, predicted speedup out.

The costs (decode/probes.py, timed as the device loop pays them): T_target(n)
over n new tokens (n = 1 a decode step, gamma + 1 the verify), T_draft(1)
(a model-free drafter: its proposal per token), T_accept (the accept phase
and its bookkeeping). The prediction of one point, from its own statistics:
  step_s     = (gamma + catchup_share) T_draft(1) + T_target(gamma+1) + T_accept
  predicted  = tokens_per_step T_target(1) / step_s
  efficiency = measured speedup / predicted
(catchup_share: the steps that first fed the draft d_gamma; tokens_per_step
counts the tokens the run kept, as its measured speed does). Leviathan's and
the thread's predictions beside it (`predict`). docs/sweep.md.
"""

from __future__ import annotations

import dataclasses
import statistics
from typing import Any, Sequence

import numpy as np

from specjax.metrics import llamacpp_thread
from specjax.metrics import theory
from specjax.metrics.stats import SpecStats


def loop_steps(res: list) -> tuple[int, int, int]:
  """(loop steps, row-steps of the rows a loop step carried, loop steps in
  which some row first fed the draft d_gamma), summed over the runs: a batch
  loop runs until its slowest row is done, and its catch-up forward runs
  when any row needs it."""
  steps = carried = catchup = 0
  for r in res:
    rec = r.records
    s = int(rec.step.max()) + 1 if rec.step.size else 0
    steps += s
    carried += s * (int(rec.row.max()) + 1 if rec.row.size else 0)
    catchup += len(np.unique(rec.step[rec.caught_up.astype(bool)]))
  return steps, carried, catchup


def point_fields(bench, p, reps: list[dict], compile_s: float, steps: int,
                 n_runs: int) -> dict[str, Any]:
  """The fields every gamma-sweep point's record shares (a chain's, auto's,
  per-row lengths'): its settings, and the medians over repetitions of the
  target-only and speculative speeds (reps' base_s, spec_s, speedup)."""
  cfg = bench.cfg
  med = lambda k: statistics.median(r[k] for r in reps)
  return dict(
      batch=p.batch, accept_rule=p.accept_rule, temperature=p.sp.temperature,
      top_k=p.sp.top_k, top_p=p.sp.top_p, seed=cfg.seed, loop="device",
      capacity=bench.loop.capacity, n_prompts=len(bench.setup.prompts), reps=cfg.reps,
      baseline_tps=1 / med("base_s"), spec_tps=1 / med("spec_s"), speedup=med("speedup"),
      baseline_tps_reps=[1 / r["base_s"] for r in reps],
      compile_s=compile_s, loop_steps=steps, steps_measured=steps / n_runs)


@dataclasses.dataclass(frozen=True)
class StepCosts:
  """Measured seconds per call at one point (medians), what `predict` needs."""
  t_target: float        # T_target(1): one target-only decode step
  t_target_gamma: float  # T_target(gamma): the thread's pp(gamma)
  t_verify: float        # T_target(gamma+1)
  t_draft: float         # T_draft(1)
  t_accept: float        # one accept phase and its bookkeeping

  @property
  def c(self) -> float:
    """c = T_draft(1) / T_target(1)."""
    return self.t_draft / self.t_target

  @property
  def verify_ratio(self) -> float:
    """T_target(gamma+1) / T_target(1)."""
    return self.t_verify / self.t_target


def predict(st: SpecStats, c: StepCosts) -> dict[str, float]:
  """Every prediction of one point from its statistics and measured costs.

  predicted_measured_cost: the model of the module docstring.
  predicted_leviathan: Theorem 3.8 at the measured alpha and c (verify
    assumed to cost one decode step, no catch-up, no accept cost).
  predicted_thread: ggerganov's approximation in [T3649] (c from the
    speeds: tg_draft, tg_target, pp_target(gamma)).
  """
  gamma = st.gamma
  step_s = (gamma + st.catchup_share) * c.t_draft + c.t_verify + c.t_accept
  return {
      "predicted_step_s": step_s,
      "predicted_measured_cost": float(theory.measured_cost_speedup(
          st.tokens_per_step, gamma, c.t_draft, c.t_target, c.t_verify,
          st.catchup_share * c.t_draft + c.t_accept)),
      "predicted_leviathan": float(theory.leviathan_speedup(st.alpha, gamma, c.c)),
      "predicted_thread": float(llamacpp_thread.thread_approx_speedup(
          st.alpha, gamma, 1 / c.t_draft, 1 / c.t_target, gamma / c.t_target_gamma)),
  }


@dataclasses.dataclass
class Curve:
  """The cost curve of a sweep (seconds, medians), written to costs.json."""
  t_target: dict[int, float]   # T_target(n), greedy
  t_draft: float               # T_draft(1), greedy
  capacity: int
  depth: int

  @property
  def c(self) -> float:
    return self.t_draft / self.t_target[1]

  def verify_ratio(self, n: int) -> float:
    return self.t_target[n] / self.t_target[1]

  def to_dict(self) -> dict[str, Any]:
    return {"t_target_s": {str(k): v for k, v in self.t_target.items()},
            "t_draft_s": self.t_draft, "c": self.c,
            "verify_ratio": {str(k): self.verify_ratio(k) for k in self.t_target},
            "capacity": self.capacity, "depth": self.depth}


def measure_curve(probe_t, probe_d, gammas: Sequence[int],
                  reps: int) -> Curve:
  """T_target(1..max gamma + 1) at the measured gammas, T_draft(1) (greedy)."""
  ns = sorted({1} | {g + 1 for g in gammas} | set(gammas))
  t_target = {n: t.median for n, t in probe_t.times(ns, reps).items()}
  return Curve(t_target, probe_d.times([1], reps)[1].median, probe_t.capacity, probe_t.depth)
