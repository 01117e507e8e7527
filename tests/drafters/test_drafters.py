"""Drafters beyond a second model (specjax/drafters/): n-gram lookup and
layer-skip self-speculation in the same fixed-shape loop, greedy-exact,
their caches equal to a full forward, and lossless (tests/lawcheck.py's
output and acceptance laws at T = 1, the acceptance law from the drafts the
drafter must propose); deliberate bugs in each drafter that must fail one
of these; the spec parser."""


import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from specjax.model import config
from specjax.drafters import base as drafter_base
from specjax.drafters import draft_model, network, ngram, registry
from specjax.decode import adaptive
from specjax.decode import generation
from specjax.decode import plan
from specjax.decode import speculative
from specjax.model import steps
from specjax.errors import ConfigError
from specjax.model.sampling import SamplingParams
from specjax.metrics.timing import CompileWatch

import lawcheck as lossless

# The tiny preset with three layers: a prefix (layerskip:2) and a list that
# skips the middle layer (layerskip:0,2).
CFG3 = config.get_preset("tiny").replace(name="tiny3", n_layers=3)
DRAFTERS = ("ngram", "layerskip:2", "layerskip:0,2")
PROMPTS = [[5, 17, 42, 9, 100, 5, 17], [7, 7, 7], [200, 1, 64, 3, 9, 81, 27, 2, 64, 3]]
N = 30


@pytest.fixture(scope="module")
def target(init_params):
  """Peaked distributions (random init is flat): greedy output repeats, so
  the n-gram drafter finds matches, and the layer subsets agree often."""
  params = dict(init_params(CFG3, 1))
  params["lm_head"] = {"kernel": params["lm_head"]["kernel"] * 40.0}
  return steps.Runner(CFG3, params)


@pytest.fixture(scope="module")
def base(target):
  """Greedy target-only output per prompt."""
  return [generation.generate(target, [p], N).tokens[0] for p in PROMPTS]


# ---------------------------------------------------------------- greedy == target-only
# Each (drafter, gamma, batch, loop) compiles a loop (~5 s of CPU): the
# ragged batch at gamma 4, batch one at gamma 1, the host loop once for each
# new path of state through it (the n-gram history, the shared cache).


_SUB: dict = {}


def sub_runner(target, layers) -> steps.Runner:
  """The target's listed layers as a model of their own, built here (not by
  the drafter's draft_params): the reference a layer-skip draft must match.
  Memoised, so lawcheck's enumeration (keyed by the params) runs once."""
  key = (id(target.params), tuple(layers))
  if key not in _SUB:
    params = {k: v for k, v in dict(target.params).items() if not k.startswith("layers_")}
    params.update({f"layers_{i}": target.params[f"layers_{l}"] for i, l in enumerate(layers)})
    _SUB[key] = (target, steps.Runner(target.cfg.replace(n_layers=len(layers)), params))
  return _SUB[key][1]


def mismatches(target, prompts, drafter, base=None, n=N, sp=SamplingParams()):
  """(stats, what differs) after a ragged batch at gamma 4: the tokens from
  `base` (greedy target-only), the target's cache from a full forward over
  the output (whatever a drafter wrote into it, layerskip:N's shared layers,
  must have been rewritten) and, for a drafter with a cache of its own (a
  layer list), that cache from a full forward of its layers (it may lack the
  last kept token's predecessor d_gamma after a fully accepted step; its
  slot is not compared: a row that finished on such a step and then rode
  along holds its `last` there, with length n-1 all the same)."""
  res = speculative.generate(target, None, prompts, n, 4, sp=sp, drafter=drafter,
                             keep_state=True)
  if base is not None and res.tokens != base:
    return res.stats, ["tokens"]
  bad = []
  d = registry.parse(drafter)
  caches = [("target", res.state.tcache, target)]
  if isinstance(d, draft_model.LayerSkipDrafter) and not d.prefix:
    caches.append(("draft", res.state.dcache, sub_runner(target, d.layers)))
  seqs = [prompt + out[:-1] for prompt, out in zip(prompts, res.tokens)]  # the last token
  width = max(map(len, seqs))                             # is the next verify's input
  padded = jnp.asarray([seq + [0] * (width - len(seq)) for seq in seqs])
  for name, cache, m in caches:  # one causal pass over the rows, right-padded
    ref = steps.forward_step(m.params, padded, m.new_cache(len(seqs), width), cfg=m.cfg)[1]
    for b, seq in enumerate(seqs):
      k = int(cache.lengths[b])
      if not (k == len(seq) if name == "target" else len(seq) - 1 <= k <= len(seq)):
        bad.append(f"row {b} {name}: length {k}, kept {len(seq)}")
        continue
      k = k if name == "target" else min(k, len(seq) - 1)
      for layer in range(m.cfg.n_layers):
        for got, want in ((cache.k[layer], ref.k[layer]), (cache.v[layer], ref.v[layer])):
          if not np.allclose(got[b, :, :k], want[b, :, :k], atol=1e-5):  # [B, K, S, D]
            bad.append(f"row {b} {name} layer {layer}")
  return res.stats, bad


@pytest.mark.parametrize("drafter", DRAFTERS)
def test_greedy_ragged_batch_equals_target_only(target, base, drafter):
  """... and the caches hold the output (mismatches)."""
  st, bad = mismatches(target, PROMPTS, drafter, base)
  assert not bad, bad
  assert 0 < st.n_accept < st.n_drafted <= 4 * st.n_steps  # the drafts are real guesses
  if drafter == "ngram":
    assert st.n_drafted < 4 * st.n_steps  # some steps found no match or a short one


def test_a_list_catches_up_and_its_cache_holds_the_output(v6):
  """layerskip:0,2 sampled on the V = 6 model, where fully accepted steps
  are frequent (on the tiny one they never happen): its own cache is fed
  d_gamma before the next draft, and ends equal to a full forward."""
  prompts = [p for p in lossless.PROMPTS for _ in range(2)]
  st, bad = mismatches(v6, prompts, "layerskip:0,2", n=12, sp=SamplingParams(1.0))
  assert not bad, bad
  assert st.n_catchup >= 3, st


# (layerskip:0,2 runs the draft model's own-cache path: the ragged test covers it here)
@pytest.mark.parametrize("drafter", ["ngram", "layerskip:2"])
def test_greedy_batch_one_compiles_once(target, base, drafter):
  """gamma 1, one row at a time: prompts of one bucket and other seeds share
  one compilation per (drafter, gamma); a re-parsed spec is the same program."""
  runs = [(prompt, want, seed) for seed in (0, 1) for prompt, want in zip(PROMPTS, base)]
  for i, (prompt, want, seed) in enumerate(runs):
    spec = drafter if i % 2 else registry.parse(drafter).spec
    with CompileWatch() as cw:
      res = speculative.generate(target, None, [prompt], N, 1, drafter=spec, seed=seed)
    assert res.tokens == [want]
    assert cw.names["spec_loop"] == (1 if i == 0 else 0), (i, cw.names)
  assert res.stats.n_accept > 0


@pytest.mark.parametrize("drafter", ["layerskip:2"])  # the target cache through draft_jit
def test_greedy_host_loop(target, base, drafter):
  host = speculative.generate(target, None, PROMPTS, N, 4, drafter=drafter, loop="host")
  dev = speculative.generate(target, None, PROMPTS, N, 4, drafter=drafter)
  assert host.tokens == base
  assert host.records.n_drafted.tolist() == dev.records.n_drafted.tolist()
  assert host.records.n_acc.tolist() == dev.records.n_acc.tolist()


def test_layerskip_with_every_layer_is_the_target(target):
  """All layers kept (a list that is the target's): every draft accepted when
  sampling; the shared cache needs no catch-up."""
  assert registry.parse("layerskip:0-2") == registry.parse("layerskip:3")
  res = speculative.generate(target, None, [PROMPTS[0]], N, 4, sp=SamplingParams(1.0), seed=3,
                             drafter="layerskip:0-2")
  st = res.stats
  assert st.n_accept == st.n_drafted == 4 * st.n_steps, st
  assert st.n_catchup == 0

def test_shared_prefix_drafts_what_its_own_cache_would(target):
  """layerskip:2 on the target's cache proposes the q that the same two layers
  give from a cache of their own prefilled with the sequence (a draft reading
  the wrong slots of the shared cache changes q, and only the acceptance law,
  which the chi-square test sees weakly)."""
  prompt = PROMPTS[0]
  res = speculative.generate(target, None, [prompt], 13, 4, drafter="layerskip:2",
                             keep_state=True)
  st = res.state
  sc = plan.SpecConfig(target.cfg, None, 4, SamplingParams(1.0), drafter="layerskip:2")
  dparams = sc.drafter.draft_params(target.params, None)
  live, key = jnp.ones((1,), bool), jax.random.PRNGKey(7)
  got = jax.jit(lambda tc: sc.drafter.propose(dparams, (), tc, st.tail, st.n, live, key,
                                              sc)[0])(st.tcache)
  sub = sub_runner(target, sc.drafter.layers)  # the two layers, not through draft_params
  own = sub.prefill([prompt + res.tokens[0][:-1]], sub.new_cache(1, st.tcache.capacity))[1]
  sc_own = plan.SpecConfig(target.cfg, sub.cfg, 4, SamplingParams(1.0), drafter="model")
  want = jax.jit(lambda c: draft_model.MODEL.propose(sub.params, c, None, st.tail, st.n, live,
                                                     key, sc_own)[0])(own)
  assert not bool(want.caught_up[0])
  np.testing.assert_allclose(got.q, want.q, atol=1e-4)


# ---------------------------------------------------------------- n-gram lookup


_ngram_jit = jax.jit(ngram.ngram_propose, static_argnums=(2, 3, 4))


def _propose(hist, n, gamma, n_min=1, n_max=3):
  """(proposed tokens, all gamma token slots) for one history padded to 16."""
  hist = jnp.asarray([hist + [0] * (16 - len(hist))], jnp.int32)
  tokens, n_drafted = _ngram_jit(hist, jnp.asarray([n]), gamma, n_min, n_max)
  return tokens[0, :int(n_drafted[0])].tolist(), tokens[0].tolist()


def test_ngram_proposes_the_continuation_of_the_latest_longest_match():
  # the 3-gram [1, 2, 3] occurred at 0: its continuation
  assert _propose([1, 2, 3, 4, 5, 9, 1, 2, 3], 9, 4)[0] == [4, 5, 9, 1]
  # a longer match wins over a later shorter one ([7] last seen at 4)
  assert _propose([5, 6, 7, 9, 7, 1, 5, 6, 7], 9, 4)[0] == [9, 7, 1, 5]
  # the latest occurrence wins; the continuation stops at the end of history
  assert _propose([1, 2, 1, 3, 1], 5, 4)[0] == [3, 1]
  assert _propose([7, 8, 7], 3, 4)[0] == [8, 7]
  # n_min: a 1-gram match is not enough for ngram:2-3
  assert _propose([1, 2, 1, 3, 1], 5, 4, 2, 3)[0] == []
  # nothing repeats: nothing proposed (tokens 0)
  assert _propose([1, 2, 3, 4], 4, 4) == ([], [0, 0, 0, 0])
  # slots past the row's length are not history (a stale match there is ignored)
  assert _propose([3, 4, 5, 6, 4, 5], 4, 4) == ([], [0, 0, 0, 0])


def test_ngram_without_a_match_still_emits_the_target_token(target):
  """A step that proposed nothing accepts nothing and emits the target's own
  token: greedy, its argmax; sampled, a draw from p (not from a residual)."""
  candidates = ([10, 11, 12, 13], [20, 21, 22, 23], [30, 31, 32, 33])
  outs = [generation.generate(target, [p], N).tokens[0] for p in candidates]
  prompt, want = next((p, o) for p, o in zip(candidates, outs) if o[0] not in p)
  res = speculative.generate(target, None, [prompt], N, 1, drafter="ngram")
  assert res.records.at_step(0, "n_drafted").tolist() == [0]
  assert res.records.at_step(0, "n_acc").tolist() == [0]
  assert res.tokens == [want]
  # the accept phase alone: drafts of token 5 at every position, none drafted;
  # p at position 0 is half 5, half 3
  b, gamma, v = 4000, 3, 8
  p = jnp.zeros((b, gamma + 1, v)).at[:, :, 5].set(1.0).at[:, 0].set(
      jnp.zeros(v).at[5].set(0.5).at[3].set(0.5))
  sc = plan.SpecConfig(target.cfg, None, gamma, SamplingParams(1.0), drafter="ngram")
  d = drafter_base.Drafted(tokens=jnp.full((b, gamma), 5), q=jnp.zeros((b, gamma, 0)),
                       n_drafted=jnp.zeros((b,), jnp.int32), caught_up=jnp.zeros((b,), bool))
  j = speculative.accept_jit(jax.random.PRNGKey(0), jnp.ones((gamma,)), p, d,
                             jnp.zeros((b, 2), jnp.int32), jnp.full((b,), 9),
                             jnp.ones((b,), bool), sc=sc)
  assert int(jnp.max(j.n_acc)) == 0
  share = float(jnp.mean(j.emitted[:, 0] == 5))
  assert abs(share - 0.5) < 0.05, share  # a residual max(0, p - onehot(5)) never gives 5

# ---------------------------------------------------------------- lossless at temperature 1


def _ref_ngram(hist, gamma, n_min, n_max):
  """Prompt lookup, plainly: the latest earlier match of the longest n-gram."""
  n = len(hist)
  for m in range(n_max, n_min - 1, -1):
    for j in range(n - m - 1, -1, -1):
      if hist[j:j + m] == hist[n - m:]:
        return hist[j + m:j + m + gamma]
  return []


def ngram_accept_law(target, drafter: ngram.NgramDrafter):
  """The law of (k1, 1[k2 > 0]) under n-gram drafting, by enumeration: a
  drafted x is accepted with probability p(x), a rejection draws from p less
  x; the second step drafts from the history the first one left."""
  def law(prompt, sp, gamma):
    p = [lossless.warp(x, sp) for x in lossless.next_token_logits(target, prompt, gamma + 2)]
    at = lambda cont: p[len(cont)][sum(t * lossless.V ** i for i, t in enumerate(cont[::-1]))]
    out = np.zeros((gamma + 1, 2))
    for t0 in range(lossless.V):
      drafts = _ref_ngram(prompt + [t0], gamma, drafter.n_min, drafter.n_max)
      mass = at([])[t0]
      for j in range(len(drafts) + 1):
        pj = at([t0] + drafts[:j])
        if j < len(drafts):
          resid = pj.copy()
          resid[drafts[j]] = 0.0
          y_law = mass * (resid / resid.sum() if resid.sum() > 0 else pj)
          y_law *= 1 - pj[drafts[j]]
        else:
          y_law = mass * pj
        for y in range(lossless.V):
          nxt = _ref_ngram(prompt + [t0] + drafts[:j] + [y], gamma, drafter.n_min,
                           drafter.n_max)
          beta = at([t0] + drafts[:j] + [y])[nxt[0]] if nxt else 0.0
          out[j] += [y_law[y] * (1 - beta), y_law[y] * beta]
        if j < len(drafts):
          mass *= pj[drafts[j]]
    np.testing.assert_allclose(out.sum(), 1.0, atol=1e-9)
    return out
  return law


@pytest.fixture(scope="module")
def v6(init_params):
  """The lossless test's vocabulary of 6, three layers whose kernels are
  doubled (at init the layers barely move the residual stream, and any layer
  subset drafts like the whole model): the one-layer draft then accepts all
  4 drafts in 53-64% of first steps and none in 10-15%."""
  cfg = config.ModelConfig(name="v6x3", vocab_size=lossless.V, dim=32, n_layers=3, n_heads=2,
                           n_kv_heads=1, ffn_dim=64, max_seq_len=32)
  params = {k: jax.tree_util.tree_map(lambda x: 2 * x if x.ndim == 2 else x, v)
               if k.startswith("layers_") else v for k, v in init_params(cfg, 11).items()}
  return lossless.sharpen(steps.Runner(cfg, params), 4.0)


def lossless_pvalues(v6, spec, gamma, seed=0):
  d = registry.parse(spec)
  sp = SamplingParams(1.0)
  if isinstance(d, ngram.NgramDrafter):
    return lossless.pvalues(v6, v6, sp, gamma, lossless.ROWS, drafter=d, seed=seed,
                            accept_law=ngram_accept_law(v6, d))
  return lossless.pvalues(v6, sub_runner(v6, d.layers), sp, gamma, lossless.ROWS,
                          drafter=d, seed=seed)


# The listed (own-cache) layer-skip draft runs the draft model's path, which
# tests/test_lossless.py covers; the shared-cache prefix is new.
@pytest.mark.parametrize("spec,gamma", [("ngram:1-2", 4), ("layerskip:1", 4)])
def test_lossless_at_temperature_one(v6, spec, gamma):
  ps = lossless_pvalues(v6, spec, gamma)
  assert min(ps.values()) * len(ps) > lossless.ALPHA, {
      k: v for k, v in ps.items() if v * len(ps) <= lossless.ALPHA}


def test_ngram_law_sees_matches_and_misses(v6):
  """The tested window holds both kinds of first step, often enough."""
  d = registry.parse("ngram:1-2")
  drafted = [len(_ref_ngram(p + [t], 4, 1, 2)) > 0 for p in lossless.PROMPTS
             for t in range(lossless.V)]
  assert 0.2 < np.mean(drafted) < 0.8, drafted
  for prompt in lossless.PROMPTS:  # accepted drafts in either step: > 45 of 1500 rows expected
    law = ngram_accept_law(v6, d)(prompt, SamplingParams(1.0), 4)
    assert law[1:].sum() > 0.03 and law[:, 1].sum() > 0.03, law

def test_the_general_law_with_onehot_drafts_is_the_ngram_law(v6):
  """lawcheck.acceptance_law, given onehot rows (the n-gram drafts: of the
  step's starting history in the first step, of the kept one for the next
  step's first draft) and zero rows where nothing is drafted, is the law
  ngram_accept_law enumerates path by path: the generalisation the EAGLE
  law rests on."""
  d, sp, gamma, v = ngram.NgramDrafter(1, 2), SamplingParams(1.0), 4, lossless.V
  conts = lambda j: [list(c) for c in itertools.product(range(v), repeat=j)]  # lexicographic
  onehot = lambda drafts, i: np.eye(v)[drafts[i]] if len(drafts) > i else np.zeros(v)
  for prompt in lossless.PROMPTS:
    p = [lossless.warp(x, sp) for x in lossless.next_token_logits(v6, prompt, gamma + 2)]
    first = [_ref_ngram(prompt + [t], gamma, d.n_min, d.n_max) for t in range(v)]
    q_draft = [None] + [np.stack([onehot(first[c[0]], j - 1) for c in conts(j)])
                        for j in range(1, gamma + 1)]
    q_next = [None, None] + [
        np.stack([onehot(_ref_ngram(prompt + c, gamma, d.n_min, d.n_max), 0) for c in conts(j)])
        for j in range(2, gamma + 3)]
    law = lossless.acceptance_law(p, q_draft, q_next, gamma, by_first=True)
    np.testing.assert_allclose(law.sum(0), ngram_accept_law(v6, d)(prompt, sp, gamma),
                               atol=1e-12)

# ---------------------------------------------------------------- specs


def test_specs_parse_to_static_hashable_drafters():
  assert registry.parse("model") is draft_model.MODEL
  assert registry.parse("ngram") == ngram.NgramDrafter(*registry.NGRAM_DEFAULT)
  assert registry.parse("ngram:2-5") == ngram.NgramDrafter(2, 5)
  assert registry.parse("ngram:3") == ngram.NgramDrafter(3, 3)
  assert registry.parse("layerskip:0-3").prefix
  assert registry.parse("layerskip:0-9,12,15").layers == tuple(range(10)) + (12, 15)
  for spec in ("model", "ngram:2-5", "layerskip:4", "layerskip:0-9,12,15", "layerskip:3-3"):
    d = registry.parse(spec)
    assert registry.parse(d.spec) == d and hash(d) == hash(registry.parse(d.spec))


@pytest.mark.parametrize("spec,match", [
    ("medusa", "unknown drafter"), ("ngram:3-1", "ngram_min"),
    ("ngram:0-2", ">= 1"), ("ngram:a", "not an integer"), ("layerskip", "needs N"),
    ("layerskip:0", "at least one"), ("layerskip:2,1", "increasing"),
    ("layerskip:1,1", "increasing"), ("layerskip:3-1", "bad layer range"),
    ("model:x", "no argument")])
def test_bad_specs(spec, match):
  with pytest.raises(ConfigError, match=match):
    registry.parse(spec)


def test_bad_settings_against_the_models(target):
  with pytest.raises(ConfigError, match="out of range"):
    plan.SpecConfig(target.cfg, None, 4, drafter="layerskip:4")
  with pytest.raises(ConfigError, match="out of range"):
    speculative.generate(target, None, [[1, 2]], 4, 2, drafter="layerskip:0,3")
  with pytest.raises(ConfigError, match="needs a draft model"):
    speculative.generate(target, None, [[1, 2]], 4, 2)
  assert plan.SpecConfig(target.cfg, None, 4, drafter="layerskip:3").draft.n_layers == 3


def test_ngram_cost_probe_times_a_proposal(target):
  """probes.ProposeProbe: T_draft(1) of the n-gram drafter (its proposal / gamma)."""
  from specjax.decode import probes
  probe = probes.ProposeProbe(registry.parse("ngram"), target.cfg, 4, 64, 20, k=2)
  t = probe.times([1], reps=2)[1]
  assert len(t.times) == 2 and 0 < t.median < 0.1
  with pytest.raises(ValueError):
    probe.times([2])


def test_auto_gamma_runs_a_model_free_drafter(target, base):
  """The n-gram history does not depend on gamma: chunks of gamma 1 and 4
  continue each other (greedy: target-only tokens); a drafter whose state
  is shaped by the step is refused (the EAGLE heads are not: their pending
  pairs are as wide as the widest candidate's, tests/drafters/test_auto_heads.py)."""
  p = plan.resolve(target.cfg, None, drafter="ngram", gamma="auto", auto_set=(1, 4))
  res = adaptive.generate(target, None, PROMPTS, N, p,
                          adaptive.Fixed(["chain:1", "chain:4", "chain:4", "chain:1"]), every=2)
  assert res.tokens == base and set(res.chosen) == {"chain:1", "chain:4"}
  shaped = type("Shaped", (ngram.NgramDrafter,), {"gamma_free_state": False})
  with pytest.raises(ConfigError, match="shaped by gamma"):
    plan.parse_flags(drafter=shaped(), gamma="auto", auto_set=(1, 4))
  plan.parse_flags(drafter="eagle", gamma="auto", auto_set=(1, 4))

# ---------------------------------------------------------------- mutations
# One-expression bugs in a drafter (lawcheck.mutant), each run through the
# test it must fail with that test's own configuration and seed: the
# acceptance law (tokens stay exact whatever the drafts), greedy equality
# with target-only, or the caches against a full forward.


def _fails_lossless(spec, gamma):
  def check(v6, target, base):
    ps = lossless_pvalues(v6, spec, gamma)
    return min(ps.values()) * len(ps) < lossless.ALPHA, min(ps.items(), key=lambda kv: kv[1])
  return check


def _fails_ragged(spec):
  def check(v6, target, base):
    bad = mismatches(target, PROMPTS, spec, base)[1]
    return bool(bad), bad[:4]
  return check


def _fails_list_cache(v6, target, base):
  prompts = [p for p in lossless.PROMPTS for _ in range(2)]
  bad = mismatches(v6, prompts, "layerskip:0,2", n=12, sp=SamplingParams(1.0))[1]
  return bool(bad), bad[:4]


DRAFTER_MUTATIONS = {
    "layerskip: the layers one past the listed ones": (
        draft_model.LayerSkipDrafter, "draft_params", 'tparams[f"layers_{l}"]',
        'tparams[f"layers_{l + 1}"]', _fails_lossless("layerskip:1", 4)),
    "ngram: the proposal shifted by one position": (
        ngram, "ngram_propose", "start = best_j + best_m ", "start = best_j + best_m + 1 ",
        _fails_lossless("ngram:1-2", 4)),
    "ngram: stale history (commit not applied)": (
        ngram.NgramDrafter, "commit",
        "return jnp.where(c.live[:, None], write(dstate, c.emitted, c.n_prev), dstate)",
        "return dstate", _fails_lossless("ngram:1-2", 4)),
    "ngram: drafting past n_drafted (the slots past the match count)": (
        ngram.NgramDrafter, "propose", "n_drafted=jnp.where(live, n_drafted, 0)",
        "n_drafted=jnp.where(live, sc.gamma, 0)", _fails_lossless("ngram:1-2", 4)),
    "layerskip:N: the draft's lengths kept in the shared cache": (
        draft_model.LayerSkipDrafter, "end", "v=fst.cache.v + tcache.v[k:])",
        "v=fst.cache.v + tcache.v[k:], lengths=fst.cache.lengths)", _fails_ragged("layerskip:2")),
    "layerskip list: the catch-up skipped (its record kept)": (
        network, "catch_up", "jax.lax.cond(jnp.any(behind),",
        "jax.lax.cond(jnp.any(behind) & False,", _fails_list_cache),
}


# draft_params runs on the host before the loop, which takes its output as an
# argument: no compiled program holds it, so its mutation (first, before any
# clear) reuses the loop test_lossless_at_temperature_one compiled; were it
# ever traced, the cached loop would keep the bug out and this case would fail.
UNTRACED = {"layerskip: the layers one past the listed ones"}


@pytest.mark.parametrize("bug", list(DRAFTER_MUTATIONS))
def test_each_deliberate_drafter_bug_fails_its_test(v6, target, base, monkeypatch, bug):
  owner, name, old, new, check = DRAFTER_MUTATIONS[bug]
  traced = bug not in UNTRACED
  if traced:
    jax.clear_caches()
  monkeypatch.setattr(owner, name, lossless.mutant(getattr(owner, name), old, new))
  try:
    failed, detail = check(v6, target, base)
  finally:
    monkeypatch.undo()
    if traced:
      jax.clear_caches()
  print(f"MUTATION | {bug} | {detail}")
  assert failed, detail
