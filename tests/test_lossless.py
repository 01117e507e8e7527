"""Exact speculative sampling is exact: the emitted tokens follow the target's
own distribution, and the acceptance process follows its exact law.

Two laws are computed here by enumeration over a tiny vocabulary, from the
models' logits and an independent NumPy implementation of temperature, top-k
and top-p (HF's warper rules), never from specjax.sampling:
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
import itertools
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from specjax import acceptance, config, generation, model, speculative, steps
from specjax.sampling import SamplingParams

scipy_stats = pytest.importorskip("scipy.stats")

V = 6
PROMPTS = [[1, 2], [3, 0, 5], [2, 4, 1, 0, 3]]  # a ragged batch of three rows
ROWS = 1500           # rows per prompt in the batch (tiled: 3 x ROWS rows)
ALPHA = 1e-4          # family-wise level of one configuration
TIE = 1e-6            # float32 rounding of a cumulative probability, generously
GAMMAS = (1, 2, 4)
SAMPLINGS = {
    "T1": SamplingParams(1.0),
    "T0.7": SamplingParams(0.7),
    "top_k3": SamplingParams(1.0, top_k=3),
    "top_p0.8": SamplingParams(1.0, top_p=0.8),
    "top_k4_top_p0.8": SamplingParams(0.7, top_k=4, top_p=0.8),
}


def _sharpen(m: steps.Runner, factor: float) -> steps.Runner:
  params = dict(m.params)
  params["lm_head"] = {"kernel": m.params["lm_head"]["kernel"] * factor}
  return steps.Runner(m.cfg, params)


def _perturbed(m: steps.Runner, scale: float, seed: int) -> steps.Runner:
  leaves, tree = jax.tree_util.tree_flatten(m.params)
  keys = jax.random.split(jax.random.PRNGKey(seed), len(leaves))
  noisy = [x + scale * jnp.std(x) * jax.random.normal(k, x.shape) for x, k in zip(leaves, keys)]
  return steps.Runner(m.cfg, jax.tree_util.tree_unflatten(tree, noisy))


@pytest.fixture(scope="module")
def pair():
  cfg = config.ModelConfig(name="v6", vocab_size=V, dim=32, n_layers=1, n_heads=2,
                           n_kv_heads=1, ffn_dim=64, max_seq_len=32)
  target = _sharpen(steps.Runner(cfg, model.init_params(cfg, 11)), 4.0)
  return target, _perturbed(target, 0.6, 12)

# ---------------------------------------------------------------- reference


def warp(logits: np.ndarray, sp: SamplingParams, tie_shift: float = 0.0) -> np.ndarray:
  """HF's TemperatureLogitsWarper, TopKLogitsWarper and TopPLogitsWarper, in
  that order, then softmax (float64). `tie_shift` moves the top-p boundary:
  with it, a test checks that tokens sitting within float32 rounding of the
  boundary (some of the 10^5 distributions have them) do not matter."""
  x = logits.astype(np.float64) / sp.temperature
  if sp.top_k:
    kth = np.sort(x, -1)[..., -sp.top_k][..., None]
    x = np.where(x < kth, -np.inf, x)
  if sp.top_p < 1.0:
    order = np.argsort(x, -1)  # ascending
    p_sorted = np.take_along_axis(_softmax(x), order, -1)
    cum = np.cumsum(p_sorted, -1)
    drop_sorted = cum <= 1 - sp.top_p + tie_shift
    drop_sorted[..., -1] = False  # min_tokens_to_keep = 1
    drop = np.zeros_like(drop_sorted)
    np.put_along_axis(drop, order, drop_sorted, -1)
    x = np.where(drop, -np.inf, x)
  return _softmax(x)


def _softmax(x):
  e = np.exp(x - np.max(x, -1, keepdims=True))
  return e / e.sum(-1, keepdims=True)


_LOGITS: dict = {}
N_MAX = max(GAMMAS) + 2  # the longest continuation any window needs


def next_token_logits(m: steps.Runner, prompt: list[int], n: int) -> list[np.ndarray]:
  """[L_0, ..., L_n]: L_j [V^j, V] the logits of the token after the prompt
  and each of the V^j continuations of length j (lexicographic order), from
  one full forward over all V^N_MAX continuations (memoised per model)."""
  key = (id(m.params), tuple(prompt))
  if key not in _LOGITS:
    seqs = np.array(list(itertools.product(range(V), repeat=N_MAX)), np.int32)
    toks = jnp.asarray(np.concatenate([np.tile(prompt, (len(seqs), 1)), seqs], 1))
    cache = m.new_cache(len(seqs), toks.shape[1])
    logits = np.asarray(steps.forward_step(m.params, toks, cache, cfg=m.cfg)[0])
    at = logits[:, len(prompt) - 1:]  # [V^N_MAX, N_MAX + 1, V]
    _LOGITS[key] = [at[::V ** (N_MAX - j), j] for j in range(N_MAX + 1)]
  return _LOGITS[key][:n + 1]


@dataclasses.dataclass
class Laws:
  pairs: list[np.ndarray]  # [W - 1] x [V, V]: P(t_i, t_{i+1})
  accept: np.ndarray       # [gamma + 1, 2]: P(k1 = j, 1[k2 > 0] = b)


def exact_laws(target, draft, prompt, sp: SamplingParams, gamma: int,
               tie_shift: float = 0.0) -> Laws:
  w = gamma + 3
  p = [warp(x, sp, tie_shift) for x in next_token_logits(target, prompt, w - 1)]
  q = [warp(x, sp, tie_shift) for x in next_token_logits(draft, prompt, w - 1)]
  joint = p[0][0]  # P(t_0 .. t_j) over V^(j+1) prefixes
  pairs = []
  for j in range(1, w):
    nxt = (joint[:, None] * p[j]).reshape(-1)
    pairs.append(nxt.reshape(V ** (j - 1), V, V).sum(0))
    joint = nxt
  # Acceptance: mass of prefixes t_0 d_1..d_j whose drafts were all accepted.
  overlap = [np.minimum(a, b) for a, b in zip(p, q)]
  mass = p[0][0]  # prefixes of length 1 (t_0)
  accept = np.zeros((gamma + 1, 2))
  for j in range(gamma + 1):
    length = j + 1
    resid = np.maximum(p[length] - q[length], 0.0) if j < gamma else p[length]
    s1 = (mass[:, None] * resid).reshape(-1)          # the step's last token y
    beta = overlap[length + 1].sum(-1)                 # P(k2 > 0 | s1)
    accept[j] = [(s1 * (1 - beta)).sum(), (s1 * beta).sum()]
    mass = (mass[:, None] * overlap[length]).reshape(-1)
  np.testing.assert_allclose(accept.sum(), 1.0, atol=1e-9)
  return Laws(pairs, accept)

# ---------------------------------------------------------------- the test


def chi2_pvalue(counts: np.ndarray, probs: np.ndarray) -> float:
  """Pearson's chi-square of counts against probs; cells expecting < 5 are
  pooled. A count where the law puts no mass at all gives p = 0."""
  counts, probs = counts.ravel().astype(float), probs.ravel() / probs.sum()
  n = counts.sum()
  if np.any(counts[probs <= 1e-12] > 0):
    return 0.0
  exp = probs * n
  keep = exp >= 5
  obs, ex = list(counts[keep]), list(exp[keep])
  if exp[~keep].sum() >= 5:
    obs.append(counts[~keep].sum())
    ex.append(exp[~keep].sum())
  elif ex:  # a small remainder joins the smallest cell
    i = int(np.argmin(ex))
    obs[i] += counts[~keep].sum()
    ex[i] += exp[~keep].sum()
  if len(ex) < 2:
    return 1.0
  return float(scipy_stats.chisquare(obs, ex).pvalue)


def sample(target, draft, sp, gamma, rows, loop="device", batch=True, seed=0, drafter="model"):
  """Windows [R, W] and (k1, k2) [R, 2] of speculative generation from every
  prompt, rows of each prompt in one ragged batch (or one call per row)."""
  w = gamma + 3
  kw = dict(sp=sp, loop=loop, drafter=drafter)
  if batch:
    prompts = [p for p in PROMPTS for _ in range(rows)]
    res = [speculative.generate(target, draft, prompts, w, gamma, seed=seed, **kw)]
  else:
    prompts = [p for p in PROMPTS for _ in range(rows)]
    res = [speculative.generate(target, draft, [p], w, gamma, seed=seed + i, **kw)
           for i, p in enumerate(prompts)]
  tokens = np.array([t for r in res for t in r.tokens])
  # Every row is live in the first two steps (the window is longer).
  ks = np.concatenate([np.stack([r.records.at_step(0), r.records.at_step(1)], 1) for r in res])
  assert len(ks) == len(tokens)
  return tokens, ks, np.array([PROMPTS.index(p) for p in prompts])


def pvalues(target, draft, sp, gamma, rows, accept_law=None, **kw) -> dict[str, float]:
  """Every p-value of one configuration (per prompt: each pair, acceptance).

  `draft` is the model whose q the acceptance law uses (and the draft of the
  `model` drafter); `accept_law(prompt, sp, gamma)` replaces that law (a
  drafter without a draft model: tests/test_drafters.py)."""
  tokens, ks, which = sample(target, draft, sp, gamma, rows, **kw)
  out = {}
  for i, prompt in enumerate(PROMPTS):
    laws = exact_laws(target, draft, prompt, sp, gamma)
    if sp.top_p < 1:  # near-ties at the top-p boundary move no tested cell visibly
      for shift in (-TIE, TIE):
        other = exact_laws(target, draft, prompt, sp, gamma, shift)
        for a, b in zip(laws.pairs + [laws.accept], other.pairs + [other.accept]):
          assert np.max(np.abs(a - b)) < 1e-3, "the reference law depends on rounding"
    if accept_law is not None:
      laws.accept = accept_law(prompt, sp, gamma)
    t, k = tokens[which == i], ks[which == i]
    for j, law in enumerate(laws.pairs):
      counts = np.bincount(t[:, j] * V + t[:, j + 1], minlength=V * V)
      out[f"prompt {i} pair t{j},t{j + 1}"] = chi2_pvalue(counts, law)
    counts = np.bincount(k[:, 0] * 2 + (k[:, 1] > 0), minlength=2 * (gamma + 1))
    out[f"prompt {i} acceptance"] = chi2_pvalue(counts, laws.accept)
  return out


def exactness(pair_, sp, gamma, **kw) -> tuple[float, dict[str, float]]:
  """(smallest p-value times the number of tests, all p-values) over both
  pairs: the Bonferroni-adjusted p-value of the configuration."""
  target, draft = pair_
  ps = {f"noisy draft, {k}": v for k, v in pvalues(target, draft, sp, gamma, ROWS, **kw).items()}
  ps.update({f"self draft, {k}": v
             for k, v in pvalues(target, target, sp, gamma, ROWS, **kw).items()})
  return min(1.0, min(ps.values()) * len(ps)), ps


# Every sampling setting at gamma 2 and 4; gamma 1, the shortest path, with
# plain sampling and with both filters (each configuration costs a compile).
CONFIGS = [(name, g) for g in (2, 4) for name in SAMPLINGS] + [
    ("T1", 1), ("top_k4_top_p0.8", 1)]


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
  The acceptance law does not.)"""
  def draft_phase(dparams, dcache, tail, n, live, key, sc):
    sp = dataclasses.replace(sc.sp, top_p=1.0)
    return orig(dparams, dcache, tail, n, live, key, dataclasses.replace(sc, sp=sp))
  return draft_phase


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
    "top-p applied to p only": (speculative, "draft_phase", _top_p_on_p_only),
    "draft cache not fed after a fully accepted step": (speculative, "accept_phase",
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


def _full_forward_kv(m: steps.Runner, seq: list[int]):
  cache = m.new_cache(1, len(seq))
  return model.forward(m.params, jnp.asarray([seq]), cache, m.cfg)[1]


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
    ref = _full_forward_kv(target, seq)
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
