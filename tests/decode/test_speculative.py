"""The speculative engine: greedy exactness, simulated acceptance, statistics."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from specjax.decode import acceptance
from specjax.decode import chain_step
from specjax.decode import plan
from specjax.drafters.base import Drafted
from specjax.drafters.draft_model import MODEL
from specjax.model import config
from specjax.decode import generation
from specjax.model import kv_cache
from specjax.model import llama as model
from specjax.decode import speculative
from specjax.model import steps
from specjax.metrics import theory
from specjax.errors import ConfigError
from specjax.model.sampling import SamplingParams

def _perturbed(m: steps.Runner, scale: float, seed: int) -> steps.Runner:
  """A draft that mostly agrees with the target: its weights plus noise."""
  leaves, tree = jax.tree_util.tree_flatten(m.params)
  keys = jax.random.split(jax.random.PRNGKey(seed), len(leaves))
  noisy = [x + scale * jnp.std(x) * jax.random.normal(k, x.shape) for x, k in zip(leaves, keys)]
  return steps.Runner(m.cfg, jax.tree_util.tree_unflatten(tree, noisy))


def _sharpen(m: steps.Runner, factor: float) -> steps.Runner:
  """Scales the output layer so that distributions are peaked (random init is flat)."""
  params = dict(m.params)
  params["lm_head"] = {"kernel": m.params["lm_head"]["kernel"] * factor}
  return steps.Runner(m.cfg, params)


@pytest.fixture(scope="module")
def pair():
  cfg = config.get_preset("tiny")
  target = _sharpen(steps.Runner(cfg, model.init_params(cfg, 1)), 40.0)
  return target, _perturbed(target, 0.5, 3)


PROMPTS = [[5, 17, 42, 9, 100], [7, 7, 7], [200, 1, 64, 3, 9, 81, 27, 2]]


# every gamma on the device loop; the host loop (its own compiled phases, also
# checked against the device loop when sampling and to the full context) at one
@pytest.mark.parametrize("loop,gamma", [("device", 1), ("device", 3), ("device", 8),
                                        ("host", 3)])
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
  assert res.stats.n_catchup == res.stats.n_steps - 1


def test_device_and_host_loops_agree_when_sampling(pair):
  target, draft = pair
  kw = dict(sp=SamplingParams(0.9, top_p=0.95), seed=21)
  a = speculative.generate(target, draft, PROMPTS, 30, 3, loop="device", **kw)
  b = speculative.generate(target, draft, PROMPTS, 30, 3, loop="host", **kw)
  assert a.tokens == b.tokens
  assert a.stats.accept_hist == b.stats.accept_hist


# Exact sampling's losslessness: tests/test_lossless.py.


# ---- simulated acceptance ---------------------------------------------------

# Simulated rules share a compilation per gamma (their probabilities are
# traced), so the rules are grouped on few gammas.
@pytest.mark.parametrize("rule,gamma", [("bernoulli:0.8", 4), ("bernoulli:0.5", 3),
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
  logits, _ = steps.forward_step(target.params, jnp.asarray([seq]), cache, cfg=target.cfg)
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
  # every step emits its accepted drafts plus one target token; the last step
  # is cut at n_predict, and the kept tokens are exactly what was emitted
  assert st.n_predict == 57 and st.n_kept == 56
  assert 0 <= st.n_accept + st.n_steps - st.n_kept <= 5
  assert st.tokens_per_step == pytest.approx(56 / st.n_steps)
  assert st.tokens_per_s == pytest.approx(56 / res.eval_s)
  assert st.accept_rate == pytest.approx(st.n_accept / st.n_drafted)
  assert st.alpha == pytest.approx(theory.alpha_from_mean_accepted(st.mean_accepted, 5))
  # a catch-up follows every fully accepted step but the last
  full = res.records.n_acc == 5
  assert st.n_catchup == int(full[:-1].sum())
  assert res.records.caught_up.tolist() == [0] + full[:-1].astype(int).tolist()


def test_eos_cut_counts_in_tokens_and_speed_alike(pair):
  """Tokens emitted after EOS are in neither tokens_per_step nor the speed."""
  target, draft = pair
  base = generation.generate(target, [PROMPTS[1]], 30).tokens[0]
  eos = base[9]
  res = speculative.generate(target, draft, [PROMPTS[1]], 30, 4, eos_id=eos)
  kept = len(res.tokens[0]) - 1
  assert res.stats.n_kept == kept == base.index(eos)
  assert res.stats.tokens_per_step == pytest.approx(kept / res.stats.n_steps)


def eos_counts(target, draft) -> tuple[int, int]:
  """(target-only's decoded tokens, the speculative run's kept tokens) for two
  rows under an EOS that stops one of them early."""
  rows = [PROMPTS[1], PROMPTS[0]]
  eos = generation.generate(target, [PROMPTS[1]], 30).tokens[0][9]
  base = generation.generate(target, rows, 30, eos_id=eos)
  assert len({len(r) for r in base.tokens}) == 2  # the rows stop at different steps
  return base.n_decoded, speculative.generate(target, draft, rows, 30, 4, eos_id=eos).stats.n_kept


def test_target_only_counts_the_tokens_the_speculative_run_keeps(pair):
  """The speedup's two speeds count the same tokens: each row up to its EOS."""
  decoded, kept = eos_counts(*pair)
  assert decoded == kept


def test_target_only_credited_with_every_step_fails(pair, monkeypatch):
  """The committed bug: target-only credited with n_eval x rows tokens (the
  speeds of speculative.py and the sweeps before this test), which overstated
  its speed, and so understated every speedup, in runs with EOS."""
  monkeypatch.setattr(generation.GenerationResult, "n_decoded",
                      property(lambda r: r.n_eval * len(r.tokens)))
  decoded, kept = eos_counts(*pair)
  assert decoded != kept


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
  assert res.stats.accept_rate == 1.0


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
    plan.SpecConfig(target.cfg, other, 4)
  with pytest.raises(ConfigError, match="vocabularies differ"):
    speculative.generate(target, steps.Runner(other, model.init_params(other)), [[1]], 4, 2)
  with pytest.raises(ConfigError, match="gamma"):
    plan.SpecConfig(target.cfg, target.cfg, 0)
  for bad in ["sometimes", "bernoulli:1.5", "bernoulli:x", "always:1"]:
    with pytest.raises(ConfigError):
      acceptance.parse_rule(bad)
  with pytest.raises(ConfigError, match="mean_length"):
    acceptance.parse_rule("mean_length:9").resolve(4)


def test_one_compilation_serves_every_simulated_rule(pair):
  from specjax.metrics.timing import CompileWatch
  target, draft = pair
  speculative.generate(target, draft, [PROMPTS[0]], 12, 3, rule="bernoulli:0.3")
  with CompileWatch() as cw:
    for rule in ["bernoulli:0.6", "always", "fraction:0.5", "mean_length:1.5"]:
      speculative.generate(target, draft, [PROMPTS[0]], 12, 3, rule=rule)
  assert cw.names["spec_loop"] == 0, cw.names


@pytest.mark.parametrize("n_acc", [0, 1, 2, 3])
def test_draft_cache_is_behind_only_after_full_acceptance(n_acc):
  """accept_phase's bookkeeping: both caches end at the emitted sequence minus
  its last token, except the draft after all gamma drafts were accepted (it
  never saw d_gamma), which the next draft phase then feeds."""
  cfg = config.get_preset("tiny")
  gamma, n, v = 3, 10, cfg.vocab_size
  sc = plan.SpecConfig(cfg, cfg, gamma, simulated=True)
  drafted = Drafted(tokens=jnp.asarray([[11, 12, 13]]), q=jnp.zeros((1, gamma, 0)),
                    n_drafted=jnp.asarray([gamma]), caught_up=jnp.asarray([False]))
  probs = (np.arange(gamma) < n_acc).astype(np.float32)   # accept exactly n_acc
  p = jax.nn.one_hot(jnp.full((1, gamma + 1), 7), v)
  j = chain_step.accept_phase(jax.random.PRNGKey(0), jnp.asarray(probs), p, drafted,
                              jnp.asarray([[5, 6]]), jnp.asarray([n]), jnp.asarray([True]), sc)
  new_n = n + n_acc + 1
  assert int(j.n[0]) == new_n and int(j.t_len[0]) == new_n - 1
  assert int(j.d_len[0]) == (new_n - 2 if n_acc == gamma else new_n - 1)
  assert j.emitted[0, :n_acc + 1].tolist() == [11, 12, 13][:n_acc] + [7]
  assert j.tail[0].tolist() == [([6] + [11, 12, 13])[n_acc], 7]


@pytest.mark.parametrize("kept", [1, 2, 3])
def test_commit_cuts_a_finished_row_back_to_what_it_kept(kept):
  """A step that n_predict cuts short leaves the sequence, both cache lengths
  and the tail at the kept tokens."""
  cfg = config.get_preset("tiny")
  gamma, n = 3, 10
  cache = kv_cache.init_cache(cfg, 1, 32)
  j = chain_step.Judged(n_acc=jnp.asarray([3]), emitted=jnp.asarray([[11, 12, 13, 7]]),
                        tail=jnp.asarray([[13, 7]]), n=jnp.asarray([n + 4]),
                        t_len=jnp.asarray([n + 3]), d_len=jnp.asarray([n - 1 + gamma]))
  st = speculative.commit(cache, cache, jnp.asarray([[5, 6]]), j, jnp.asarray([kept]),
                          jnp.asarray([True]), MODEL)
  assert int(st.n[0]) == n + kept and int(st.tcache.lengths[0]) == n + kept - 1
  assert int(st.dcache.lengths[0]) == n + kept - 1
  assert st.tail[0].tolist() == [[6, 11, 12, 13][kept - 1], [11, 12, 13][kept - 1]]
