"""gamma chosen at run time from measured costs and the acceptance seen so far.

The chooser (`choose`, pure): for each gamma of a set, the predicted speedup
at batch B from the cost curves measured at B,
  T_target(B, n)  a target forward over n tokens per row,
  T_draft(B, 1)   a draft step,
  T_accept(B, g)  an accept phase and its bookkeeping (0 when unknown),
and an acceptance estimate alpha (i.i.d., capped geometric law):
  steady state  E[1 + k] T_target(B, 1) / ((g + catch-up) T_draft(B, 1)
                + T_target(B, g + 1) + T_accept(B, g))
  with n_tokens the same with the tail effect: a batch runs until its
                slowest row is done (theory.batch_speedup_at_step).
The catch-up share is P(some row accepted all g drafts) = 1 - (1 - alpha^g)^B,
charged only to a drafter that catches up (`catches_up`: the draft model, a
layer-skip list that is not a prefix). Where `calibrate` timed the loop's own
step at g (BatchCosts.t_step), that time replaces the step's sum of parts in
both predictions.

At run time (`generate`): the loop runs on device in chunks
(speculative.spec_chunk, one program per gamma of the set whatever the
chunk's length, compiled on the first chunk of that gamma: `warm_up`
compiles them all), and between chunks the host re-estimates alpha from the
accepted counts so far and re-chooses gamma. Chunks double in length from 1
step to `every` (1, 2, 4, .., every): the first choice, made on the prior
alone, lasts one step, and a short run still gets several choices. Each
choice is tail-aware: the predicted speedup of what is left (the most tokens
any live row still needs, over the live rows), not the steady state. The
SpecState does not depend on gamma; the output buffer is as wide as the
largest gamma needs, so no shape changes and nothing recompiles.

alpha estimate: the capped geometric law's maximum likelihood, accepted
drafts / (accepted drafts + rejections) (a step that accepted all it drafted
has no rejection), with `prior_weight` pseudo-observations at `prior_alpha`.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Mapping, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from specjax.decode import acceptance
from specjax.decode import probes
from specjax.drafters import base as drafters
from specjax.drafters import registry
from specjax.decode import generation
from specjax.model import sharding
from specjax.decode import speculative
from specjax.model import steps
from specjax.metrics import theory
from specjax.decode.acceptance import AcceptRule
from specjax.errors import ConfigError
from specjax.model.sampling import SamplingParams
from specjax.metrics.stats import Records, SpecStats
from specjax.metrics.timing import CompileWatch, block

DEFAULT_SET = (1, 2, 4, 8)
PRIOR_ALPHA = 0.7
PRIOR_WEIGHT = 2.0  # pseudo-observations (accept/reject events) at PRIOR_ALPHA
EVERY = 8           # steps per chunk once warmed in: gamma is re-chosen this often


def parse_set(spec: str | Sequence[int]) -> tuple[int, ...]:
  """'1,2,4,8' (or a sequence) -> sorted distinct gammas; empty or < 1 -> ConfigError."""
  if isinstance(spec, str):
    try:
      items = [int(x) for x in spec.replace(" ", "").split(",") if x]
    except ValueError:
      raise ConfigError(f"the auto gamma set must be comma-separated integers, got {spec!r}") from None
  else:
    items = [int(x) for x in spec]
  if not items:
    raise ConfigError("the auto gamma set is empty: give e.g. 1,2,4,8")
  if min(items) < 1 or max(items) > 64:
    raise ConfigError(f"the auto gamma set must hold gammas in [1, 64], got {items}")
  return tuple(sorted(set(items)))


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
  sc = speculative.SpecConfig(target.cfg, draft and draft.cfg, max(gammas), drafter=drafter)
  pt = probes.CostProbe(target, capacity, depth, batch=batch)
  pd = probes.draft_probe(drafter, target, draft, max(gammas), capacity, depth, batch=batch)
  ns = sorted({1} | {g + 1 for g in gammas})
  t_target = {n: t.median for n, t in pt.times(ns, reps, sp=sp).items()}
  t_draft = pd.times([1], reps, sp=sp)[1].median
  t_accept = {g: probes.accept_cost(dataclasses.replace(sc, gamma=g, sp=sp,
                                                      simulated=rule.simulated), reps,
                                   batch=batch).median for g in gammas}
  return BatchCosts(batch, t_target, t_draft, t_accept)


@dataclasses.dataclass
class AutoResult(speculative.SpecResult):
  gammas_used: list[int] = dataclasses.field(default_factory=list)  # per step
  alphas: list[float] = dataclasses.field(default_factory=list)     # estimate at each choice


def _check_costs(c: BatchCosts, batch: int, gammas: Sequence[int]) -> None:
  if c.batch != batch:
    raise ConfigError(f"the auto gamma costs were measured at batch {c.batch}, the run has "
                      f"{batch} rows")
  missing = [g for g in gammas if g + 1 not in c.t_target] + ([] if 1 in c.t_target else [0])
  if missing:
    raise ConfigError(f"the auto gamma costs lack T_target(n) for n = {[g + 1 for g in missing]}")


def generate(target: steps.Runner, draft: steps.Runner, prompts, n_predict: int,
             cost: BatchCosts, gammas: Sequence[int] = DEFAULT_SET,
             sp: SamplingParams = SamplingParams(), rule: AcceptRule | str = "real",
             seed: int = 0, eos_id: int | None = None, every: int = EVERY,
             prior_alpha: float = PRIOR_ALPHA, prior_weight: float = PRIOR_WEIGHT,
             ctx_size: int | None = None, capacity: int | None = None,
             fixed: Sequence[int] | None = None,
             drafter: drafters.Drafter | str = "model") -> AutoResult:
  """Speculative generation with gamma re-chosen every `every` steps.

  Same keys, capacity rule and outputs as speculative.generate (for one
  gamma of the set it emits the same tokens). Chunks of 1, 2, 4, .. `every`
  steps; `fixed` (tests, warm-up) forces the gamma of each chunk in turn
  instead of choosing. Every
  drafter whose state does not depend on gamma works (not eagle).
  """
  drafter = registry.parse(drafter)
  if not drafter.gamma_free_state:
    raise ConfigError(f"drafter {drafter.spec} keeps state shaped by gamma: gamma cannot be "
                      "chosen at run time (use model, ngram or layerskip)")
  gammas = parse_set(gammas)
  if every < 1:
    raise ConfigError(f"every (steps per gamma choice) must be >= 1, got {every}")
  _check_costs(cost, len(prompts), gammas)
  rule = acceptance.parse_rule(rule) if isinstance(rule, str) else rule
  gmax = max(gammas)
  scs = {g: speculative.SpecConfig(target.cfg, draft and draft.cfg, g, sp, rule.simulated,
                                   drafter=drafter) for g in gammas}
  dparams = drafter.draft_params(target.params, draft)
  probs = {g: jnp.asarray(acceptance.position_probs(rule, g)) for g in gammas}
  eos = generation.NO_EOS if eos_id is None else int(eos_id)
  cap = generation.plan_capacity(target.cfg, max(len(p) for p in prompts), n_predict,
                                 extra=gmax, ctx_size=ctx_size, capacity=capacity)
  key = jax.random.PRNGKey(seed)
  b = len(prompts)
  used, alphas = [], []
  n_acc_total = n_rej_total = 0
  with CompileWatch() as cw:
    t0 = time.perf_counter()
    st, first = speculative.prefill(target, dparams, prompts, cap, key, scs[gmax])
    prompt_s = time.perf_counter() - t0
    out = jnp.full((b, n_predict + gmax + 1), eos, jnp.int32).at[:, 0].set(first)
    step_key = jax.random.fold_in(key, 1)
    t0 = time.perf_counter()
    count, done, rec = speculative.loop_start(out, eos, n_predict)
    i, start, chunk = jnp.int32(0), 0, 0
    remaining, rows = n_predict - 1, b
    while start < n_predict:
      if fixed is not None:
        g = fixed[chunk % len(fixed)]
      else:
        a = estimate_alpha(n_acc_total, n_rej_total, prior_alpha, prior_weight)
        g = choose(cost, a, gammas, n_tokens=max(1, remaining), rows=rows, drafter=drafter)
        alphas.append(a)
      i, st, out, count, done, rec = speculative.spec_chunk(
          target.params, dparams, st, out, count, done, i, rec, step_key, probs[g],
          jnp.int32(min(every, 2 ** chunk)), sc=scs[g], n_predict=n_predict, eos_id=eos)
      end = int(i)  # waits for the chunk
      used += [g] * (end - start)
      # one host copy per chunk (slicing on device would compile a program per slice)
      done_h, count_h, live, acc, drafted = jax.device_get(
          (done, count, rec["live"], rec["n_acc"], rec["n_drafted"]))
      live_rows = ~done_h
      if end == start or end >= n_predict or not live_rows.any():
        break
      remaining = n_predict - int(count_h[live_rows].min())
      rows = int(live_rows.sum())
      live = live[start:end].astype(bool)
      acc, drafted = acc[start:end][live], drafted[start:end][live]
      n_acc_total += int(acc.sum())
      n_rej_total += int((acc < drafted).sum())
      start, chunk = end, chunk + 1
    block(out)
    eval_s = time.perf_counter() - t0
  out, count = sharding.to_host(out), sharding.to_host(count)
  rec = {k: np.asarray(sharding.to_host(v))[:len(used)] for k, v in rec.items()}
  rows = [out[r, :count[r]].tolist() for r in range(b)]
  records = Records.from_arrays(rec)
  # each entry's own gamma: the statistics (alpha) count the drafts each step asked for
  records = dataclasses.replace(records, gamma=np.asarray(used, np.int64)[records.step])
  stats = SpecStats.compute(records, gamma=gmax, n_predict=int(count.sum()), eval_s=eval_s)
  return AutoResult(tokens=rows, stats=stats, prompt_s=prompt_s, eval_s=eval_s,
                    compile_s=cw.seconds, records=records, gammas_used=used, alphas=alphas)


def calibrate(target: steps.Runner, draft: steps.Runner, prompts, n_predict: int,
              cost: BatchCosts, gammas: Sequence[int] = DEFAULT_SET, **kw) -> BatchCosts:
  """`cost` with t_step: each gamma's seconds per step measured in the auto
  loop itself (one run forcing that gamma, its chunks and host choices
  included), for these prompts. Call after `warm_up` (a run that compiles
  raises: its time would not be a step's). The probes' sum of parts can
  miss what the loop pays (XLA fuses and lays out the loop's verify
  differently, the chunks' host round trips): the chooser then compares the
  gammas at what they really cost here."""
  gammas = parse_set(gammas)
  t_step = {}
  for g in gammas:
    r = generate(target, draft, prompts, n_predict, cost, gammas, fixed=[g], **kw)
    if r.compile_s:
      raise RuntimeError(f"calibrate compiled gamma {g}'s program: call warm_up first")
    t_step[g] = r.eval_s / max(1, len(r.gammas_used))
  return dataclasses.replace(cost, t_step=t_step)


def warm_up(target: steps.Runner, draft: steps.Runner, prompts, n_predict: int,
            cost: BatchCosts, gammas: Sequence[int] = DEFAULT_SET, **kw) -> float:
  """Compiles every gamma's chunk program (one run forcing each gamma in
  turn); returns the compile seconds. Later runs of the same shapes compile
  nothing, whatever gammas they choose."""
  gammas = parse_set(gammas)
  total = 0.0
  for g in gammas:  # a run per gamma: a short run may finish before its later chunks
    total += generate(target, draft, prompts, n_predict, cost, gammas, fixed=[g], **kw).compile_s
  return total
