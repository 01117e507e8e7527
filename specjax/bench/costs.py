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
from specjax.model import llama as model_lib
from specjax.decode import sampling
from specjax.decode import speculative
from specjax.model import steps
from specjax.metrics import theory
from specjax.metrics import timing
from specjax.decode.sampling import SamplingParams
from specjax.metrics.stats import SpecStats

REPEATS = 8  # forwards (or accept phases) per timed repetition
PROBE_REPEATS = 4  # ... in the sweep's probes, which it repeats (sweep.PROBE_REPS)


@functools.partial(jax.jit, static_argnames=("cfg", "k", "sp"), donate_argnames=("cache",))
def _repeat_forward(params, tokens, cache: kvc.KVCache, key, cfg, k: int, sp: SamplingParams):
  """k forwards of tokens from the same cache state, on device (no dispatch),
  each followed by what a run does with the logits."""
  depth = cache.lengths

  def body(i, carry):
    c, acc = carry
    logits, c = model_lib.forward(params, tokens, c, cfg)
    # Consume every logit, as decoding does: keeping only a slice would let
    # XLA shrink the lm_head matmul to that slice.
    tok = sampling.sample_logits(jax.random.fold_in(key, i), logits, sp)
    return kvc.rollback(c, depth), acc + jnp.sum(tok, -1)

  cache, acc = jax.lax.fori_loop(0, k, body,
                                 (cache, jnp.zeros(tokens.shape[:1], jnp.int32)))
  return acc, cache


def random_tokens(rng: np.random.RandomState, vocab: int, b: int, t: int) -> jax.Array:
  return jnp.asarray(rng.randint(0, vocab, (b, t)), jnp.int32)


def filled_cache(m: steps.Runner, batch: int, capacity: int, depth: int,
                 rng: np.random.RandomState) -> kvc.KVCache:
  """A new cache holding `depth` random tokens per row (untimed setup)."""
  cache = m.new_cache(batch, capacity)
  if depth:
    prompts = rng.randint(0, m.cfg.vocab_size, (batch, depth)).tolist()
    cache = timing.block(m.prefill(prompts, cache)[1])
  return cache


class CostProbe:
  """Measures T(n) of one model: a forward over n new tokens per row (batch
  `batch`, 1 by default) against a cache of `capacity` slots already holding
  `depth` tokens per row.

  Each repetition runs k forwards inside one jitted loop and reports the time
  per forward, so host dispatch (which the on-device loop never pays) stays
  out. The probe keeps its cache, so it can be called again and again between
  other measurements (the sweep interleaves it with the runs it predicts).
  """

  def __init__(self, m: steps.Runner, capacity: int, depth: int, seed: int = 0,
               k: int = REPEATS, batch: int = 1):
    self.m, self.k, self.capacity, self.depth, self.batch = m, k, capacity, depth, batch
    self.rng = np.random.RandomState(seed)
    self.holder = [filled_cache(m, batch, capacity, depth, self.rng)]
    self.tokens: dict[int, jax.Array] = {}
    self.warm: set[tuple[int, SamplingParams]] = set()

  def times(self, ns: Sequence[int], reps: int = 1,
            sp: SamplingParams = SamplingParams()) -> dict[int, timing.Timing]:
    """Per-forward timings for each n (a new (n, sp) compiles on first use)."""
    kvc.check_capacity([self.depth], max(ns), self.capacity)
    out = {}
    for n in sorted(set(ns)):
      if n not in self.tokens:
        self.tokens[n] = random_tokens(self.rng, self.m.cfg.vocab_size, self.batch, n)
      key = jax.random.PRNGKey(n)

      def run(tokens=self.tokens[n], key=key):
        acc, self.holder[0] = _repeat_forward(self.m.params, tokens, self.holder[0], key,
                                              cfg=self.m.cfg, k=self.k, sp=sp)
        return acc

      first = (n, sp) not in self.warm
      self.warm.add((n, sp))
      t = timing.measure(run, reps=reps, warmup=1 if first else 0)
      out[n] = dataclasses.replace(t, times=[x / self.k for x in t.times])
    return out


@functools.partial(jax.jit, static_argnames=("sc", "k"))
def _repeat_propose(dparams, dstate, tail, n, key, *, sc, k: int):
  """k proposals (batch of n's rows) on device; each iteration's lengths
  differ (n - i % 2), so XLA cannot hoist the proposal out of the loop."""
  live = jnp.ones(n.shape, bool)

  def body(i, acc):
    d, _, _ = sc.drafter.propose(dparams, dstate, None, tail, n - i % 2, live,
                                 jax.random.fold_in(key, i), sc)
    return acc + jnp.sum(d.tokens) + jnp.sum(d.n_drafted)

  return jax.lax.fori_loop(0, k, body, jnp.int32(0))


class ProposeProbe:
  """T_draft(1) of a drafter that is not a plain model (n-gram lookup, an
  EAGLE head): the time of one whole proposal of gamma tokens (batch 1, a
  history of `depth` random tokens in `capacity` slots), divided by gamma;
  k proposals per timed repetition in one jitted loop. The same `times`
  interface as CostProbe (n must be 1). `target` (a Runner) is needed by
  drafters whose state starts from the target (eagle's prefill)."""

  def __init__(self, drafter, target_cfg, gamma: int, capacity: int, depth: int, seed: int = 0,
               k: int = REPEATS, target: steps.Runner | None = None):
    self.sc = speculative.SpecConfig(target_cfg, None, gamma, drafter=drafter, simulated=True)
    self.k, self.capacity, self.depth = k, capacity, depth
    rng = np.random.RandomState(seed)
    prompt = rng.randint(0, target_cfg.vocab_size, depth - 1).tolist()
    self.dparams = (drafter.draft_params(target.params, None) if target is not None
                    else drafter.draft_params(None, None))
    self.dstate = self.sc.drafter.init(self.sc, target, self.dparams, [prompt], capacity,
                                       jnp.asarray([prompt[-1]]))
    self.tail = jnp.asarray([[prompt[-1], prompt[-1]]], jnp.int32)
    self.n = jnp.asarray([depth], jnp.int32)
    self.warm = False

  def times(self, ns: Sequence[int], reps: int = 1,
            sp: SamplingParams = SamplingParams()) -> dict[int, timing.Timing]:
    del sp  # a deterministic proposal does not depend on the sampling settings
    if set(ns) != {1}:
      raise ValueError(f"ProposeProbe times T_draft(1) only, asked for {sorted(set(ns))}")
    run = lambda: _repeat_propose(self.dparams, self.dstate, self.tail, self.n,
                                  jax.random.PRNGKey(0),
                                  sc=self.sc, k=self.k)
    t = timing.measure(run, reps=reps, warmup=0 if self.warm else 1)
    self.warm = True
    per = self.k * self.sc.gamma
    return {1: dataclasses.replace(t, times=[x / per for x in t.times])}


def draft_probe(drafter, target: steps.Runner, draft: steps.Runner | None, gamma: int,
                capacity: int, depth: int, batch: int = 1, k: int = REPEATS):
  """The probe of T_draft(1) for a drafter: a CostProbe of the model it runs
  (the draft model, or the target's layer subset), otherwise (ngram, eagle)
  a ProposeProbe of its whole proposal per token, at batch 1."""
  from specjax.drafters import base as drafters  # pylint: disable=import-outside-toplevel
  if isinstance(drafter, (drafters.ModelDrafter, drafters.LayerSkipDrafter)):
    cfg = drafter.draft_config(target.cfg, draft and draft.cfg)
    return CostProbe(steps.Runner(cfg, drafter.draft_params(target.params, draft)), capacity,
                     depth, k=k, batch=batch)
  return ProposeProbe(drafter, target.cfg, gamma, capacity, depth, k=k, target=target)


@functools.partial(jax.jit, static_argnames=("sc", "k"))
def _repeat_accept(key, accept_probs, p, drafted, tail, n, out, *, sc, k: int):
  """k accept phases with their bookkeeping (keep_tokens, commit's length
  arithmetic), on device."""
  b = tail.shape[0]
  live = jnp.ones((b,), bool)

  def body(i, carry):
    acc, out = carry
    j = speculative.accept_phase(jax.random.fold_in(key, i), accept_probs, p, drafted,
                                 tail, n, live, sc)
    out, count, _, kept = speculative.keep_tokens(out, jnp.ones((b,), jnp.int32), ~live,
                                                  j, -1, out.shape[1])
    return acc + jnp.sum(count + kept + j.t_len + j.d_len), out

  return jax.lax.fori_loop(0, k, body, (jnp.int32(0), out))


def accept_cost(sc: speculative.SpecConfig, reps: int, seed: int = 0,
                k: int = REPEATS, batch: int = 1) -> timing.Timing:
  """Time of one accept phase and its bookkeeping (batch `batch`, 1 by
  default) for `sc`'s rule kind, gamma and sampling settings, on random
  distributions; per phase."""
  v, gamma, b = sc.target.vocab_size, sc.gamma, batch
  keys = jax.random.split(jax.random.PRNGKey(seed), 4)
  p = jax.nn.softmax(4 * jax.random.normal(keys[0], (b, gamma + 1, v)), -1)
  q = jax.nn.softmax(4 * jax.random.normal(keys[1], (b, gamma, v)), -1)
  drafted = speculative.Drafted(
      tokens=jax.random.randint(keys[2], (b, gamma), 0, v),
      q=q if sc.needs_q else q[..., :0], n_drafted=jnp.full((b,), gamma, jnp.int32),
      caught_up=jnp.zeros((b,), bool))
  tail, n = jnp.zeros((b, 2), jnp.int32), jnp.full((b,), 8, jnp.int32)
  out = jnp.zeros((b, 4 * (gamma + 1)), jnp.int32)
  probs = jnp.full((gamma,), 0.5)
  run = lambda: _repeat_accept(keys[3], probs, p, drafted, tail, n, out, sc=sc, k=k)
  t = timing.measure(run, reps=max(reps, 5))
  return dataclasses.replace(t, times=[x / k for x in t.times])


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
      "predicted_thread": float(theory.thread_approx_speedup(
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
