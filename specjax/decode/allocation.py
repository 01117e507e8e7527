"""Per-row draft lengths from a verify budget (issue 40): which rows of a
packed verify (model/packed.py) get how many of the block's N tokens.

Under the per-row geometric model (row b accepts each draft with
probability alpha_b, independently, until the first rejection), giving row b
its k-th draft adds alpha_b^k to the expected tokens of the step (Leviathan
et al. Eq. 1 as a sum: E = 1 + alpha + .. + alpha^l; metrics.theory's
expected_tokens_per_step). The gains fall with k, so the best lengths for a
budget of N tokens (every row's tail, plus N - B drafts) take the N - B
largest gains of the [B, gamma_max] table: one `lax.top_k` at fixed shape, on
device (`allocate`). A gain of zero (alpha_b = 0) is not worth a token: the
entry stays padding.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from specjax.errors import ConfigError


def gains(alpha, gamma_max: int) -> jax.Array:
  """[B, gamma_max] float32: alpha_b^k, k = 1 .. gamma_max (the expected
  tokens the k-th draft of row b adds)."""
  k = jnp.arange(1, gamma_max + 1, dtype=jnp.float32)
  return jnp.asarray(alpha, jnp.float32)[:, None] ** k[None, :]


def capped(table, limit) -> jax.Array:
  """The gains table [B, gamma_max] with row b's entries past limit_b at 0."""
  k = jnp.arange(1, table.shape[1] + 1)[None, :]
  return jnp.where(k <= jnp.asarray(limit)[:, None], table, 0.0)


def n_drafts(budget: int, batch: int) -> int:
  """The drafts a block of `budget` tokens holds besides the B tails."""
  return budget - batch


def lengths_of(chosen, valid, batch: int, gamma_max: int) -> jax.Array:
  """[B] int32: how many of the chosen flat indices (into [B, gamma_max],
  row-major; `valid` False ones not counted) fall in each row."""
  return jnp.zeros((batch,), jnp.int32).at[chosen // gamma_max].add(valid.astype(jnp.int32))


def allocate(alpha, budget: int, gamma_max: int, limit=None) -> jax.Array:
  """[B] int32 draft lengths (0 .. gamma_max, sum <= budget - B) maximizing
  the expected tokens of the step under the geometric model: the top
  budget - B gains alpha_b^k (ties: the lower row, then the lower k, so each
  row's share is a prefix k = 1 .. l_b). alpha [B] in [0, 1], traced;
  budget and gamma_max static (budget >= B). Tokens per row: 1 + lengths.
  limit [B] (optional, traced): row b's drafts past limit_b gain nothing (a
  drafter that proposed fewer, as n-gram's n_drafted), so l_b <= limit_b."""
  batch = jnp.shape(alpha)[0]
  if budget < batch or gamma_max < 0:
    raise ConfigError(f"a verify budget of {budget} tokens cannot hold {batch} rows' tails "
                      f"(gamma_max {gamma_max}): the budget needs at least B = {batch}")
  extra = min(n_drafts(budget, batch), batch * gamma_max)
  if extra <= 0:
    return jnp.zeros((batch,), jnp.int32)
  table = gains(alpha, gamma_max)  # [B, gamma_max]
  if limit is not None:
    table = capped(table, limit)
  top, chosen = jax.lax.top_k(table.reshape(-1), extra)
  return lengths_of(chosen, top > 0, batch, gamma_max)
