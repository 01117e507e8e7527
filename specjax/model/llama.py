"""The LLaMA model: a pure function of (params, tokens, positions, cache).

    logits, cache = forward(params, tokens, cache, cfg)

Layers are unrolled in Python over separate per-layer parameters (the
`layers_{i}` subtrees). On XLA:CPU this decodes 3-4x faster than a `lax.scan`
over stacked weights (llama-160m f32: 33-37 ms vs 116-152 ms per step), at
the price of compile time that grows with depth (llama-2-70b, 80 layers:
14-21 s for the decode step against under 1 s for the scan); see
experiments/layer_loop_bench.py and ARCHITECTURE.md.
"""

from __future__ import annotations

import functools

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from specjax.model import kv_cache as kvc
from specjax.model.config import ModelConfig
from specjax.model import quant
from specjax.errors import ConfigError
from specjax.model.layers import Block, RMSNorm, weight_init, dense, dot_general


class Llama(nn.Module):
  cfg: ModelConfig

  @nn.compact
  def __call__(self, tokens, positions, cache: kvc.KVCache, logit_index=None,
               return_hidden=False, tree_mask=None, head=True, hidden_layers=None,
               window=None, packed=None):
    # tokens, positions [B, T] -> logits [B, T, V] (f32), or [B, 1, V] at
    # logit_index [B] (prefill needs only the last real token's logits).
    # return_hidden: also the final-normed hidden state [B, T, E] of every
    # position (what the LM head reads; HF LlamaModel's output).
    # V is cfg.padded_vocab; the padded ids' logits are masked.
    # tree_mask: [T, T] or [B, T, T] bool, a token tree's verify (forward).
    # hidden_layers: the hidden returned is these layers' outputs, concatenated.
    # window: a kv_cache.Window, every layer's attention over its slots alone.
    # packed: a packed.Packed, tokens [1, N] (steps.packed_verify).
    cfg = self.cfg
    embed = nn.Embed(cfg.padded_vocab, cfg.dim, dtype=cfg.jnp_dtype,
                     param_dtype=cfg.jnp_param_dtype, embedding_init=weight_init,
                     name="embed")
    x = embed(tokens)  # [B, T, E]
    ks, vs = [], []
    outs = []  # each layer's output (hidden_layers)
    if cfg.scan_layers and not self.is_initializing() and not hidden_layers:
      x, ks, vs = scan_blocks(cfg, self.variables["params"], x, positions, cache, tree_mask,
                              window, packed)
    for i in range(0 if ks else cfg.n_layers):
      x, k, v = Block(cfg, name=f"layers_{i}")(
          x, positions, cache.k[i], cache.v[i], cache.lengths, tree_mask, window, packed)
      ks.append(k)
      vs.append(v)
      outs.append(x)
    taken = jnp.concatenate([outs[i] for i in hidden_layers], -1) if hidden_layers else None
    t = tokens.shape[1]
    new_cache = kvc.KVCache(k=tuple(ks), v=tuple(vs), lengths=cache.lengths + t)
    if not head:  # the hidden states only (a reduced-vocabulary draft applies its own head)
      normed = RMSNorm(cfg, name="final_norm")(x)
      return None, new_cache, normed if taken is None else taken
    if return_hidden:  # normed at every position, then taken (the norm is per position)
      hidden = x = RMSNorm(cfg, name="final_norm")(x)  # [B, T, E]
      hidden = hidden if taken is None else taken  # [B, T, len(hidden_layers) * E]
      if logit_index is not None:
        x = jnp.take_along_axis(x, logit_index[:, None, None], axis=1)  # [B, 1, E]
    else:
      if logit_index is not None:
        x = jnp.take_along_axis(x, logit_index[:, None, None], axis=1)  # [B, 1, E]
      x = RMSNorm(cfg, name="final_norm")(x)
    if cfg.tie_embeddings:
      table = embed.embedding.astype(cfg.jnp_dtype)  # [V, E]
      logits = dot_general(cfg)(x.astype(cfg.jnp_dtype), table,
                                (((x.ndim - 1,), (1,)), ((), ())))
    else:
      logits = dense(cfg, cfg.padded_vocab, "lm_head")(x)
    logits = mask_padded_logits(logits.astype(jnp.float32), cfg)
    if return_hidden:
      return logits, new_cache, hidden
    return logits, new_cache


def scan_blocks(cfg: ModelConfig, params, x, positions, cache: kvc.KVCache, tree_mask,
                window=None, packed=None):
  """The layers as one lax.scan (cfg.scan_layers): the per-layer params and
  caches stacked along a new leading axis L, one Block applied per step, the
  caches unstacked after. The params keep their per-layer layout (every
  loader and the sharding table read it); their stack is loop-invariant, so
  XLA hoists it out of a decode loop, while the caches' stack and unstack are
  copies in every forward. Same logits as the unrolled layers; whether it
  cuts a GPU step's launches is measured (gpu_check's levers part).
  Returns (x, ks, vs), ks and vs L x [B, K, S, D]."""
  stacked = jax.tree_util.tree_map(lambda *a: jnp.stack(a),
                                   *[params[f"layers_{i}"] for i in range(cfg.n_layers)])
  block = Block(cfg, parent=None)  # unbound: applied to each layer's slice

  def body(h, layer):
    p, k, v = layer
    h, k, v = block.apply({"params": p}, h, positions, k, v, cache.lengths, tree_mask, window,
                          packed)
    return h, (k, v)

  x, (ks, vs) = jax.lax.scan(body, x, (stacked, jnp.stack(cache.k), jnp.stack(cache.v)))
  return x, list(ks), list(vs)


# ------------------------------------------------------- the padded vocabulary
#
# On a mesh whose model axis does not divide the vocabulary, the embedding
# [V, E] and the LM head [E, V] hold cfg.padded_vocab rows / columns (zeros
# past vocab_size; ModelConfig.padded_vocab, sharding.pad_vocab) so that the
# one partition table splits them evenly. The model's logits keep the padded
# width, the padded columns at MASKED_LOGIT, rather than being sliced to
# vocab_size: they are split on V over the model axis, and an array of
# vocab_size columns cannot be (jax wants even shards), so a slice would
# gather every step's logits onto every device, while the mask is an
# elementwise select on each shard, with no communication. Every consumer
# (sampling.probs, the argmax of greedy paths, the acceptance test, the
# drafters) then sees padded ids with probability exactly 0; a speculative
# pair is padded alike (sharding.pad_vocab pads by the mesh, not the role).

# The logit of a padded id: finite, so that where a distribution meets its
# log (a KL, a cross-entropy: train/) 0 * log 0 stays 0 and not NaN as with
# -inf, and so far below any real logit that softmax gives it exactly 0 (and
# a temperature below 0.7 turns it into -inf, which softmax also takes).
MASKED_LOGIT = -0.7 * float(np.finfo(np.float32).max)

# The params with a vocabulary axis, by path, and that axis.
VOCAB_AXES = {("embed", "embedding"): 0, ("lm_head", "kernel"): 1,
              ("lm_head", "kernel_q"): 1, ("lm_head", "kernel_scale"): 0}


def mask_padded_logits(logits, cfg: ModelConfig):
  """logits [..., padded_vocab] with the padded ids' columns at MASKED_LOGIT
  (no-op when nothing is padded)."""
  if cfg.padded_vocab == cfg.vocab_size:
    return logits
  real = jnp.arange(cfg.padded_vocab) < cfg.vocab_size  # [V]
  return jnp.where(real, logits, jnp.asarray(MASKED_LOGIT, logits.dtype))


def resize_vocab(params, rows: int):
  """`params` with the vocabulary axis of the embedding and LM head params
  (VOCAB_AXES) cut or zero-padded to `rows`; every other leaf as it is (the
  same array). Arrays of any kind (numpy, jax, traced)."""
  def one(path, x):
    axis = VOCAB_AXES.get(tuple(str(getattr(k, "key", k)) for k in path)[-2:])
    if axis is None or x.shape[axis] == rows:
      return x
    if x.shape[axis] > rows:
      return jax.lax.slice_in_dim(x, 0, rows, axis=axis)
    pad = [(0, 0)] * x.ndim
    pad[axis] = (0, rows - x.shape[axis])
    return jnp.pad(x, pad)
  return jax.tree_util.tree_map_with_path(one, params)


def strip_vocab(cfg: ModelConfig, params):
  """(cfg, params) without the vocabulary padding, as they are saved: the
  config with vocab_multiple 1, the embedding and LM head cut to vocab_size
  (on a mesh the two cut arrays come back replicated: a V-split of
  vocab_size rows does not exist)."""
  if cfg.padded_vocab == cfg.vocab_size:
    return cfg.replace(vocab_multiple=1), params
  return cfg.replace(vocab_multiple=1), resize_vocab(params, cfg.vocab_size)


def _random_params(cfg: ModelConfig, key):
  if cfg.padded_vocab != cfg.vocab_size:  # the unpadded model's values, zero-padded
    return resize_vocab(_random_params(cfg.replace(vocab_multiple=1), key), cfg.padded_vocab)
  if cfg.quant:  # the float model's random weights, quantized
    return quant.quantize_params(_random_params(cfg.replace(quant=None), key))
  cache = kvc.init_cache(cfg, 1, 1)
  tokens = jnp.zeros((1, 1), jnp.int32)
  return Llama(cfg).init(key, tokens, tokens, cache)["params"]


_random_params_plain = jax.jit(_random_params, static_argnums=0)


def init_params(cfg: ModelConfig, seed: int = 0, shardings=None):
  """Random parameters for `cfg` (normal(0.02) weights, unit norms).

  Jitted (once per config) so that only the final arrays are materialised,
  which matters at 7B+; with `shardings` (a tree of NamedShardings, see
  sharding.role_shardings) each device materialises only its own shards.
  The values do not depend on the shardings, nor on the vocabulary padding
  (the padded rows are zeros).
  """
  key = jax.random.PRNGKey(seed)
  if shardings is None:
    return _random_params_plain(cfg, key)
  return jax.jit(functools.partial(_random_params, cfg), out_shardings=shardings)(key)



def forward(params, tokens, cache: kvc.KVCache, cfg: ModelConfig, positions=None,
            logit_index=None, return_hidden=False, tree_mask=None, head=True,
            hidden_layers=None, window=None, packed=None):
  """Runs T new tokens per row against the cache.

  Args:
    params: the `params` collection of `Llama(cfg)`.
    tokens: [B, T] int token ids; row b is written at slots cache.lengths[b]..
    cache: KV cache; its capacity must fit lengths + T (see kv_cache.check_capacity).
    cfg: the model config (static under jit).
    positions: [B, T] absolute positions; defaults to lengths[:, None] + arange(T).
    logit_index: optional [B] index into T; then only those logits are computed.
    return_hidden: also return the final-normed hidden state of every input
      position (the LM head's input, HF LlamaModel's output), from the same
      pass: `head_logits(params, hidden, cfg)` gives the logits back.
    tree_mask: optional bool [T, T] (one tree for all rows) or [B, T, T] (a
      tree per row): the T tokens are a token tree's verify block [root,
      node_0 ..] (tree_mask[a, b]: b is a or an ancestor of a). Each token
      attends to the cached slots < lengths and to its ancestors-or-self;
      positions then default to lengths + depth, the depth being the mask
      row's count of ancestors. The block is written at slots lengths ..
      lengths + T - 1 all the same (see steps.tree_verify and
      kv_cache.commit_path). A mask [.., T, W] with W > T: the tokens are
      the last T of a W-wide block whose first W - T entries an earlier
      forward wrote just before lengths (a draft tree's next level; mask
      rows are theirs, columns the whole block). None: the causal chain,
      unchanged.
    head: False skips the LM head: (None, cache, hidden [B, T, E]).
    hidden_layers: a tuple of layer indices (EAGLE-3's low, middle and high
      features): the hidden returned is then the concatenation of those
      layers' outputs (the residual stream after each, not normed)
      [B, T, len * E]; the layers run unrolled. None: the final-normed state.
    window: optional kv_cache.Window: each token attends to its slots alone
      (the sinks, the recent window, the fed span; a streaming draft), still
      written at lengths and rotated at `positions` (layers.attend_window).
    packed: optional packed.Packed: tokens [1, N] and positions [1, N] are its
      block (steps.packed_verify); each row's tokens at its own slots, the
      returned cache's lengths + N meaningless (the caller sets them).
  Returns:
    (logits [B, T, V] (or [B, 1, V]) float32, cache with lengths + T), and
    hidden [B, T, E] (cfg.dtype) last when return_hidden.
  """
  if positions is None and tree_mask is not None:  # the block starts W - T slots back
    prior = jnp.shape(tree_mask)[-1] - tokens.shape[1]
    positions = cache.lengths[:, None] - prior + tree_depths(tree_mask)
  if positions is None:
    positions = cache.lengths[:, None] + jnp.arange(tokens.shape[1])[None, :]
  if hidden_layers is not None:
    hidden_layers = tuple(int(i) for i in hidden_layers)
    if not hidden_layers or not all(0 <= i < cfg.n_layers for i in hidden_layers):
      raise ConfigError(f"hidden_layers {hidden_layers}: need layer indices in "
                        f"0..{cfg.n_layers - 1}")
  return Llama(cfg).apply({"params": params}, tokens, positions, cache,
                          logit_index, return_hidden, tree_mask, head, hidden_layers, window,
                          packed)


def tree_depths(tree_mask):
  """The depth of each block index (root 0) from a tree mask [T, W] -> [1, T]
  or [B, T, W] -> [B, T]: its ancestors-or-self count less one."""
  mask = jnp.asarray(tree_mask, jnp.bool_)
  mask = mask[None] if mask.ndim == 2 else mask
  return jnp.sum(mask, -1, dtype=jnp.int32) - 1


def embed_tokens(params, tokens, cfg: ModelConfig):
  """The model's input embedding of tokens [B, T] -> [B, T, E] (cfg.dtype)."""
  return nn.Embed(cfg.padded_vocab, cfg.dim, dtype=cfg.jnp_dtype,
                  param_dtype=cfg.jnp_param_dtype).apply(
                      {"params": params["embed"]}, tokens)


def head_logits(params, hidden, cfg: ModelConfig):
  """The model's LM head on final-normed hidden states [..., E] -> float32
  logits [..., V]: the same product as the forward's (tied embedding or
  lm_head, int8 included), with the model's own weights (no copy), and the
  same mask on padded ids (V = cfg.padded_vocab)."""
  if cfg.tie_embeddings:
    table = params["embed"]["embedding"].astype(cfg.jnp_dtype)  # [V, E]
    logits = dot_general(cfg)(hidden.astype(cfg.jnp_dtype), table,
                              (((hidden.ndim - 1,), (1,)), ((), ())))
  else:
    logits = dense(cfg, cfg.padded_vocab, "lm_head").apply(
        {"params": params["lm_head"]}, hidden)
  return mask_padded_logits(logits.astype(jnp.float32), cfg)


def param_count(params) -> int:
  return sum(x.size for x in jax.tree_util.tree_leaves(params))


def param_bytes(params) -> int:
  return sum(x.nbytes for x in jax.tree_util.tree_leaves(params))
