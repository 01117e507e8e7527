"""Cache semantics of the model and the jitted steps (tiny models, CPU)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from specjax.model import config
from specjax.decode import generation
from specjax.model import kv_cache
from specjax.model import llama as model
from specjax.model import steps
from specjax.errors import CacheOverflowError, ConfigError
from specjax.model.sampling import SamplingParams
from specjax.metrics.timing import CompileWatch

ATOL = 1e-5


@pytest.fixture(scope="module", params=["tiny", "tiny-mha"])
def tiny(request):
  cfg = config.get_preset(request.param)
  return steps.Runner(cfg, model.init_params(cfg, seed=7))


def _tokens(b, t, vocab, seed=0):
  return jnp.asarray(np.random.RandomState(seed).randint(0, vocab, (b, t)), jnp.int32)


def _full(m, tokens):
  cache = kv_cache.init_cache(m.cfg, tokens.shape[0], tokens.shape[1])
  return model.forward(m.params, tokens, cache, m.cfg)[0]


def test_cached_decode_equals_full_forward(tiny):
  toks = _tokens(2, 12, tiny.cfg.vocab_size)
  full = _full(tiny, toks)
  cache = tiny.new_cache(2, 16)
  outs = []
  for i in range(12):
    logits, cache = tiny.forward(toks[:, i:i + 1], cache)
    outs.append(logits)
  np.testing.assert_allclose(np.concatenate(outs, 1), full, atol=ATOL)
  assert np.asarray(cache.lengths).tolist() == [12, 12]


@pytest.mark.parametrize("chunk", [1, 2, 3, 5, 9])
def test_chunked_equals_full(tiny, chunk):
  toks = _tokens(1, 18, tiny.cfg.vocab_size, seed=chunk)
  full = _full(tiny, toks)
  cache = tiny.new_cache(1, 32)
  outs = []
  for s in range(0, 18, chunk):
    logits, cache = tiny.forward(toks[:, s:s + chunk], cache)
    outs.append(logits)
  np.testing.assert_allclose(np.concatenate(outs, 1), full, atol=ATOL)


def test_prefill_buckets_match_full_and_rows_differ_in_length(tiny):
  prompts = [[5, 6, 7], [9, 8, 7, 6, 5, 4, 3, 2, 1, 0, 11]]
  logits, cache = tiny.prefill(prompts, tiny.new_cache(2, 32))
  for b, p in enumerate(prompts):
    ref = _full(tiny, jnp.asarray([p]))[0, -1]
    np.testing.assert_allclose(logits[b], ref, atol=ATOL)
  assert np.asarray(cache.lengths).tolist() == [3, 11]
  # Decoding on from the ragged prefill equals a full forward of each row.
  nxt, cache = tiny.forward(jnp.asarray([[1], [2]]), cache)
  for b, (p, t) in enumerate(zip(prompts, [1, 2])):
    np.testing.assert_allclose(nxt[b, 0], _full(tiny, jnp.asarray([p + [t]]))[0, -1],
                               atol=ATOL)


def test_rollback_equals_never_having_speculated(tiny):
  toks = _tokens(1, 10, tiny.cfg.vocab_size, seed=3)
  wrong = _tokens(1, 5, tiny.cfg.vocab_size, seed=4)
  # Path A: prefix, speculate 5 wrong tokens, roll back, continue.
  _, cache = tiny.forward(toks[:, :6], tiny.new_cache(1, 32))
  _, cache = tiny.forward(wrong, cache)
  cache = kv_cache.rollback(cache, 6)
  a, _ = tiny.forward(toks[:, 6:], cache)
  # Path B: never speculated.
  _, cache_b = tiny.forward(toks[:, :6], tiny.new_cache(1, 32))
  b, _ = tiny.forward(toks[:, 6:], cache_b)
  np.testing.assert_allclose(a, b, atol=ATOL)


def test_rollback_is_per_row(tiny):
  toks = _tokens(2, 8, tiny.cfg.vocab_size, seed=5)
  _, cache = tiny.forward(toks, tiny.new_cache(2, 16))
  cache = kv_cache.rollback(cache, jnp.asarray([3, 8]))
  logits, _ = tiny.forward(toks[:, :1], cache)
  ref0 = _full(tiny, jnp.concatenate([toks[:1, :3], toks[:1, :1]], 1))[0, -1]
  ref1 = _full(tiny, jnp.concatenate([toks[1:, :8], toks[1:, :1]], 1))[0, -1]
  np.testing.assert_allclose(logits[0, 0], ref0, atol=ATOL)
  np.testing.assert_allclose(logits[1, 0], ref1, atol=ATOL)


def test_overflow_raises_before_writing(tiny):
  cache = tiny.new_cache(1, 8)
  _, cache = tiny.forward(_tokens(1, 6, tiny.cfg.vocab_size), cache)
  with pytest.raises(CacheOverflowError, match="overflow"):
    tiny.forward(_tokens(1, 3, tiny.cfg.vocab_size), cache)
  with pytest.raises(CacheOverflowError, match="does not fit"):
    tiny.prefill([list(range(9))], tiny.new_cache(1, 8))


def test_compiles_once_per_shape(tiny):
  jax.clear_caches()  # other tests may have compiled these shapes already
  cache = tiny.new_cache(1, 64)
  with CompileWatch() as cw:
    _, cache = tiny.prefill([[1, 2, 3]], cache)
    cache = kv_cache.rollback(cache, 0)
    _, cache = tiny.prefill([list(range(1, 15))], cache)   # same 16-bucket
    for _ in range(3):
      _, cache = tiny.forward(jnp.asarray([[1]]), cache)     # decode shape
    for _ in range(3):
      _, cache = tiny.forward(jnp.asarray([[1, 2, 3]]), cache)  # verify shape
  assert cw.names["prefill_step"] == 1 and cw.names["forward_step"] == 2, cw.names
  with CompileWatch() as again:
    cache = kv_cache.rollback(cache, 0)
    _, cache = tiny.prefill([list(range(1, 10))], cache)
    _, cache = tiny.forward(jnp.asarray([[4]]), cache)
  assert again.names["prefill_step"] == again.names["forward_step"] == 0, again.names


@pytest.mark.parametrize("sp", [SamplingParams(), SamplingParams(1.0),
                                SamplingParams(0.8, top_k=10, top_p=0.9)])
def test_device_loop_equals_host_loop(tiny, sp):
  prompts = [[3, 1, 4, 1, 5], [9, 2, 6]]
  a = generation.generate(tiny, prompts, 24, sp, seed=11, loop="device")
  b = generation.generate(tiny, prompts, 24, sp, seed=11, loop="host")
  assert a.tokens == b.tokens
  assert all(len(r) == 24 for r in a.tokens)


def test_greedy_generation_is_argmax_of_full_forward(tiny):
  prompt = [7, 7, 1, 2]
  out = generation.generate(tiny, [prompt], 10).tokens[0]
  # One full forward over prompt + output: each generated token must be the
  # argmax of the logits before it.
  argmax = np.asarray(jnp.argmax(_full(tiny, jnp.asarray([prompt + out]))[0], -1))
  assert out == argmax[len(prompt) - 1:-1].tolist()


def test_eos_stops_generation(tiny):
  full = generation.generate(tiny, [[1, 2, 3]], 20).tokens[0]
  eos = full[5]
  first = full.index(eos)
  for loop in ("device", "host"):
    out = generation.generate(tiny, [[1, 2, 3]], 20, eos_id=eos, loop=loop).tokens[0]
    assert out == full[:first + 1]


def test_capacity_planning_errors(tiny):
  with pytest.raises(CacheOverflowError, match="exceeds the context"):
    generation.generate(tiny, [list(range(100))], 40)
  with pytest.raises(ConfigError, match="n_predict"):
    generation.generate(tiny, [[1]], 0)


def test_unknown_preset_lists_valid_ones():
  with pytest.raises(ConfigError, match="llama-160m"):
    config.get_preset("llama-9000")


def test_presets_param_counts():
  # Published sizes (rounded): guards against a wrong shape in a preset.
  expect = {"llama-160m": 162.4e6, "llama-2-7b": 6.74e9, "llama-2-13b": 13.0e9,
            "llama-2-70b": 69.0e9, "tinyllama-1.1b": 1.10e9, "llama-3-8b": 8.03e9,
            "llama-3.2-1b": 1.24e9, "codellama-34b": 33.7e9}
  for name, n in expect.items():
    assert abs(config.get_preset(name).num_params() / n - 1) < 0.01, name


# ------------------------------------------------------------- bf16-mixed mode


@pytest.fixture(scope="module", params=["tiny", "tied"])
def mixed_pair(request):
  """(f32 model, the same weights in bf16-mixed)."""
  cfg = config.get_preset("tiny")
  if request.param == "tied":
    cfg = cfg.replace(tie_embeddings=True, name="tiny-tied")
  params = model.init_params(cfg, seed=11)
  params = jax.tree_util.tree_map(lambda x: x.astype(jnp.bfloat16).astype(jnp.float32), params)
  mcfg = cfg.with_dtype("bf16-mixed")
  return steps.Runner(cfg, params), steps.Runner(
      mcfg, jax.tree_util.tree_map(lambda x: x.astype(jnp.bfloat16), params))


def test_mixed_mode_config():
  cfg = config.get_preset("tiny", "mixed")
  assert (cfg.dtype, cfg.param_dtype, cfg.dot_dtype, cfg.precision) == (
      "float32", "bfloat16", "bfloat16", "bf16-mixed")
  assert cfg.with_dtype("float32").dot_dtype is None
  assert config.ModelConfig.from_dict(cfg.to_dict()) == cfg


def test_mixed_mode_is_close_to_f32_and_rounds_matmul_operands(mixed_pair):
  f32, mixed = mixed_pair
  toks = _tokens(2, 12, f32.cfg.vocab_size)
  a, b = np.asarray(_full(f32, toks)), np.asarray(_full(mixed, toks))
  assert {x.dtype for x in jax.tree_util.tree_leaves(mixed.params)} == {jnp.dtype(jnp.bfloat16)}
  err = np.abs(a - b).max() / np.abs(a).max()
  assert 0 < err < 2e-2, err  # operands rounded to bf16: close, not equal


def test_mixed_mode_cached_decode_equals_full_forward(mixed_pair):
  _, m = mixed_pair
  toks = _tokens(1, 10, m.cfg.vocab_size, seed=3)  # batch 1: the padded one-row path
  full = np.asarray(_full(m, toks))
  cache = m.new_cache(1, 16)
  outs = []
  for i in range(10):
    logits, cache = m.forward(toks[:, i:i + 1], cache)
    outs.append(np.asarray(logits))
  np.testing.assert_allclose(np.concatenate(outs, 1), full, atol=1e-4)


def test_mixed_mode_greedy_speculative_equals_target_only(mixed_pair):
  from specjax.decode import speculative
  _, m = mixed_pair
  dcfg = config.get_preset("tiny-draft", "bf16-mixed")
  d = steps.Runner(dcfg, model.init_params(dcfg, seed=5))
  prompt = [3, 14, 15, 92, 6]
  base = generation.generate(m, [prompt], 24, SamplingParams(0.0), ctx_size=64)
  for gamma in (1, 4):
    spec = speculative.generate(m, d, [prompt], 24, gamma, rule="real", ctx_size=64)
    assert spec.tokens == base.tokens


def _uncut_chunks(params, tokens, lens, cache, chunk, cfg, **kw):
  """A deliberate bug: every chunk `chunk` wide, the last not cut to the block,
  so it writes past the cache's end (clamped by XLA, over earlier slots)."""
  width = -(-tokens.shape[1] // chunk) * chunk
  padded = np.zeros((tokens.shape[0], width), np.int32)
  padded[:, :tokens.shape[1]] = tokens
  return GOOD_CHUNKS(params, padded, lens, cache, chunk, cfg, **kw)


def _last_chunks_logits(params, tokens, lens, cache, chunk, cfg, **kw):
  """A deliberate bug: every row's logits from the last chunk, not its own."""
  out = GOOD_CHUNKS(params, tokens, lens, cache, chunk, cfg, **kw)
  longest = int(np.argmax(lens))
  return (jnp.broadcast_to(out[0][longest], out[0].shape),) + tuple(out[1:])


GOOD_CHUNKS = steps.prefill_chunks
CHUNK_BUGS = {"uncut last chunk": _uncut_chunks, "the last chunk's logits": _last_chunks_logits}


@pytest.mark.parametrize("bug", [None, *CHUNK_BUGS])
def test_prefill_in_chunks_equals_one_shot(tiny, monkeypatch, bug):
  """Ragged rows, a second prefill at the lengths the first left, and a cache
  with no room for a whole chunk of padding: chunks of 8 equal one pass."""
  if bug:
    monkeypatch.setattr(steps, "prefill_chunks", CHUNK_BUGS[bug])
  rng = np.random.RandomState(11)
  first = [rng.randint(0, tiny.cfg.vocab_size, n).tolist() for n in (21, 3, 12)]
  second = [rng.randint(0, tiny.cfg.vocab_size, n).tolist() for n in (17, 4, 9)]
  cap = 21 + 17 + 4  # the longest rows' sum, plus room for the decode below
  outs = []
  for chunk in (8, 64):  # 64: one shot
    cache = tiny.new_cache(3, cap)
    _, cache, h1 = tiny.prefill(first, cache, return_hidden=True, chunk=chunk)
    logits, cache = tiny.prefill(second, cache, chunk=chunk)
    nxt, cache = tiny.forward(jnp.asarray([[1], [2], [3]]), cache)
    outs.append((logits, nxt[:, 0], h1, np.asarray(cache.lengths)))
  (l8, n8, h8, len8), (l1, n1, h1, len1) = outs
  assert len8.tolist() == len1.tolist() == [39, 8, 22]
  for b, p in enumerate(first):
    np.testing.assert_allclose(h8[b, :len(p)], h1[b, :len(p)], atol=ATOL)
  if bug:
    with pytest.raises(AssertionError):
      np.testing.assert_allclose(np.stack([l8, n8]), np.stack([l1, n1]), atol=ATOL)
    return
  np.testing.assert_allclose(l8, l1, atol=ATOL)
  np.testing.assert_allclose(n8, n1, atol=ATOL)
