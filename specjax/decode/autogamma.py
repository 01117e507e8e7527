"""--gamma=auto: the chain's length chosen at run time (adaptive.py's loop)
from measured costs and the acceptance seen so far.

The cost model (`predicted_speedups`, pure): at batch B, with T_target(B, n),
T_draft(B, 1) and T_accept(B, g) measured (`BatchCosts`; a calibrated loop
step t_step replaces the sum of parts where known) and an i.i.d. alpha, the
steady state E[1 + k] T_target(B, 1) / step(g), or with the tail effect of
a batch that runs until its slowest row is done; the catch-up is charged
to a drafter that `catches_up`. `GammaChooser` re-estimates alpha from the
accepted counts (capped geometric maximum likelihood with prior
pseudo-observations) and picks the best gamma for what is left.
Derivations: docs/batches.md.
"""

from __future__ import annotations

import dataclasses
from typing import Mapping, Sequence

from specjax.decode import acceptance
from specjax.decode import adaptive
from specjax.decode import plan
from specjax.decode import probes
from specjax.drafters import base as drafters
from specjax.drafters import registry
from specjax.model import steps
from specjax.metrics import theory
from specjax.decode.acceptance import AcceptRule
from specjax.errors import ConfigError
from specjax.model.sampling import SamplingParams

DEFAULT_SET = plan.AUTO_SET
PRIOR_ALPHA = 0.7
PRIOR_WEIGHT = 2.0  # pseudo-observations (accept/reject events) at PRIOR_ALPHA
EVERY = adaptive.EVERY
parse_set = plan.parse_gamma_set


@dataclasses.dataclass(frozen=True)
class BatchCosts:
  """Measured seconds at one batch size B: what the chooser needs."""
  batch: int
  t_target: Mapping[int, float]       # n -> T_target(B, n); needs 1 and every gamma + 1
  t_draft: float                      # T_draft(B, 1)
  t_accept: Mapping[int, float] = dataclasses.field(default_factory=dict)  # gamma -> s
  # gamma -> seconds per step of the auto loop itself at that gamma (`calibrate`):
  # where known, it replaces the sum of the parts above
  t_step: Mapping[int, float] = dataclasses.field(default_factory=dict)

  def step_s(self, gamma: int, catchup: float) -> float:
    if gamma in self.t_step:
      return self.t_step[gamma]
    return ((gamma + catchup) * self.t_draft + self.t_target[gamma + 1]
            + self.t_accept.get(gamma, 0.0))

  def to_dict(self):
    return {"batch": self.batch, "t_target_s": {str(k): v for k, v in self.t_target.items()},
            "t_draft_s": self.t_draft, "t_accept_s": {str(k): v for k, v in self.t_accept.items()},
            **({"t_step_s": {str(k): v for k, v in self.t_step.items()}} if self.t_step else {})}

  @classmethod
  def from_dict(cls, d) -> "BatchCosts":
    return cls(int(d["batch"]), {int(k): float(v) for k, v in d["t_target_s"].items()},
               float(d["t_draft_s"]), {int(k): float(v) for k, v in d.get("t_accept_s", {}).items()},
               {int(k): float(v) for k, v in d.get("t_step_s", {}).items()})


def catches_up(drafter: drafters.Drafter | str) -> bool:
  """Whether the drafter pays the catch-up draft forward after a fully
  accepted step (Drafter.catches_up)."""
  return registry.parse(drafter).catches_up


def predicted_speedups(c: BatchCosts, alpha: float, gammas: Sequence[int],
                       n_tokens: int | None = None, rows: int | None = None,
                       drafter: drafters.Drafter | str = "model") -> dict[int, float]:
  """Predicted speedup per gamma at c.batch (module docstring): steady state,
  or, given n_tokens, a run of n_tokens per row over `rows` rows (default
  c.batch: the costs stay those measured at c.batch) with the tail model.
  Both price a step alike (c.step_s: the calibrated loop step where known);
  the catch-up is charged only to a drafter that `catches_up`."""
  rows = c.batch if rows is None else max(1, int(rows))
  charge = catches_up(drafter)
  out = {}
  for g in gammas:
    if g + 1 not in c.t_target:
      raise ConfigError(f"no measured T_target(B={c.batch}, {g + 1}) for gamma {g}")
    catchup = float(theory.catchup_any_share(alpha, g, rows)) if charge else 0.0
    step_s = c.step_s(g, catchup)
    if n_tokens is None:
      out[g] = float(theory.expected_tokens_per_step(alpha, g)) * c.t_target[1] / step_s
    else:
      out[g] = theory.batch_speedup_at_step(theory.geometric_accept_pmf(alpha, g), n_tokens,
                                            rows, c.t_target[1], step_s)
  return out


def choose(c: BatchCosts, alpha: float, gammas: Sequence[int],
           n_tokens: int | None = None, rows: int | None = None,
           drafter: drafters.Drafter | str = "model") -> int:
  """The gamma of the set with the largest predicted speedup (the smallest on a tie)."""
  pred = predicted_speedups(c, alpha, gammas, n_tokens, rows, drafter)
  return max(sorted(pred), key=lambda g: (pred[g], -g))


def estimate_alpha(n_accept: int, n_reject: int, prior_alpha: float = PRIOR_ALPHA,
                   prior_weight: float = PRIOR_WEIGHT) -> float:
  """(accepted + prior) / (accepted + rejections + prior weight)."""
  return (n_accept + prior_alpha * prior_weight) / (n_accept + n_reject + prior_weight)


def measure_costs(target: steps.Runner, draft: steps.Runner, batch: int, capacity: int,
                  depth: int, gammas: Sequence[int], sp: SamplingParams = SamplingParams(),
                  rule: AcceptRule | str = "real", reps: int = 3,
                  drafter: drafters.Drafter | str = "model") -> BatchCosts:
  """T_target(B, 1 and g+1), T_draft(B, 1), T_accept(B, g) for the run's
  settings, measured now (compiles the probes, untimed). A model-free
  drafter's T_draft is its proposal time per token at batch 1."""
  rule = acceptance.parse_rule(rule) if isinstance(rule, str) else rule
  drafter = registry.parse(drafter)
  sc = plan.SpecConfig(target.cfg, draft and draft.cfg, max(gammas), drafter=drafter)
  pt = probes.CostProbe(target, capacity, depth, batch=batch)
  pd = probes.draft_probe(drafter, target, draft, max(gammas), capacity, depth, batch=batch)
  ns = sorted({1} | {g + 1 for g in gammas})
  t_target = {n: t.median for n, t in pt.times(ns, reps, sp=sp).items()}
  t_draft = pd.times([1], reps, sp=sp)[1].median
  t_accept = {g: probes.accept_cost(dataclasses.replace(sc, gamma=g, sp=sp,
                                                      simulated=rule.simulated), reps,
                                   batch=batch).median for g in gammas}
  return BatchCosts(batch, t_target, t_draft, t_accept)


def gamma_of(name: str) -> int:
  """A --gamma=auto candidate's gamma ('chain:4' -> 4)."""
  return int(name.split(":")[1])


@dataclasses.dataclass
class GammaChooser:
  """adaptive.Chooser for --gamma=auto: alpha from the accepted counts so
  far, then the gamma with the best predicted speedup for what is left."""
  cost: BatchCosts
  plan: plan.Plan
  prior_alpha: float = PRIOR_ALPHA
  prior_weight: float = PRIOR_WEIGHT
  estimates: list = dataclasses.field(default_factory=list)  # alpha at each choice
  n_accept: int = 0
  n_reject: int = 0

  def __post_init__(self):
    _check_costs(self.cost, [gamma_of(k) for k in self.plan.configs])

  def start(self, rows):
    check_batch(self.cost, rows)

  def observe(self, name, records):
    del name
    acc, drafted = records["n_acc"], records["n_drafted"]
    self.n_accept += int(acc.sum())
    self.n_reject += int((acc < drafted).sum())

  def choose(self, remaining, live):
    a = estimate_alpha(self.n_accept, self.n_reject, self.prior_alpha, self.prior_weight)
    self.estimates.append(a)
    g = choose(self.cost, a, [gamma_of(k) for k in self.plan.configs], n_tokens=remaining,
               rows=live, drafter=self.plan.drafter)
    return f"chain:{g}"


def _check_costs(c: BatchCosts, gammas: Sequence[int]) -> None:
  missing = [g for g in gammas if g + 1 not in c.t_target] + ([] if 1 in c.t_target else [0])
  if missing:
    raise ConfigError(f"the auto gamma costs lack T_target(n) for n = {[g + 1 for g in missing]}")


def check_batch(c: BatchCosts, batch: int) -> None:
  if c.batch != batch:
    raise ConfigError(f"the auto gamma costs were measured at batch {c.batch}, the run has "
                      f"{batch} rows")


def calibrate(target, draft, prompts, n_predict: int, cost: BatchCosts, p: plan.Plan,
              **kw) -> BatchCosts:
  """`cost` with t_step: each gamma's seconds per step in the loop itself
  (adaptive.step_times). Call after adaptive.warm_up. The probes' sum of
  parts can miss what the loop pays (XLA lays out the loop's verify
  differently, the chunks' host round trips): the chooser then compares the
  gammas at what they really cost here."""
  times = adaptive.step_times(target, draft, prompts, n_predict, p, **kw)
  return dataclasses.replace(cost, t_step={gamma_of(k): v for k, v in times.items()})
