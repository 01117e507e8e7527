"""The speculative engine: losslessness, simulated acceptance, statistics."""

import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from specjax import acceptance, config, generation, model, sampling, speculative, steps, theory
from specjax.errors import ConfigError
from specjax.sampling import SamplingParams

scipy_stats = pytest.importorskip("scipy.stats")


def _perturbed(m: steps.Model, scale: float, seed: int) -> steps.Model:
  """A draft that mostly agrees with the target: its weights plus noise."""
  leaves, tree = jax.tree_util.tree_flatten(m.params)
  keys = jax.random.split(jax.random.PRNGKey(seed), len(leaves))
  noisy = [x + scale * jnp.std(x) * jax.random.normal(k, x.shape) for x, k in zip(leaves, keys)]
  return steps.Model(m.cfg, jax.tree_util.tree_unflatten(tree, noisy))


def _sharpen(m: steps.Model, factor: float) -> steps.Model:
  """Scales the output layer so that distributions are peaked (random init is flat)."""
  params = dict(m.params)
  params["lm_head"] = {"kernel": m.params["lm_head"]["kernel"] * factor}
  return steps.Model(m.cfg, params)


@pytest.fixture(scope="module")
def pair():
  cfg = config.get_preset("tiny")
  target = _sharpen(steps.Model(cfg, model.init_params(cfg, 1)), 40.0)
  return target, _perturbed(target, 0.5, 3)


PROMPTS = [[5, 17, 42, 9, 100], [7, 7, 7], [200, 1, 64, 3, 9, 81, 27, 2]]


@pytest.mark.parametrize("gamma", [1, 3, 8])
@pytest.mark.parametrize("loop", ["device", "host"])
def test_greedy_speculative_equals_greedy_target_only(pair, gamma, loop):
  target, draft = pair
  for prompt in PROMPTS:
    base = generation.generate(target, [prompt], 40).tokens
    res = speculative.generate(target, draft, [prompt], 40, gamma, loop=loop)
    assert res.tokens == base
    st = res.stats
    assert 0 < st.n_accept < st.n_drafted  # the draft really differs
    assert st.n_predict == 40


def test_greedy_batch_with_ragged_prompts_equals_per_row(pair):
  target, draft = pair
  res = speculative.generate(target, draft, PROMPTS, 25, 4)
  for prompt, row in zip(PROMPTS, res.tokens):
    assert row == generation.generate(target, [prompt], 25).tokens[0]


@pytest.mark.parametrize("sp", [SamplingParams(), SamplingParams(1.0), SamplingParams(0.7, top_k=20)])
def test_draft_equal_to_target_accepts_everything(pair, sp):
  target, _ = pair
  res = speculative.generate(target, target, [PROMPTS[0]], 33, 4, sp=sp, seed=5)
  assert res.stats.n_accept == res.stats.n_drafted == 4 * res.stats.n_steps
  assert res.stats.accept_hist[-1] == res.stats.n_steps


def test_device_and_host_loops_agree_when_sampling(pair):
  target, draft = pair
  kw = dict(sp=SamplingParams(0.9, top_p=0.95), seed=21)
  a = speculative.generate(target, draft, PROMPTS, 30, 3, loop="device", **kw)
  b = speculative.generate(target, draft, PROMPTS, 30, 3, loop="host", **kw)
  assert a.tokens == b.tokens
  assert a.stats.accept_hist == b.stats.accept_hist


# ---- exact sampling is lossless: a chi-square test over many rows ----------

V = 8


@pytest.fixture(scope="module")
def small_vocab_pair():
  cfg = config.ModelConfig(name="v8", vocab_size=V, dim=32, n_layers=1, n_heads=2,
                           n_kv_heads=1, ffn_dim=64, max_seq_len=32)
  target = _sharpen(steps.Model(cfg, model.init_params(cfg, 11)), 20.0)
  return target, _perturbed(target, 1.0, 12)


def _target_joint(target, prompt, sp, n=3):
  """Exact P(t1, t2, t3) of target-only sampling, from full forwards."""
  joint = np.zeros((V,) * n)
  for seq in itertools.product(range(V), repeat=n):
    toks = jnp.asarray([prompt + list(seq)])
    cache = target.new_cache(1, toks.shape[1])
    logits, _ = model.forward(target.params, toks, cache, target.cfg)
    p = np.asarray(sampling.probs(logits[0, len(prompt) - 1:-1], sp))
    joint[seq] = np.prod([p[i, t] for i, t in enumerate(seq)])
  return joint


def _chi2_pvalue(samples, joint):
  """Goodness of fit of (t2, t3) samples to the target's marginal."""
  expected_p = joint.sum(0).ravel()  # marginal over t1
  expected_p = expected_p / expected_p.sum()  # f32 rounding
  counts = np.bincount(samples[:, 0] * V + samples[:, 1], minlength=V * V)
  keep = expected_p * len(samples) >= 5
  obs = np.append(counts[keep], counts[~keep].sum())
  exp = np.append(expected_p[keep], expected_p[~keep].sum()) * len(samples)
  if exp[-1] == 0:
    obs, exp = obs[:-1], exp[:-1]
  return scipy_stats.chisquare(obs, exp).pvalue


N_ROWS = 6000
PROMPT = [1, 2, 3]


def _spec_samples(target, draft, sp, gamma=2, seed=0):
  res = speculative.generate(target, draft, [PROMPT] * N_ROWS, 3, gamma, sp=sp, seed=seed)
  return np.asarray([r[1:3] for r in res.tokens]), res.stats


@pytest.mark.parametrize("sp", [SamplingParams(1.0), SamplingParams(0.7),
                                SamplingParams(1.0, top_k=4)])
def test_exact_sampling_matches_target_distribution(small_vocab_pair, sp):
  target, draft = small_vocab_pair
  joint = _target_joint(target, PROMPT, sp)
  samples, stats = _spec_samples(target, draft, sp)
  assert 0.1 < stats.accept < 0.9  # the test exercises both accept and reject
  assert _chi2_pvalue(samples, joint) > 1e-3


def test_wrong_rule_fails_the_same_test(small_vocab_pair, monkeypatch):
  """Sampling the correction from p instead of max(0, p - q) is biased: caught."""
  target, draft = small_vocab_pair
  sp = SamplingParams(1.0)

  def biased(key, simulated, accept_probs, sp, drafts, q, p, n_drafted):
    return _biased_judge(key, sp, drafts, q, p, n_drafted)

  jax.clear_caches()
  monkeypatch.setattr(acceptance, "judge", biased)
  try:
    samples, _ = _spec_samples(target, draft, sp)
  finally:
    monkeypatch.undo()
    jax.clear_caches()
  assert _chi2_pvalue(samples, _target_joint(target, PROMPT, sp)) < 1e-6


def _biased_judge(key, sp, drafts, q, p, n_drafted):
  k_u, k_tok = jax.random.split(key)
  b, g = drafts.shape
  pd = jnp.take_along_axis(p[:, :g], drafts[..., None], -1)[..., 0]
  qd = jnp.take_along_axis(q, drafts[..., None], -1)[..., 0]
  ok = jax.random.uniform(k_u, (b, g)) * qd < pd
  n_acc = jnp.sum(jnp.cumprod(ok.astype(jnp.int32), -1), -1)
  p_next = jnp.take_along_axis(p, n_acc[:, None, None], 1)[:, 0]  # no residual: wrong
  return n_acc, sampling.sample(k_tok, p_next)


# ---- simulated acceptance ---------------------------------------------------

@pytest.mark.parametrize("rule,gamma", [("bernoulli:0.8", 5), ("bernoulli:0.5", 3),
                                        ("mean_length:2.5", 4), ("fraction:0.8", 8),
                                        ("fraction:0.5", 3), ("always", 4)])
def test_simulated_rules_hit_their_expectation(pair, rule, gamma):
  target, draft = pair
  res = speculative.generate(target, draft, [PROMPTS[0]] * 64, 40, gamma, rule=rule, seed=2)
  st = res.stats
  expect = acceptance.expected_accepted(acceptance.parse_rule(rule), gamma)
  if rule.startswith(("fraction", "always")):
    assert st.mean_accepted == expect
  else:
    # standard error of the mean of a variable in [0, gamma]
    assert abs(st.mean_accepted - expect) < 4 * gamma / 2 / np.sqrt(st.n_steps)
  if rule == "mean_length:2.5":
    assert expect == pytest.approx(2.5)


def test_simulated_rule_keeps_caches_consistent(pair):
  """'always' emits the drafted tokens: the target's continuation of that
  sequence must be what a fresh forward over it predicts."""
  target, draft = pair
  prompt = PROMPTS[0]
  res = speculative.generate(target, draft, [prompt], 30, 4, rule="always")
  seq = prompt + res.tokens[0]
  # the bonus token at each step is the target argmax given everything before it
  cache = target.new_cache(1, len(seq))
  logits, _ = model.forward(target.params, jnp.asarray([seq]), cache, target.cfg)
  argmax = np.asarray(jnp.argmax(logits[0], -1))
  bonus_positions = [len(prompt) + 1 + 5 * s + 4 for s in range(res.stats.n_steps)]
  for pos in bonus_positions:
    if pos < len(seq):
      assert seq[pos] == argmax[pos - 1]


def test_stats_are_consistent(pair):
  target, draft = pair
  res = speculative.generate(target, draft, [PROMPTS[2]], 57, 5, rule="bernoulli:0.6", seed=4)
  st = res.stats
  assert sum(st.accept_hist) == st.n_steps
  assert st.n_drafted == 5 * st.n_steps
  # every step emits its accepted drafts plus one target token, the last step capped
  assert st.n_accept + st.n_steps + 1 >= st.n_predict == 57
  assert st.n_accept + st.n_steps + 1 - st.n_predict <= 5
  assert st.accept == pytest.approx(st.n_accept / st.n_drafted)
  assert st.alpha == pytest.approx(theory.alpha_from_mean_accepted(st.mean_accepted, 5))


def test_early_stop_counts_only_what_was_drafted(pair):
  target, draft = pair
  base = generation.generate(target, [PROMPTS[0]], 30).tokens
  res = speculative.generate(target, draft, [PROMPTS[0]], 30, 6, p_min=0.9)
  assert res.tokens == base
  assert res.stats.n_drafted < 6 * res.stats.n_steps


@pytest.mark.parametrize("loop", ["device", "host"])
def test_generation_to_the_full_context_stays_exact(pair, loop):
  """Up to the last slot: a clamped (overflowing) cache write would corrupt it."""
  target, _ = pair
  prompt = PROMPTS[0]
  n = target.cfg.max_seq_len - len(prompt)
  res = speculative.generate(target, target, [prompt], n, 8, loop=loop)
  assert res.tokens == generation.generate(target, [prompt], n).tokens
  assert res.stats.accept == 1.0


def test_eos_stops(pair):
  target, draft = pair
  base = generation.generate(target, [PROMPTS[1]], 30).tokens[0]
  eos = base[7]
  res = speculative.generate(target, draft, [PROMPTS[1]], 30, 3, eos_id=eos)
  assert res.tokens[0] == base[:base.index(eos) + 1]


def test_bad_settings(pair):
  target, _ = pair
  other = config.get_preset("tiny").replace(name="other", vocab_size=300)
  with pytest.raises(ConfigError, match="vocabularies differ"):
    speculative.SpecConfig(target.cfg, other, 4)
  with pytest.raises(ConfigError, match="vocabularies differ"):
    speculative.generate(target, steps.Model(other, model.init_params(other)), [[1]], 4, 2)
  with pytest.raises(ConfigError, match="gamma"):
    speculative.SpecConfig(target.cfg, target.cfg, 0)
  for bad in ["sometimes", "bernoulli:1.5", "bernoulli:x", "always:1"]:
    with pytest.raises(ConfigError):
      acceptance.parse_rule(bad)
  with pytest.raises(ConfigError, match="mean_length"):
    acceptance.parse_rule("mean_length:9").resolve(4)


def test_one_compilation_serves_every_simulated_rule(pair):
  from specjax.timing import CompileWatch
  target, draft = pair
  speculative.generate(target, draft, [PROMPTS[0]], 12, 3, rule="bernoulli:0.3")
  with CompileWatch() as cw:
    for rule in ["bernoulli:0.6", "always", "fraction:0.5", "mean_length:1.5"]:
      speculative.generate(target, draft, [PROMPTS[0]], 12, 3, rule=rule)
  assert cw.names["spec_loop"] == 0, cw.names


@pytest.mark.parametrize("n_acc", [0, 1, 2, 3])
def test_draft_cache_is_behind_only_after_full_acceptance(n_acc):
  """accept_phase's bookkeeping: both caches end at the emitted sequence minus
  its last token, except the draft after all G drafts were accepted (it never
  saw d_G), which the next draft phase then feeds."""
  cfg = config.get_preset("tiny")
  g, n, v = 3, 10, cfg.vocab_size
  sc = speculative.SpecConfig(cfg, cfg, g, simulated=True)
  drafts = jnp.asarray([[11, 12, 13]])
  probs = (np.arange(g) < n_acc).astype(np.float32)   # accept exactly n_acc
  p = jax.nn.one_hot(jnp.full((1, g + 1), 7), v)
  a = speculative.accept_phase(jax.random.PRNGKey(0), jnp.asarray(probs), p, p[:, :g], drafts,
                               jnp.asarray([g]), jnp.asarray([[5, 6]]), jnp.asarray([n]),
                               jnp.asarray([True]), sc)
  new_n = n + n_acc + 1
  assert int(a["n"][0]) == new_n and int(a["t_len"][0]) == new_n - 1
  assert int(a["d_len"][0]) == (new_n - 2 if n_acc == g else new_n - 1)
  assert a["emitted"][0, :n_acc + 1].tolist() == [11, 12, 13][:n_acc] + [7]
  assert a["tail"][0].tolist() == [([6] + [11, 12, 13])[n_acc], 7]
