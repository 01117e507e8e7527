"""Exact speculative sampling is exact: the emitted tokens follow the target's
own distribution, and the acceptance process follows its exact law.

Two laws are computed here by enumeration over a tiny vocabulary, from the
models' logits and an independent NumPy implementation of temperature, top-k
and top-p (HF's warper rules), never from specjax.model.sampling:
  output law      the target-only distribution of the first W = gamma + 3
                  tokens (W - 1 consecutive pairs are tested): the window
                  holds the first step whole (its bonus token when every
                  draft is accepted, its correction otherwise) and the start
                  of the second step (after a full or a partial acceptance);
  acceptance law  the joint law of (k1, 1[k2 > 0]), the drafts accepted in
                  the first step and whether the second accepts any: it
                  depends on the draft distributions the engine really used,
                  so it also sees a draft that was fed the wrong context
                  (which leaves the output law intact: rejection sampling is
                  exact for any q).
Each is a chi-square goodness-of-fit test; a configuration passes when every
p-value clears 1e-4 divided by the number of tests (Bonferroni). Two pairs
run: a draft that is the target plus noise (acceptance about 0.6: every path
of the first steps is frequent), and the target as its own draft (every step
fully accepted, so the bonus token and the catch-up feed are in every
window).

Mutation checks patch one deliberate bug at a time into the engine; each must
fail the same test with the same seed.
"""

import dataclasses
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from specjax.decode import acceptance
from specjax.decode import chain_step
from specjax.decode import generation
from specjax.decode import speculative
from specjax.drafters import walkers
from specjax.model.sampling import SamplingParams
scipy_stats = pytest.importorskip("scipy.stats")

from lawcheck import *  # noqa: F401,F403  (the laws, the pair fixture, the samplers)



# Every sampling setting at gamma 4; gamma 2 with plain sampling and with
# top-p (the mutations' setting); gamma 1, the shortest path, with plain
# sampling and with both filters (each configuration costs a compile: the
# warpers are per token, so one gamma shows each, and the paths that differ
# with gamma, a full or partial acceptance, are in every window).
CONFIGS = [(name, 4) for name in SAMPLINGS] + [
    ("T1", 2), ("top_p0.8", 2), ("T1", 1), ("top_k4_top_p0.8", 1)]


@pytest.mark.parametrize("name,gamma", CONFIGS)
def test_speculative_sampling_is_exact(pair, name, gamma):
  adjusted, ps = exactness(pair, SAMPLINGS[name], gamma)
  assert adjusted > ALPHA, {k: v for k, v in ps.items() if v * len(ps) <= ALPHA}


def test_exact_at_batch_one_and_in_the_host_loop(pair):
  """One call per row (the batch-1 cache write), and the host loop."""
  sp = SamplingParams(1.0, top_p=0.8)
  target, draft = pair
  ps = pvalues(target, draft, sp, 2, 120, batch=False, seed=100)
  ps.update({f"host {k}": v for k, v in
             pvalues(target, draft, sp, 2, 300, loop="host", seed=7).items()})
  assert min(ps.values()) * len(ps) > ALPHA, ps


def test_the_laws_are_what_the_window_needs(pair):
  """The test windows hold the paths that matter, often enough: the bonus
  token, a step after a full acceptance and one after a partial one."""
  target, draft = pair
  for gamma in GAMMAS:
    for sp in SAMPLINGS.values():
      laws = [exact_laws(target, draft, p, sp, gamma).accept for p in PROMPTS]
      full = min(l[gamma].sum() for l in laws)    # step 1 accepted every draft
      partial = min(l[:gamma].sum() for l in laws)
      assert full > 0.15 and partial > 0.1, (gamma, sp, full, partial)

# ---------------------------------------------------------------- mutations


def _bonus_from_residual(orig):
  return lambda p, q, rejected: orig(p, q, jnp.ones_like(rejected))


def _correction_from_p(orig):
  del orig
  return lambda p, q, rejected: p


def _p_and_q_swapped(orig):
  return lambda u, p_x, q_x: orig(u, q_x, p_x)


def _top_p_on_p_only(orig):
  """The draft samples and is judged without top-p; the target keeps it.
  (The output law survives this one: rejection sampling is exact for any q.
  The acceptance law does not.) walkers.chain draws a network drafter's
  chain, the draft model's included."""
  def chain(feeder, dparams, fst, root, key, sc, depth=None):
    sp = dataclasses.replace(sc.sp, top_p=1.0)
    return orig(feeder, dparams, fst, root, key, dataclasses.replace(sc, sp=sp), depth)
  return chain


def _draft_not_fed_after_full_acceptance(orig):
  """The bookkeeping claims the draft saw d_gamma: the catch-up never runs."""
  def accept_phase(*args):
    j = orig(*args)
    return j.replace(d_len=j.t_len)
  return accept_phase


MUTATIONS = {
    "bonus token drawn from the residual": (acceptance, "target_token_dist", _bonus_from_residual),
    "correction drawn from p, not the residual": (acceptance, "target_token_dist",
                                                  _correction_from_p),
    "acceptance test with p and q swapped": (acceptance, "exact_accepts", _p_and_q_swapped),
    "top-p applied to p only": (walkers, "chain", _top_p_on_p_only),
    "draft cache not fed after a fully accepted step": (chain_step, "accept_phase",
                                                        _draft_not_fed_after_full_acceptance),
}
MUTATION_SETTING = ("top_p0.8", 2)  # one of the configurations above, same seed


@pytest.mark.parametrize("bug", list(MUTATIONS))
def test_each_deliberate_bug_fails_the_same_test(pair, monkeypatch, bug):
  module, name, make = MUTATIONS[bug]
  name_sp, gamma = MUTATION_SETTING
  jax.clear_caches()
  monkeypatch.setattr(module, name, make(getattr(module, name)))
  try:
    adjusted, ps = exactness(pair, SAMPLINGS[name_sp], gamma)
  finally:
    monkeypatch.undo()
    jax.clear_caches()
  worst = min(ps, key=ps.get)
  print(f"MUTATION | {bug} | adjusted p {adjusted:.3g} | worst: {worst} ({ps[worst]:.3g})")
  assert adjusted < ALPHA, ps

# ---------------------------------------------------------------- capacity



def run_to_capacity(target, loop, capacity=None):
  """Rows of equal prompt length, some finishing a step before others (a
  Bernoulli rule, the target as its own draft), in a cache of exactly the
  planned capacity: a finished row's last ride-along write ends in its last
  slot."""
  prompts = [[1, 2, 3, 4], [5, 0, 2, 1], [3, 3, 1, 0], [4, 1, 5, 2]]
  n_predict, gamma = 17, 4
  cap = generation.plan_capacity(target.cfg, 4, n_predict, extra=gamma, ctx_size=4 + n_predict)
  res = speculative.generate(target, target, prompts, n_predict, gamma, rule="bernoulli:0.5",
                             seed=3, loop=loop, capacity=capacity or cap, keep_state=True)
  return prompts, res, cap, n_predict


def cache_mismatches(target, prompts, res) -> list[str]:
  """Rows whose final caches differ from a full forward over what they kept."""
  bad = []
  st = res.state
  for b, (prompt, toks) in enumerate(zip(prompts, res.tokens)):
    seq = prompt + toks[:-1]  # the last kept token is the next step's input
    ref = full_forward_kv(target, seq)
    for name, cache in (("target", st.tcache), ("draft", st.dcache)):
      n = int(cache.lengths[b])
      if not len(seq) - 1 <= n <= len(seq):  # the draft may lack d_gamma
        bad.append(f"row {b} {name}: length {n}, kept {len(seq)}")
        continue
      for layer in range(target.cfg.n_layers):
        for got, want in ((cache.k[layer], ref.k[layer]), (cache.v[layer], ref.v[layer])):
          if not np.allclose(got[b, :, :n], want[0, :, :n], atol=1e-5):  # [B, K, S, D]
            bad.append(f"row {b} {name} layer {layer}")
  return bad


@pytest.mark.parametrize("loop", ["device", "host"])
def test_generation_ends_exactly_at_capacity_and_the_caches_hold_the_output(pair, loop):
  """The host loop raises no false overflow for the finished rows either."""
  target, _ = pair
  prompts, res, cap, n_predict = run_to_capacity(target, loop)
  assert res.tokens == generation.generate(target, prompts, n_predict).tokens
  # A row finished with all its n_predict tokens kept, then rode along: its
  # verify wrote the last slot of the cache.
  steps = res.records.steps_per_row()
  t_len = np.asarray(res.state.tcache.lengths)
  rode = (steps < steps.max()) & (t_len + 4 + 1 == cap)
  assert rode.any(), (steps, t_len, cap)
  assert not cache_mismatches(target, prompts, res)


def test_a_clamped_write_is_detected(pair, monkeypatch):
  """The same run with one slot less and the capacity checks bypassed: XLA
  clamps the overflowing write, and the cache comparison sees it."""
  target, _ = pair
  monkeypatch.setattr(speculative.generation, "plan_capacity",
                      lambda cfg, p, n, extra=0, **kw: p + n + extra - 1)
  prompts, res, _, _ = run_to_capacity(target, "device")
  assert cache_mismatches(target, prompts, res)
