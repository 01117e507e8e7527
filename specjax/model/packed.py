"""A packed verify block: the rows' tokens laid end to end in one block of
fixed size N (the verify's token budget), not a [B, gamma_max + 1] rectangle.

Token i belongs to row `segment[i]` at position `pos[i]`; a row's tokens are
contiguous and in order, at positions lengths[b] .. lengths[b] + count_b - 1
(its tail, then its drafts); entries past the rows' total are padding
(`valid` False). The dense layers run over the N tokens; attention runs per
row: each token's K/V is written into its own row's cache at its own position,
and its query is placed in a [B, W] view of the rows (W = `width`, the most
tokens a row may hold), where each row attends to its own cache, causal by
position, exactly as the rectangular verify does (layers.Attention). Nothing
is written past a row's block; padding is written nowhere. Layout, masking and
costs: docs/packed_verify.md.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import struct

from specjax.errors import ConfigError


@struct.dataclass
class Packed:
  tokens: jax.Array   # [N] int32
  segment: jax.Array  # [N] int32: the row of each token
  pos: jax.Array      # [N] int32: its position (the cache slot it is written to)
  valid: jax.Array    # [N] bool: False for padding past the rows' total
  batch: int = struct.field(pytree_node=False)  # B
  width: int = struct.field(pytree_node=False)  # W: the most tokens one row holds

  @property
  def size(self) -> int:
    return self.tokens.shape[0]

  def counts(self) -> jax.Array:
    """[B] int32: how many tokens each row holds."""
    return jax.ops.segment_sum(self.valid.astype(jnp.int32), self.segment, self.batch)

  def rows(self, lengths) -> tuple[jax.Array, jax.Array]:
    """(row [N], col [N]): where each token sits in the [B, W] view: its
    segment, and its offset in the row's block (pos - lengths[segment]);
    padding gets row B (out of range: dropped by a scatter)."""
    col = self.pos - lengths[self.segment]
    return jnp.where(self.valid, self.segment, self.batch), col

  def write(self, cache_arr: jax.Array, new: jax.Array) -> jax.Array:
    """cache_arr [B, K, S, D] with new [N, K, D] at (segment, :, pos) for the
    valid tokens (padding dropped)."""
    seg = jnp.where(self.valid, self.segment, self.batch)
    return cache_arr.at[seg, :, self.pos].set(new.astype(cache_arr.dtype), mode="drop")

  def to_rows(self, x: jax.Array, lengths, width: int | None = None) -> jax.Array:
    """x [N, ...] -> [B, W, ...] (zeros where a row holds no token)."""
    row, col = self.rows(lengths)
    shape = (self.batch, width or self.width) + x.shape[1:]
    return jnp.zeros(shape, x.dtype).at[row, col].set(x, mode="drop")

  def from_rows(self, y: jax.Array, lengths) -> jax.Array:
    """y [B, W, ...] -> [N, ...]: each token's entry (padding: junk)."""
    row, col = self.rows(lengths)
    return y[jnp.minimum(row, self.batch - 1), jnp.clip(col, 0, y.shape[1] - 1)]

  def row_positions(self, lengths) -> jax.Array:
    """[B, W] the positions of the view's queries: lengths + j, an empty
    entry at its row's last real position (so it reads no slot past the
    row's block, and the blocked attention visits no extra KV block)."""
    last = jnp.maximum(lengths + self.counts() - 1, 0)  # [B]
    return jnp.minimum(lengths[:, None] + jnp.arange(self.width)[None, :], last[:, None])


def pack(tokens, counts, lengths, size: int) -> Packed:
  """Lays out the first counts[b] tokens of each row of tokens [B, T] end to
  end (row 0 first) in a block of `size` entries, at positions lengths[b] ..;
  the rest is padding. Fixed shapes, traceable: counts [B] may be traced
  (1 <= counts[b] <= T, sum(counts) <= size: the caller's allocation).
  W = min(T, size - B + 1), every row holding at least its tail."""
  b, t = tokens.shape
  if size < b:
    raise ConfigError(f"a packed block of {size} tokens cannot hold {b} rows' tails: "
                      f"the budget N needs at least B = {b}")
  counts = jnp.asarray(counts, jnp.int32)
  ends = jnp.cumsum(counts)  # [B]
  i = jnp.arange(size)
  segment = jnp.minimum(jnp.searchsorted(ends, i, side="right"), b - 1).astype(jnp.int32)
  offset = i - (ends - counts)[segment]
  valid = i < ends[-1]
  offset = jnp.where(valid, offset, 0)
  return Packed(tokens=jnp.asarray(tokens, jnp.int32)[segment, jnp.clip(offset, 0, t - 1)],
                segment=segment, pos=(jnp.asarray(lengths, jnp.int32)[segment] + offset),
                valid=valid, batch=b, width=max(1, min(t, size - b + 1)))

