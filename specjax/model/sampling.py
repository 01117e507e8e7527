"""Logits -> probabilities (temperature, top-k, top-p) -> tokens.

Speculative sampling needs the *distributions*, not just samples: the same
`probs` transform is applied to the draft's q and the target's p, so the
acceptance test compares the distributions the two models really sample from.
Temperature 0 means greedy: the distribution is one-hot at the argmax.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from specjax.errors import ConfigError


@dataclasses.dataclass(frozen=True)
class SamplingParams:
  """Static sampling settings (hashable: a jit static argument)."""
  temperature: float = 0.0  # 0 = greedy
  top_k: int = 0            # 0 = off
  top_p: float = 1.0        # 1 = off

  def __post_init__(self):
    if self.temperature < 0:
      raise ConfigError(f"temperature must be >= 0, got {self.temperature}")
    if self.top_k < 0:
      raise ConfigError(f"top_k must be >= 0, got {self.top_k}")
    if not 0.0 < self.top_p <= 1.0:
      raise ConfigError(f"top_p must be in (0, 1], got {self.top_p}")

  @property
  def greedy(self) -> bool:
    return self.temperature == 0.0


def probs(logits: jax.Array, sp: SamplingParams) -> jax.Array:
  """The sampling distribution [..., V] (f32) for logits [..., V]."""
  logits = logits.astype(jnp.float32)
  if sp.greedy:
    return jax.nn.one_hot(argmax(logits), logits.shape[-1], dtype=jnp.float32)
  logits = logits / sp.temperature
  if sp.top_k and sp.top_k < logits.shape[-1]:
    kth = jax.lax.top_k(logits, sp.top_k)[0][..., -1:]
    logits = jnp.where(logits < kth, -jnp.inf, logits)
  p = jax.nn.softmax(logits, axis=-1)
  if sp.top_p < 1.0:
    p = _top_p(p, sp.top_p)
  return p


def _top_p(p: jax.Array, top_p: float) -> jax.Array:
  """Keeps the smallest set of most likely tokens whose mass reaches top_p."""
  sorted_p = jnp.sort(p, axis=-1)[..., ::-1]
  # mass strictly before each sorted token; keep a token while that is < top_p
  before = jnp.cumsum(sorted_p, axis=-1) - sorted_p
  keep_sorted = before < top_p
  # threshold = smallest kept probability; ties at the threshold are kept
  thresh = jnp.min(jnp.where(keep_sorted, sorted_p, jnp.inf), -1, keepdims=True)
  p = jnp.where(p >= thresh, p, 0.0)
  return p / jnp.sum(p, -1, keepdims=True)


def argmax(x: jax.Array) -> jax.Array:
  """jnp.argmax(x, -1) as int32, the same index (the first maximum; a NaN counts
  as the maximum), as a max and a min over the last axis. XLA:CPU lowers
  jnp.argmax to a (value, index) reduce that it does not vectorise: over a
  verify's [4, 5, 49152] logits 7-8 ms against 2.3 ms, and a greedy step takes
  several (docs/decode_cost.md, "Argmax")."""
  top = jnp.max(x, -1, keepdims=True)
  hit = (x == top) | jnp.isnan(x)
  index = jax.lax.broadcasted_iota(jnp.int32, x.shape, x.ndim - 1)
  return jnp.min(jnp.where(hit, index, x.shape[-1]), -1)


def sample(key: jax.Array, p: jax.Array) -> jax.Array:
  """Draws token ids [...] from distributions p [..., V]: the Gumbel-max draw
  of jax.random.categorical(key, log p), with the same noise and so the same
  tokens, through `argmax`."""
  return argmax(jax.random.gumbel(key, p.shape, p.dtype) + jnp.log(p))


def sample_logits(key: jax.Array, logits: jax.Array, sp: SamplingParams) -> jax.Array:
  """Next tokens [...] for logits [..., V]: argmax when greedy, else sampled."""
  if sp.greedy:
    return argmax(logits)
  return sample(key, probs(logits, sp))
