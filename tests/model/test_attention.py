"""Attention over the used length (layers.attend_blocked) against the masked
pass over the whole capacity (layers.attend_masked), and what it changes in
the model: the same logits, no recompilation as the used length grows."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from specjax.model import config
from specjax.decode import generation
from specjax.model import kv_cache
from specjax.model import layers
from specjax.model import llama as model
from specjax.model import steps
from specjax.model.sampling import SamplingParams
from specjax.metrics.timing import CompileWatch


def _inputs(b, t, k, g, d, cap, seed):
  r = np.random.RandomState(seed)
  q = jnp.asarray(r.randn(b, t, k, g, d), jnp.float32)
  kc = jnp.asarray(r.randn(b, k, cap, d), jnp.float32)
  vc = jnp.asarray(r.randn(b, k, cap, d), jnp.float32)
  return q, kc, vc


def _positions(last, t):
  """[B, T]: row b's T queries end at position last[b]."""
  last = np.asarray(last)
  return jnp.asarray(last[:, None] - np.arange(t)[::-1][None, :], jnp.int32)


# Capacity 40 with blocks of 16: the third block is cut by the capacity
# (slots 32..39), so it re-reads 24..31 masked out. Last positions on both
# sides of every boundary, and ragged rows in one batch.
@pytest.mark.parametrize("kv_heads,groups", [(2, 2), (4, 1), (1, 4)], ids=["gqa", "mha", "mqa"])
@pytest.mark.parametrize("t", [1, 5])
@pytest.mark.parametrize("last", [[15, 16, 39], [0 + 4, 31, 32], [17, 38, 8]])
def test_blocked_equals_masked(kv_heads, groups, t, last):
  q, kc, vc = _inputs(3, t, kv_heads, groups, 8, 40, seed=sum(last) + t)
  pos = _positions(last, t)
  want = layers.attend_masked(q, kc, vc, pos, jnp.float32)
  got = jax.jit(functools.partial(layers.attend_blocked, block=16, dtype=jnp.float32))(
      q, kc, vc, pos)
  np.testing.assert_allclose(got, want, atol=2e-6, rtol=2e-6)


def test_blocked_reads_only_the_used_blocks():
  """Slots past the last used block never reach the result: NaN there
  changes nothing (a loop over the capacity would spread it)."""
  q, kc, vc = _inputs(2, 1, 2, 2, 8, 64, seed=1)
  pos = _positions([10, 20], 1)
  poison = lambda c: c.at[:, :, 32:].set(jnp.nan)
  got = layers.attend_blocked(q, poison(kc), poison(vc), pos, 16, jnp.float32)
  want = layers.attend_masked(q, kc, vc, pos, jnp.float32)
  np.testing.assert_allclose(got, want, atol=2e-6, rtol=2e-6)


@pytest.fixture(scope="module", params=["tiny", "tiny-mha"])
def pair(request):
  """The same weights with blocked attention (blocks of 8) and masked."""
  cfg = config.get_preset(request.param)
  assert cfg.attn_block and cfg.attn_block < 32, "tiny presets exercise the blocked path"
  params = model.init_params(cfg, seed=3)
  return steps.Runner(cfg, params), steps.Runner(cfg.replace(attn_block=0), params)


def test_cached_decode_equals_masked_full_forward(pair):
  blocked, masked = pair
  toks = jnp.asarray(np.random.RandomState(0).randint(0, 256, (2, 30)), jnp.int32)
  full = model.forward(masked.params, toks, kv_cache.init_cache(masked.cfg, 2, 30),
                       masked.cfg)[0]
  cache = blocked.new_cache(2, 36)  # not a multiple of the block
  outs = []
  for s in range(0, 30, 3):
    logits, cache = blocked.forward(toks[:, s:s + 3], cache)
    outs.append(logits)
  np.testing.assert_allclose(np.concatenate(outs, 1), full, atol=1e-5)


def test_no_recompile_as_the_used_length_grows(pair):
  """Generation crosses several block boundaries (blocks of 8) inside one
  compiled program: after a warm-up, a run that reaches further compiles
  nothing, in the device loop and in the host loop's decode step."""
  blocked, masked = pair
  sp = SamplingParams()
  out = generation.generate(blocked, [[1, 2, 3]], 40, sp, capacity=64)
  ref = generation.generate(masked, [[1, 2, 3]], 40, sp, capacity=64)
  assert out.tokens == ref.tokens
  generation.generate(blocked, [[4, 5]], 2, sp, capacity=64, loop="host")
  with CompileWatch() as cw:
    # Same bucket and n_predict, 6 more slots: 1 + 6 blocks instead of 6.
    generation.generate(blocked, [[4, 5, 6, 7, 8, 9, 10, 11, 12]], 40, sp, capacity=64)
    generation.generate(blocked, [[4, 5]], 50, sp, capacity=64, loop="host")
  assert cw.count == 0, cw.names


def test_attended_slots():
  from specjax.bench.studies import roofline  # pylint: disable=import-outside-toplevel
  cfg = config.get_preset("llama-160m")
  assert cfg.attn_block == 256
  assert roofline.attended_slots(cfg, 4096, 128) == 256
  assert roofline.attended_slots(cfg, 4096, 257) == 512
  assert roofline.attended_slots(cfg, 200, 128) == 200  # one masked pass
  assert roofline.attended_slots(cfg.replace(attn_block=0), 4096, 128) == 4096


def test_decode_step_moves_no_cache_sized_array():
  """GQA without waste: the compiled decode step (blocked attention) reads
  the [B, K, S, D] cache in place: no copy or transpose of a cache-sized
  array (the [B, S, K, D] layout had one of each per layer and step)."""
  cfg = config.get_preset("tiny")
  cap = 8 * cfg.attn_block  # blocked path, a capacity no other shape shares
  params = jax.eval_shape(lambda: model.init_params(cfg, seed=0))
  cache = jax.eval_shape(lambda: kv_cache.init_cache(cfg, 1, cap))
  tok = jax.ShapeDtypeStruct((1, 1), jnp.int32)
  hlo = steps.forward_step.lower(params, tok, cache, cfg=cfg).compile().as_text()
  k, d = cfg.n_kv_heads, cfg.d_head
  shapes = [f"[1,{k},{cap},{d}]", f"[1,{cap},{k},{d}]", f"[{k},{cap},{d}]", f"[{cap},{k},{d}]"]
  moved = [line.strip()[:160] for line in hlo.splitlines()
           if any(s in line for s in shapes) and (" copy(" in line or " transpose(" in line)]
  assert not moved, moved
