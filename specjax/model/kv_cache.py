"""Preallocated KV cache: a plain pytree passed into the model and returned.

Per layer a key and a value array [B, K, S, D] (kv heads before slots:
attention is a batched product over (B, K) with no transpose), plus
`lengths[B]`, the valid positions of each row; slot j holds position j.
Invariants (ARCHITECTURE.md, "Invariants"; tests/model/test_model.py):
  * a write of T new tokens lands at slots lengths[b] .. lengths[b] + T - 1;
  * a query at position p attends to slots <= p only, so nothing at or past
    a row's length is read before it is overwritten (a token tree's verify:
    the slots < length and its ancestors in the block; `commit_path` then
    moves the accepted path into place);
  * rolling back is setting `lengths` (O(1), no copy);
  * capacity is checked on the host *before* a write (`check_capacity`):
    dynamic_update_slice clamps out-of-range starts, silently.
One array per layer (the model is unrolled); a `Window` views a few slots.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from specjax.model.config import ModelConfig
from specjax.errors import CacheOverflowError


@struct.dataclass
class KVCache:
  k: tuple[jax.Array, ...]  # L x [B, K, S, D]
  v: tuple[jax.Array, ...]  # L x [B, K, S, D]
  lengths: jax.Array        # [B] int32, valid positions per row

  @property
  def capacity(self) -> int:
    return self.k[0].shape[2]

  @property
  def batch(self) -> int:
    return self.k[0].shape[0]

  def nbytes(self) -> int:
    return sum(x.nbytes for x in self.k + self.v)


def init_cache(cfg: ModelConfig, batch: int, capacity: int,
               dtype=None, sharding=None) -> KVCache:
  """An empty cache of `capacity` slots per row, in the compute dtype.

  `sharding` (a NamedSharding of one [B, K, S, D] array, see
  sharding.cache_sharding) allocates every device's shard in place, at the
  full capacity; `lengths` are then replicated on the same mesh.
  """
  if capacity <= 0 or batch <= 0:
    raise CacheOverflowError(f"cache needs batch>0 and capacity>0, got "
                             f"batch={batch}, capacity={capacity}")
  dtype = dtype or cfg.jnp_dtype
  shape = (batch, cfg.n_kv_heads, capacity, cfg.d_head)  # [B, K, S, D]
  zeros = lambda: tuple(jnp.zeros(shape, dtype, device=sharding)
                        for _ in range(cfg.n_layers))
  lengths_sharding = (None if sharding is None else
                      jax.sharding.NamedSharding(sharding.mesh, jax.sharding.PartitionSpec()))
  return KVCache(k=zeros(), v=zeros(),
                 lengths=jnp.zeros((batch,), jnp.int32, device=lengths_sharding))


CAPACITY_ROUND = 16  # capacities are rounded up to a multiple of this (fewer shapes)


def round_capacity(n_slots: int) -> int:
  """n_slots rounded up to a multiple of CAPACITY_ROUND."""
  return -(-int(n_slots) // CAPACITY_ROUND) * CAPACITY_ROUND


def rollback(cache: KVCache, lengths) -> KVCache:
  """Forgets everything at or past `lengths[b]` in each row (no copy)."""
  lengths = jnp.broadcast_to(jnp.asarray(lengths, jnp.int32), cache.lengths.shape)
  return cache.replace(lengths=lengths)


def check_capacity(lengths, n_new: int, capacity: int) -> None:
  """Raises CacheOverflowError if writing n_new tokens at `lengths` overflows.

  `lengths` is a host value (numpy or list) or a device array (fetched).
  """
  longest = int(np.max(np.asarray(lengths)))
  if longest + n_new > capacity:
    raise CacheOverflowError(
        f"KV cache overflow: writing {n_new} token(s) at position {longest} "
        f"needs {longest + n_new} slots but the cache holds {capacity}")


def write(cache_arr: jax.Array, new: jax.Array, lengths: jax.Array) -> jax.Array:
  """Writes new[b] ([T, K, D]) at slots lengths[b].. of row b of cache_arr."""
  # cache_arr [B, K, S, D], new [B, T, K, D], lengths [B]
  new = jnp.swapaxes(new, 1, 2).astype(cache_arr.dtype)  # [B, K, T, D]: small
  if cache_arr.shape[0] == 1:  # one row: a plain in-place update slice
    return jax.lax.dynamic_update_slice(cache_arr, new, (0, 0, lengths[0], 0))
  upd = lambda c, n, l: jax.lax.dynamic_update_slice(c, n, (0, l, 0))
  return jax.vmap(upd)(cache_arr, new, lengths)


@struct.dataclass
class Window:
  """A sparse view of each row's cache (StreamingLLM's attention, the
  streaming draft's): the first `sinks` slots and the last `size` slots
  before `start[b]` (the step's kept length), then `span` slots from
  `start[b]` on (the step's fed tokens). Slot j still holds position j, so
  which gathered slot a query sees is decided by its slot index, as in the
  full cache; a slot that is not real (past the capacity, a sink past the
  row's length, a recent slot that is also a sink) is never seen."""
  start: jax.Array                                 # [B]
  sinks: int = struct.field(pytree_node=False)     # S
  size: int = struct.field(pytree_node=False)      # W
  span: int = struct.field(pytree_node=False)      # fed slots

  def slots(self, capacity: int) -> tuple[jax.Array, jax.Array]:
    """(slots [B, n] clipped into the cache, real [B, n] bool), n = sinks +
    size + span: the sinks, then start - size .. start + span - 1."""
    start = self.start[:, None]  # [B, 1]
    cut = jnp.minimum(self.sinks, start)  # [B, 1]: sinks < cut are real
    sinks = jnp.broadcast_to(jnp.arange(self.sinks)[None, :], (start.shape[0], self.sinks))
    recent = start - self.size + jnp.arange(self.size + self.span)[None, :]
    slots = jnp.concatenate([sinks, recent], 1)
    real = jnp.concatenate([sinks < cut, (recent >= cut) & (recent < capacity)], 1)
    return jnp.clip(slots, 0, capacity - 1), real


def commit_path(cache: KVCache, path, n_accepted) -> KVCache:
  """Commits a token tree's accepted path: the K/V a tree verify left in
  scratch slots moved into contiguous ones, then the lengths set.

  `cache` is the cache as the verify left it (steps.tree_verify): lengths at
  the step's start, the verify block [root, node_0 ..] at slots lengths ..
  lengths + T - 1, so block index j sits at slot lengths + j; the root (the
  step's tail) is already where it belongs. path [B, P] int: the block
  indices (1 .. T-1) of the accepted nodes in order, root excluded (entries
  past a row's n_accepted are ignored); n_accepted [B] in -1 .. P. Node k of
  the path moves to slot lengths + 1 + k, for k < n_accepted, in every
  layer (a gather of P slots per row: fixed shapes); the lengths become
  lengths + 1 + n_accepted (-1 keeps nothing, not even the root). Slots
  past the new length keep whatever they held (never read).

  Any KVCache: the target's, or a draft model's (layer list or not) that
  verified the same block at the same lengths.
  """
  path = jnp.asarray(path, jnp.int32)  # [B, P]
  n_accepted = jnp.broadcast_to(jnp.asarray(n_accepted, jnp.int32), cache.lengths.shape)
  p = path.shape[1]
  if p == 0:
    return rollback(cache, cache.lengths + 1 + n_accepted)
  s_cap = cache.capacity
  src = jnp.clip(cache.lengths[:, None] + path, 0, s_cap - 1)  # [B, P]
  dst = jnp.clip(cache.lengths[:, None] + 1 + jnp.arange(p)[None, :], 0, s_cap - 1)
  take = (jnp.arange(p)[None, :] < n_accepted[:, None])[:, None, :, None]  # [B, 1, P, 1]

  def move(arr):  # [B, K, S, D]: the path's K/V at slots lengths + 1 ..
    at = lambda slots: jnp.take_along_axis(arr, slots[:, None, :, None], axis=2)
    moved = jnp.where(take, at(src), at(dst))  # [B, K, P, D]
    return write(arr, jnp.swapaxes(moved, 1, 2), cache.lengths + 1)

  return KVCache(k=tuple(move(a) for a in cache.k), v=tuple(move(a) for a in cache.v),
                 lengths=cache.lengths + 1 + n_accepted)
