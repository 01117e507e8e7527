"""The sweep's cost model: measured step costs in, predicted speedup out.

Costs are measured the way the device loop pays them, with no host dispatch:
  T_target(n)  one target forward over n new tokens (batch 1) against a cache
               of the run's capacity holding `depth` tokens, its logits
               consumed as the run consumes them (argmax when greedy; the
               sampling distribution and a draw otherwise). n = 1 is a
               target-only decode step; n = gamma + 1 is the verify.
  T_draft(1)   the same for the draft model (a layer-skip draft: the target's
               layer subset). A drafter that proposes all gamma tokens in one
               call without a model (n-gram lookup): its propose time divided
               by gamma (`ProposeProbe`), so gamma T_draft(1) is that cost.
  T_accept     one accept phase plus the step's bookkeeping (keep_tokens,
               commit), for the point's rule kind (real or simulated), gamma
               and sampling settings.
Each is timed as k repetitions inside one jitted loop (`CostProbe`,
`accept_cost`), time per repetition reported.

The prediction for one point, from its own statistics (specjax.metrics.stats):
  step_s     = (gamma + catchup_share) T_draft(1) + T_target(gamma+1) + T_accept
  predicted  = tokens_per_step T_target(1) / step_s
where catchup_share is the share of steps that first fed the draft d_gamma
(the step before accepted every draft), and tokens_per_step counts the
tokens the run kept, the same tokens its measured speed counts.
  efficiency = measured speedup / predicted.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from specjax.model import kv_cache as kvc
from specjax.decode import speculative
from specjax.model import steps
from specjax.metrics import llamacpp_thread
from specjax.metrics import theory
from specjax.metrics import timing
from specjax.model.sampling import SamplingParams
from specjax.metrics.stats import SpecStats
from specjax.decode.probes import CostProbe

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


def measure_curve(probe_t: CostProbe, probe_d: CostProbe, gammas: Sequence[int],
                  reps: int) -> Curve:
  """T_target(1..max gamma + 1) at the measured gammas, T_draft(1) (greedy)."""
  ns = sorted({1} | {g + 1 for g in gammas} | set(gammas))
  t_target = {n: t.median for n, t in probe_t.times(ns, reps).items()}
  return Curve(t_target, probe_d.times([1], reps)[1].median, probe_t.capacity, probe_t.depth)


@functools.partial(jax.jit, static_argnames=("sc", "k"), donate_argnames=("state",))
def _repeat_phases(tparams, dparams, state: speculative.SpecState, key, accept_probs, *,
                   sc: speculative.SpecConfig, k: int):
  """k speculative steps' three phases (draft with its catch-up, verify,
  accept) from the same state, in one jitted loop: the loop body without its
  bookkeeping (keep_tokens, commit, records) and without the while loop."""
  live = jnp.ones(state.n.shape, bool)
  t_len = state.tcache.lengths
  # a draft cache is rolled back (no copy); other drafter states (the n-gram
  # history, layerskip:N's nothing) are not changed by a proposal
  reset = ((lambda c: kvc.rollback(c, state.dcache.lengths))
           if isinstance(state.dcache, kvc.KVCache) else (lambda c: c))

  def body(i, carry):
    st, acc = carry
    kd, ka = jax.random.split(jax.random.fold_in(key, i))
    d, dcache, tcache = sc.drafter.propose(dparams, st.dcache, st.tcache, st.tail, st.n, live,
                                           kd, sc)
    p, tcache = speculative.verify_phase(tparams, tcache, st.tail, d.tokens, sc)[:2]
    j = speculative.accept_phase(ka, accept_probs, p, d, st.tail, st.n, live, sc)
    st = st.replace(tcache=kvc.rollback(tcache, t_len), dcache=reset(dcache))
    return st, acc + jnp.sum(j.n_acc) + jnp.sum(j.emitted)

  state, acc = jax.lax.fori_loop(0, k, body, (state, jnp.int32(0)))
  return acc, state


def loop_overhead(target: steps.Runner, draft: steps.Runner | None, prompt: list[int],
                  gamma: int, n_steps: int = 16, reps: int = 5,
                  drafter: str = "model") -> dict[str, Any]:
  """What the device loop costs beyond its phases (batch 1, rule `always`).

  loop_step_s: the device loop's seconds per step (speculative.generate,
  n_steps steps, every one accepting all drafts, so every step but the first
  feeds the draft its d_gamma first). phases_step_s: the three phases of one
  such step, repeated in one jitted loop from a state that is behind by
  d_gamma (the same catch-up). overhead_share = 1 - phases / loop: the while
  loop, the bookkeeping, the records and the call itself. Another `drafter`
  (specjax.drafters.base) runs the same way; `always` then accepts what it drafted.
  """
  n_predict = 1 + n_steps * (gamma + 1)
  cap = len(prompt) + n_predict + gamma
  kw = dict(rule="always", capacity=cap, drafter=drafter)
  run = lambda: speculative.generate(target, draft, [prompt], n_predict, gamma, **kw)
  # The state after one fully accepted step: the draft is behind by d_gamma.
  first = speculative.generate(target, draft, [prompt], gamma + 2, gamma, keep_state=True, **kw)
  sc = speculative.SpecConfig(target.cfg, draft.cfg if draft is not None else None, gamma,
                              SamplingParams(), simulated=True, drafter=drafter)
  dparams = sc.drafter.draft_params(target.params, draft)
  holder = [first.state]
  probs, key = jnp.ones((gamma,)), jax.random.PRNGKey(0)

  def phases():
    acc, holder[0] = _repeat_phases(target.params, dparams, holder[0], key, probs,
                                    sc=sc, k=n_steps)
    return acc

  run(), timing.block(phases())  # compile both
  loop_s, phases_s = [], []
  for _ in range(reps):  # alternating, so both see the same machine state
    r = run()
    loop_s.append(r.eval_s / r.stats.n_steps)
    phases_s.append(timing.measure(phases, reps=1, warmup=0).median / n_steps)
  loop_m, phases_m = float(np.median(loop_s)), float(np.median(phases_s))
  return {"gamma": gamma, "n_steps": n_steps, "loop_step_s": loop_m,
          "phases_step_s": phases_m, "overhead_share": 1 - phases_m / loop_m,
          "loop_step_s_reps": loop_s, "phases_step_s_reps": phases_s}
