"""probes.filled_cache: a probe's cache holds `depth` slots of random K/V
per row (not a prefill of random tokens), so a probe at depth D attends
over D slots; past them the cache is empty. Committed deliberate bugs
must each fail: the lengths left at 0, the fill one slot short."""

import jax.numpy as jnp
import numpy as np
import pytest

from specjax.decode import probes
from specjax.model import steps
from specjax.model.config import get_preset


@pytest.fixture(scope="module")
def tiny(init_params):
  cfg = get_preset("tiny")
  return steps.Runner(cfg, init_params(cfg, 0))


def check_filled(m, batch=2, capacity=160, depth=100):
  cache = probes.filled_cache(m, batch, capacity, depth, np.random.RandomState(0))
  assert cache.capacity == capacity and cache.batch == batch
  np.testing.assert_array_equal(cache.lengths, [depth] * batch)
  for arr in cache.k + cache.v:
    a = np.asarray(arr)
    assert a.dtype == m.cfg.jnp_dtype
    assert np.all(np.abs(a[:, :, :depth]).sum(-1) > 0), "a slot below the depth is empty"
    assert not a[:, :, depth:].any(), "a slot past the depth is filled"


def test_the_cache_holds_depth_random_slots(tiny):
  check_filled(tiny)
  check_filled(tiny, batch=1, capacity=32, depth=7)


REAL = probes.random_slots


def _no_lengths(cache, key, depth):
  return REAL(cache, key, depth).replace(lengths=cache.lengths)


def _short(cache, key, depth):
  return REAL(cache, key, depth - 1).replace(
      lengths=jnp.full_like(cache.lengths, depth))


@pytest.mark.parametrize("bug", [_no_lengths, _short], ids=["lengths left at 0",
                                                             "the fill one slot short"])
def test_each_deliberate_bug_fails(tiny, monkeypatch, bug):
  monkeypatch.setattr(probes, "random_slots", bug)
  with pytest.raises(AssertionError):
    check_filled(tiny)
