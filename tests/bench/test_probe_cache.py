"""probes.filled_cache: a probe's cache holds `depth` slots of random K/V
per row (not a prefill of random tokens), so a probe at depth D attends
over D slots; past them the cache is empty. Committed deliberate bugs
must each fail: the lengths left at 0, the fill one slot short, and the cache
left uncommitted beside placed params (the probe compiles in its timed repetitions)."""

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


def check_times_without_compiling(m, capacity):
  """The sweep's case: params placed on the device (a checkpoint's); the probe's
  timed repetitions must not compile (timing.measure raises if they do)."""
  import jax  # pylint: disable=import-outside-toplevel
  placed = steps.Runner(m.cfg, jax.device_put(m.params, jax.devices()[0]))
  probes.CostProbe(placed, capacity=capacity, depth=12, k=2).times([1], reps=2)


def test_a_probe_over_placed_params_compiles_only_while_warming_up(tiny):
  check_times_without_compiling(tiny, 64)


def test_an_uncommitted_cache_fails(tiny, monkeypatch):
  monkeypatch.setattr(probes, "committed", lambda cache, params: cache)
  with pytest.raises(RuntimeError, match="compilation"):
    check_times_without_compiling(tiny, 80)  # shapes of its own: nothing compiled yet
