"""Jitted model steps with fixed shapes: prefill (bucketed), decode, forward_n,
a token tree's verify (tree_verify) and a packed block's (packed_verify).

Each step is compiled once per (config, shapes); the cache argument is donated
so XLA updates it in place. `Runner` (a config bound to its params) checks
capacity on the host before every call, because inside XLA an out-of-range
cache write would be clamped silently rather than fail.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

from specjax.model import kv_cache as kvc
from specjax.model import llama as model
from specjax.model import packed as pk
from specjax.model import sharding
from specjax.model.config import ModelConfig
from specjax.errors import CacheOverflowError, ConfigError

MIN_BUCKET = 16
# Prompts longer than this are prefilled in chunks of it: a one-shot prefill's
# attention scores grow with T^2 (a batch of 36 rows of 4 K held over 21 GB on
# the CPU); chunks bound them at T x chunk and ran a 4 K row 2x faster.
PREFILL_CHUNK = 512


def prefill_bucket(n: int) -> int:
  """The padded prompt length for an n-token prompt: a power of two >= 16."""
  return max(MIN_BUCKET, 1 << (int(n) - 1).bit_length())


@functools.partial(jax.jit, static_argnames=("cfg", "return_hidden", "hidden_layers"),
                   donate_argnames=("cache",))
def prefill_step(params, tokens, n_valid, cache: kvc.KVCache, cfg: ModelConfig,
                 return_hidden: bool = False, hidden_layers: tuple[int, ...] | None = None):
  """Prompts padded to a bucket: tokens [B, Tb], n_valid [B] real tokens per row.

  Returns (logits of each row's last real token [B, V], cache). Padding slots
  are written but lie past the new length, so they are never attended to.
  return_hidden: also the final-normed hidden states [B, Tb, E] (llama.forward;
  hidden_layers: those layers' outputs instead, concatenated).
  """
  start = cache.lengths
  out = model.forward(params, tokens, cache, cfg, logit_index=n_valid - 1,
                      return_hidden=return_hidden, hidden_layers=hidden_layers)
  logits, cache = out[0], kvc.rollback(out[1], start + n_valid)
  return (logits[:, 0], cache, out[2]) if return_hidden else (logits[:, 0], cache)


def prefill_chunks(params, tokens, lens, cache: kvc.KVCache, chunk: int, cfg: ModelConfig,
                   return_hidden: bool = False, hidden_layers: tuple[int, ...] | None = None):
  """prefill_step over the padded block tokens [B, Tb] (host) chunk by chunk:
  chunk k feeds tokens[:, k:k + chunk] at the lengths chunk k - 1 left, a row
  already done feeding padding that is rolled back. Every chunk but the last
  has `chunk` tokens; the last is cut to the block, so nothing is written past
  it (the caller sized the block to the cache). The logits of each row's last
  token are taken from its chunk. Same returns as prefill_step."""
  lens = np.asarray(lens, np.int32)
  width = tokens.shape[1]
  logits, hidden = None, []
  for k in range(0, int(lens.max()), chunk):
    part = tokens[:, k:k + min(chunk, width - k)]
    n_valid = np.clip(lens - k, 0, part.shape[1])
    out = prefill_step(params, jnp.asarray(part), jnp.asarray(n_valid), cache, cfg=cfg,
                       return_hidden=return_hidden, hidden_layers=hidden_layers)
    cache = out[1]
    mine = jnp.asarray((lens - 1) // chunk == k // chunk)[:, None]  # the row's last token is here
    logits = out[0] if logits is None else jnp.where(mine, out[0], logits)
    if return_hidden:
      hidden.append(out[2])
  if not return_hidden:
    return logits, cache
  return logits, cache, jnp.concatenate(hidden, axis=1)


@functools.partial(jax.jit, static_argnames=("cfg",), donate_argnames=("cache",))
def forward_step(params, tokens, cache: kvc.KVCache, cfg: ModelConfig):
  """T new tokens per row [B, T] -> (logits [B, T, V], cache). T=1 is decode;
  T=gamma+1 is the speculative verify shape."""
  return model.forward(params, tokens, cache, cfg)


def tree_verify(params, tokens, tree_mask, cache: kvc.KVCache, cfg: ModelConfig,
                return_hidden: bool = False, hidden_layers: tuple[int, ...] | None = None):
  """The target's verify of a token tree: one forward over the block
  tokens [B, T] = [root (the step's tail), node_0 .. node_{N-1}] at fixed
  shape, block index j at position lengths + depth[j], each attending to the
  cached slots and its own ancestors-or-self (tree_mask [T, T] bool, one
  tree for every row, or [B, T, T], a tree per row; mask[a, b]: b is a or an
  ancestor of a; llama.forward). A chain's mask (lower-triangular) is
  today's verify.

  Pure (call it inside a jitted loop; tree_verify_step is it jitted alone).
  Returns (logits [B, T, V] float32, cache[, hidden [B, T, E]]): logits[:, j]
  are the target's at block index j (the distribution of j's children); the
  cache keeps its lengths, with the block in scratch slots lengths ..
  lengths + T - 1, for kv_cache.commit_path to commit the accepted path.
  The caller checks capacity for T new slots (Runner.tree_verify does).
  """
  t = tokens.shape[1]
  if jnp.ndim(tree_mask) not in (2, 3) or jnp.shape(tree_mask)[-2:] != (t, t):
    raise ConfigError(f"a tree verify of {t} tokens needs a tree mask [{t}, {t}] or "
                      f"[B, {t}, {t}], got shape {jnp.shape(tree_mask)}")
  start = cache.lengths
  out = model.forward(params, tokens, cache, cfg, tree_mask=tree_mask,
                      return_hidden=return_hidden, hidden_layers=hidden_layers)
  return (out[0], kvc.rollback(out[1], start)) + tuple(out[2:])


tree_verify_step = jax.jit(tree_verify, static_argnames=("cfg", "return_hidden", "hidden_layers"),
                           donate_argnames=("cache",))


def packed_verify(params, packed: pk.Packed, cache: kvc.KVCache, cfg: ModelConfig,
                  return_hidden: bool = False, hidden_layers: tuple[int, ...] | None = None):
  """The target's verify of a packed block (model/packed.py): N tokens of B
  rows end to end, so the dense layers cost N tokens, not B x (gamma_max + 1);
  attention per row, over its own cache and its own block, causal.

  Pure (packed_verify_step is it jitted). Returns (logits [N, V] float32,
  cache[, hidden [N, E]]): logits[i] equal the rectangular verify's at token
  i's row and offset (padding: junk); the cache holds each row's block at
  its slots, lengths + counts (as forward_step's lengths + T: the verdict
  rolls back by length). The caller checks capacity (Runner.packed_verify).
  """
  start = cache.lengths
  out = model.forward(params, packed.tokens[None], cache, cfg, positions=packed.pos[None],
                      return_hidden=return_hidden, hidden_layers=hidden_layers, packed=packed)
  return (out[0][0], kvc.rollback(out[1], start + packed.counts())) + tuple(x[0] for x in out[2:])


packed_verify_step = jax.jit(packed_verify, static_argnames=("cfg", "return_hidden",
                                                             "hidden_layers"),
                             donate_argnames=("cache",))


@dataclasses.dataclass(frozen=True)
class Runner:
  """A config bound to its params: the host-side, capacity-checked step API
  (`llama.py` holds the pure model; this holds the jitted calls on it)."""
  cfg: ModelConfig
  params: dict

  def new_cache(self, batch: int, capacity: int) -> kvc.KVCache:
    """An empty cache, sharded like the params on the active mesh (if any)."""
    return kvc.init_cache(self.cfg, batch, capacity,
                          sharding=sharding.cache_sharding(self.params, batch))

  def prefill(self, prompts, cache: kvc.KVCache, return_hidden: bool = False,
              hidden_layers: tuple[int, ...] | None = None, chunk: int = PREFILL_CHUNK):
    """Prefills a list of B token lists (any lengths) at cache.lengths.

    Returns (last-token logits [B, V], cache), and with return_hidden the
    hidden states [B, Tb, E] of the padded block (row b's first len(prompts[b])
    are its prompt's; hidden_layers: those layers' outputs, concatenated,
    llama.forward). A block wider than `chunk` runs in chunks of `chunk`
    tokens, each at the lengths the last one left (prefill_chunks).
    """
    if len(prompts) != cache.batch:
      raise ValueError(f"{len(prompts)} prompts for a cache of batch {cache.batch}")
    lens = np.array([len(p) for p in prompts], np.int32)
    if lens.min() <= 0:
      raise CacheOverflowError("empty prompt: every row needs at least one token")
    start = sharding.to_host(cache.lengths)
    if (start + lens).max() > cache.capacity:
      raise CacheOverflowError(
          f"prompt of {lens.max()} tokens does not fit in the KV cache: "
          f"{int(start.max())} used + {lens.max()} > capacity {cache.capacity}")
    # The padded bucket is written whole; shrink it (a new shape) only when
    # the cache cannot hold the padding.
    bucket = min(prefill_bucket(lens.max()), cache.capacity - int(start.max()))
    tokens = np.zeros((len(prompts), bucket), np.int32)
    for b, p in enumerate(prompts):
      tokens[b, :len(p)] = p
    kw = {"cfg": self.cfg, "return_hidden": return_hidden, "hidden_layers": hidden_layers}
    if bucket <= chunk:
      return prefill_step(self.params, jnp.asarray(tokens), jnp.asarray(lens), cache, **kw)
    return prefill_chunks(self.params, tokens, lens, cache, chunk, **kw)

  def forward(self, tokens, cache: kvc.KVCache, lengths=None):
    """tokens [B, T] -> (logits [B, T, V], cache). `lengths` (host copy of
    cache.lengths) spares a device->host sync for the capacity check."""
    tokens = jnp.asarray(tokens, jnp.int32)
    kvc.check_capacity(cache.lengths if lengths is None else lengths,
                       tokens.shape[1], cache.capacity)
    return forward_step(self.params, tokens, cache, cfg=self.cfg)

  def tree_verify(self, tokens, tree_mask, cache: kvc.KVCache, lengths=None,
                  return_hidden: bool = False):
    """A token tree's verify, capacity-checked: tokens [B, T] = [root,
    nodes..], tree_mask [T, T] or [B, T, T] -> (logits [B, T, V], cache with
    the block in scratch slots, lengths unchanged); see tree_verify."""
    tokens = jnp.asarray(tokens, jnp.int32)
    kvc.check_capacity(cache.lengths if lengths is None else lengths,
                       tokens.shape[1], cache.capacity)
    return tree_verify_step(self.params, tokens, jnp.asarray(tree_mask, jnp.bool_), cache,
                            cfg=self.cfg, return_hidden=return_hidden)

  def packed_verify(self, packed: pk.Packed, cache: kvc.KVCache, lengths=None):
    """A packed block's verify, capacity-checked (a row's block is at most
    the block's width W slots): -> (logits [N, V], cache); see packed_verify."""
    kvc.check_capacity(cache.lengths if lengths is None else lengths, packed.width,
                       cache.capacity)
    return packed_verify_step(self.params, packed, cache, cfg=self.cfg)
