"""sampling.argmax and sampling.sample give jnp.argmax's and
jax.random.categorical's exact answers (ties, NaN, -inf, zero probabilities),
so the faster forms change no token; a deliberate bug (the last maximum on
ties) must fail."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from specjax.model import sampling


def _tied_logits(seed: int = 0) -> jax.Array:
  """[3, 4, 97] logits of small integers (many ties), a row of -inf but for
  one entry, and a row with two NaNs."""
  rng = np.random.RandomState(seed)
  x = rng.randint(0, 4, (3, 4, 97)).astype(np.float32)
  x[0, 1] = -np.inf
  x[0, 1, 50] = 0.0
  x[1, 2, [7, 30]] = np.nan
  return jnp.asarray(x)


def test_argmax_is_jnp_argmax():
  x = _tied_logits()
  got = sampling.argmax(x)
  assert got.dtype == jnp.int32
  np.testing.assert_array_equal(got, jnp.argmax(x, -1))
  assert int(got[1, 2]) == 7 and int(got[0, 1]) == 50


def test_sample_is_categorical():
  key = jax.random.PRNGKey(3)
  p = jax.nn.softmax(jax.random.normal(jax.random.PRNGKey(1), (5, 3, 211)), -1)
  p = jnp.where(p < 0.004, 0.0, p)  # zero probabilities: log p = -inf
  p = p / p.sum(-1, keepdims=True)
  for k in jax.random.split(key, 4):
    np.testing.assert_array_equal(sampling.sample(k, p),
                                  jax.random.categorical(k, jnp.log(p), axis=-1))


def _last_on_ties(x):
  top = jnp.max(x, -1, keepdims=True)
  index = jax.lax.broadcasted_iota(jnp.int32, x.shape, x.ndim - 1)
  return jnp.max(jnp.where(x == top, index, -1), -1)


def test_mutation_last_on_ties_fails(monkeypatch):
  monkeypatch.setattr(sampling, "argmax", _last_on_ties)
  with pytest.raises(AssertionError):
    test_argmax_is_jnp_argmax()
