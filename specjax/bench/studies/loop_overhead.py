"""The device loop's overhead beyond its phases (experiments/loop_overhead.py,
the GPU check's overhead part): the loop's seconds per step against its
three phases (draft with its catch-up, verify, accept) repeated in one
jitted loop from the same state; their ratio is the while loop, the
bookkeeping, the records and the call itself."""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from specjax.decode import plan, speculative
from specjax.metrics import timing
from specjax.model import kv_cache as kvc
from specjax.model import steps
from specjax.model.sampling import SamplingParams


@functools.partial(jax.jit, static_argnames=("sc", "k"), donate_argnames=("state",))
def _repeat_phases(tparams, dparams, state: speculative.SpecState, key, accept_probs, *,
                   sc: plan.SpecConfig, k: int):
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
    d, dcache, tcache = sc.step.propose(dparams, st.dcache, st.tcache, st.tail, st.n, live,
                                        kd, sc)
    p, tcache, _ = sc.step.verify(tparams, tcache, st.tail, d, sc)
    j = sc.step.judge(ka, accept_probs, p, d, st.tail, st.n, live, sc)
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
  sc = plan.SpecConfig(target.cfg, draft.cfg if draft is not None else None, gamma,
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
