"""LLaMA building blocks as Flax linen modules: RMSNorm, RoPE, GQA attention, SwiGLU.

No mutable collections: the attention layer takes its slice of the KV cache
as an argument and returns the updated slice.
"""

from __future__ import annotations

import math

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from specjax.model import kv_cache
from specjax.model.config import ModelConfig
from specjax.model import sharding

weight_init = nn.initializers.normal(stddev=0.02)


def dot_general(cfg: ModelConfig):
  """The matmul of every projection: lax.dot_general, or with cfg.dot_dtype
  operands accumulated in cfg.dtype.

  In that mixed mode a single-row product (a batch-1 decode step) is padded
  to two rows on CPU: XLA:CPU's one-row bf16 product takes a slow path, about
  2.4x the time of two rows (experiments/dot_bench.py), while two rows read
  the weights once, as one row does.
  """
  if cfg.dot_dtype is None or cfg.dot_dtype == cfg.dtype:
    return jax.lax.dot_general
  op_dtype, acc_dtype = jnp.dtype(cfg.dot_dtype), cfg.jnp_dtype

  def mixed(lhs, rhs, dims, precision=None, preferred_element_type=None):
    del preferred_element_type
    lhs, rhs = lhs.astype(op_dtype), rhs.astype(op_dtype)
    pad = lhs.ndim >= 2 and int(np.prod(lhs.shape[:-1])) == 1 and \
        jax.default_backend() == "cpu"
    if pad:
      lhs = jnp.concatenate([lhs, lhs], axis=-2)
    out = jax.lax.dot_general(lhs, rhs, dims, precision=precision,
                              preferred_element_type=acc_dtype)
    return out[..., :1, :] if pad else out
  return mixed


# On CPU an int8 kernel is converted and multiplied chunk by chunk (about
# 512 KB of float32 each) in a rolled loop: XLA:CPU does not fuse the convert
# into the product, so a whole-kernel convert writes and re-reads a float
# copy of every kernel each step (and the scheduler keeps them all alive at
# once); a chunk stays in cache between its convert and its product. Chunk
# sizes of 2^16-2^18 elements decode llama-160m alike on a 2-core EPYC, 2^20
# is slower (experiments/gguf_bench.py).
INT8_CHUNK = 1 << 17


def _n_chunks(n: int, size: int) -> int:
  """The smallest divisor c of n with size / c <= INT8_CHUNK (else n)."""
  for c in range(max(1, -(-size // INT8_CHUNK)), n + 1):
    if n % c == 0:
      return c
  return n


def int8_matmul(x, kq, scale, dtype):
  """(x @ kq.astype(dtype)) * scale, x [..., in], kq int8 [in, out], scale [out].

  On one CPU device, in chunks of the larger of in / out (INT8_CHUNK); else
  one convert next to its product, which GPU backends fuse. The kernel is
  tied to x (an optimization barrier): in a loop (the device decode and
  speculative loops) XLA would otherwise hoist the loop-invariant convert
  out of the loop and hold a float copy of every kernel for the whole call.
  """
  x = x.astype(dtype)
  n_in, n_out = kq.shape
  axis = 1 if n_out >= n_in else 0
  c = _n_chunks(kq.shape[axis], kq.size)
  if c == 1 or jax.default_backend() != "cpu" or sharding.current() is not None:
    x, kq = jax.lax.optimization_barrier((x, kq))
    return jnp.matmul(x, kq.astype(dtype)) * scale.astype(dtype)
  w = kq.shape[axis] // c
  last = x.ndim - 1
  if axis == 1:  # split the output columns (the lm_head, q/k/v, gate/up)
    def body(i, y):
      part = jnp.matmul(x, jax.lax.dynamic_slice_in_dim(kq, i * w, w, 1).astype(dtype))
      return jax.lax.dynamic_update_slice_in_dim(y, part, i * w, last)
  else:  # split the contraction (o, down): contiguous rows, partial sums
    def body(i, y):
      xi = jax.lax.dynamic_slice_in_dim(x, i * w, w, last)
      return y + jnp.matmul(xi, jax.lax.dynamic_slice_in_dim(kq, i * w, w, 0).astype(dtype))
  y = jax.lax.fori_loop(0, c, body, jnp.zeros(x.shape[:-1] + (n_out,), dtype))
  return y * scale.astype(dtype)


class QDense(nn.Module):
  """Weight-only int8 projection: kernel_q int8 [in, out] and kernel_scale
  float32 [out] (one scale per output channel, model/quant.py);
  y = (x @ kernel_q) * scale in cfg.dtype (int8_matmul). The int8 kernel is
  what lives in device memory; its float conversion is transient."""
  features: int
  cfg: ModelConfig

  @nn.compact
  def __call__(self, x):
    kq = self.param("kernel_q", nn.initializers.zeros_init(),
                    (x.shape[-1], self.features), jnp.int8)
    scale = self.param("kernel_scale", nn.initializers.ones, (self.features,), jnp.float32)
    return int8_matmul(x, kq, scale, self.cfg.jnp_dtype)


def dense(cfg: ModelConfig, features: int, name: str) -> nn.Module:
  """A bias-free projection: nn.Dense, or QDense when cfg.quant is 'int8'."""
  if cfg.quant:
    return QDense(features, cfg, name=name)
  return nn.Dense(features, use_bias=False, dtype=cfg.jnp_dtype,
                  param_dtype=cfg.jnp_param_dtype, kernel_init=weight_init, name=name,
                  dot_general=dot_general(cfg))


class RMSNorm(nn.Module):
  """x / rms(x) * scale, computed in f32 (as HF's LlamaRMSNorm)."""
  cfg: ModelConfig

  @nn.compact
  def __call__(self, x: jax.Array) -> jax.Array:
    scale = self.param("scale", nn.initializers.ones, (x.shape[-1],),
                       self.cfg.jnp_param_dtype)
    x32 = x.astype(jnp.float32)
    x32 = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, -1, keepdims=True)
                              + self.cfg.norm_eps)
    return scale.astype(self.cfg.jnp_dtype) * x32.astype(self.cfg.jnp_dtype)


def rope_inv_freq(cfg: ModelConfig) -> np.ndarray:
  """RoPE inverse frequencies [D/2], with LLaMA-3 scaling when configured."""
  d = cfg.d_head
  inv = 1.0 / (cfg.rope_theta ** (np.arange(0, d, 2, dtype=np.float64) / d))
  rs = cfg.rope_scaling
  if rs is None:
    return inv.astype(np.float32)
  # Llama 3: long wavelengths are slowed by `factor`, short ones kept, and
  # the band in between interpolated smoothly.
  low_wavelen = rs.original_max_position / rs.low_freq_factor
  high_wavelen = rs.original_max_position / rs.high_freq_factor
  wavelen = 2 * math.pi / inv
  scaled = np.where(wavelen > low_wavelen, inv / rs.factor, inv)
  smooth = ((rs.original_max_position / wavelen - rs.low_freq_factor)
            / (rs.high_freq_factor - rs.low_freq_factor))
  smoothed = (1 - smooth) * scaled / rs.factor + smooth * scaled
  medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
  return np.where(medium, smoothed, scaled).astype(np.float32)


def apply_rope(x: jax.Array, positions: jax.Array, inv_freq: np.ndarray) -> jax.Array:
  """Rotates x [B, T, N, D] by positions [B, T] (HF 'rotate_half' convention)."""
  freqs = positions[..., None].astype(jnp.float32) * inv_freq  # [B, T, D/2]
  cos = jnp.cos(freqs)[:, :, None, :].astype(x.dtype)  # [B, T, 1, D/2]
  sin = jnp.sin(freqs)[:, :, None, :].astype(x.dtype)
  x1, x2 = jnp.split(x, 2, axis=-1)
  return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)


def weigh_values(probs, values):
  """probs [B, K, G, T, n] x values [B, K, n, D] -> [B, T, K, G, D]: the
  product with (B, K) leading and its output [B, K, G, T, D], the small
  output transposed after. Asked for [B, T, K, G, D] directly, XLA:CPU's
  dot took 4x as long (7.5 against 1.8 ms at B 8, K 3, G 3, 4,112 slots;
  docs/long_context.md, "XLA's attention on CPU")."""
  out = jnp.einsum("bkgts,bksd->bkgtd", probs, values)
  return jnp.transpose(out, (0, 3, 1, 2, 4))


def attend_masked(q, k_cache, v_cache, positions, dtype, tree=None):
  """Attention of q over every cache slot, masked to slots <= each position.

  q [B, T, K, G, D]; k_cache, v_cache [B, K, S, D]; positions [B, T].
  Returns [B, T, K, G, D]. Cost grows with the capacity S; differentiable.
  With `tree` (a Tree block, see tree_block), q sees the cached slots
  < lengths and, of the new block, its tree mask (one extra masked block).
  """
  scores = jnp.einsum("btkgd,bksd->bkgts", q, k_cache,
                      preferred_element_type=jnp.float32) / math.sqrt(q.shape[-1])
  slots = jnp.arange(k_cache.shape[2])
  if tree is not None:
    return _attend_masked_tree(q, scores, v_cache, tree, dtype)
  mask = slots[None, None, :] <= positions[:, :, None]  # [B, T, S]
  scores = jnp.where(mask[:, None, None], scores, -jnp.inf)
  probs = jax.nn.softmax(scores, axis=-1).astype(dtype)
  return weigh_values(probs, v_cache)


@struct.dataclass
class TreeBlock:
  """The new tokens of a tree verify, as attention sees them: their own K/V
  (k, v [B, K, T, D], in the cache's dtype; the same values the write puts
  at slots lengths .. lengths + T - 1), the tree mask [B or 1, T, T] (mask[a, b]:
  block index b is a or an ancestor of a), and the cached lengths [B]."""
  k: jax.Array
  v: jax.Array
  mask: jax.Array
  lengths: jax.Array


def tree_block(kk, vv, tree_mask, lengths, k_cache, v_cache) -> TreeBlock:
  """A TreeBlock from the new K/V kk, vv [B, T, K, D] and a tree mask [T, W]
  (one tree for every row) or [B, T, W] (a tree per row).

  W = T: the block is the new tokens (a verify). W > T: the new tokens are
  the last T of a W-wide block whose first W - T entries an earlier forward
  wrote at slots lengths - (W - T) .. lengths - 1 (a tree drafted level by
  level); those are read back from the cache, and only the slots before the
  block count as cached."""
  mask = jnp.asarray(tree_mask, jnp.bool_)
  mask = mask[None] if mask.ndim == 2 else mask  # [B or 1, T, W]
  to_block = lambda x: jnp.swapaxes(x, 1, 2).astype(k_cache.dtype)  # [B, K, T, D]
  k_new, v_new = to_block(kk), to_block(vv)
  prior = mask.shape[-1] - kk.shape[1]
  if prior == 0:
    return TreeBlock(k=k_new, v=v_new, mask=mask, lengths=lengths)
  start = lengths - prior  # [B]
  slots = jnp.clip(start[:, None] + jnp.arange(prior)[None, :], 0, k_cache.shape[2] - 1)
  read = lambda c: jnp.take_along_axis(c, slots[:, None, :, None], axis=2)  # [B, K, prior, D]
  return TreeBlock(k=jnp.concatenate([read(k_cache), k_new], 2),
                   v=jnp.concatenate([read(v_cache), v_new], 2), mask=mask, lengths=start)


def _attend_masked_tree(q, scores, v_cache, tree: TreeBlock, dtype):
  """attend_masked's tree case: one softmax over [cached slots ; new block]."""
  s_cap = scores.shape[-1]
  cached = jnp.arange(s_cap)[None, :] < tree.lengths[:, None]  # [B, S]
  scores = jnp.where(cached[:, None, None, None], scores, -jnp.inf)  # [B, K, G, T, S]
  new = jnp.einsum("btkgd,bkjd->bkgtj", q, tree.k,
                   preferred_element_type=jnp.float32) / math.sqrt(q.shape[-1])
  new = jnp.where(tree.mask[:, None, None], new, -jnp.inf)  # [B, K, G, T, T]
  probs = jax.nn.softmax(jnp.concatenate([scores, new], -1), axis=-1).astype(dtype)
  return (weigh_values(probs[..., :s_cap], v_cache)
          + weigh_values(probs[..., s_cap:], tree.v.astype(v_cache.dtype)))


def attend_blocked(q, k_cache, v_cache, positions, block: int, dtype, tree=None):
  """The same attention over KV blocks of `block` slots with an online
  softmax, visiting only the blocks that hold used slots: a loop whose trip
  count is ceil((max position + 1) / block), so the cost follows the longest
  used length in the batch, not the capacity (fixed shapes, no recompile as
  the length grows). Accumulates in f32. Forward only (a while loop).

  With `tree` (a TreeBlock), the loop visits the cached slots < lengths only
  (ceil(max length / block) blocks) and the new tokens' block follows as one
  extra block under the tree mask.

  q [B, T, K, G, D]; k_cache, v_cache [B, K, S, D]; positions [B, T].
  """
  b, t, k, g, d = q.shape
  s_cap = k_cache.shape[2]
  q = q.astype(jnp.float32) / math.sqrt(d)
  if tree is None:
    n_blocks = (jnp.max(positions) + block) // block
    visible = lambda slots: slots[None, None, :] <= positions[:, :, None]  # [B, T, blk]
  else:
    n_blocks = (jnp.max(tree.lengths) + block - 1) // block
    visible = lambda slots: (slots[None, :] < tree.lengths[:, None])[:, None, :]  # [B, 1, blk]

  def fold(carry, scores, vb):
    # One block's scores [B,K,G,T,n] (masked: -inf) and values [B,K,n,D]
    # into the running max, sum and output.
    m, l, acc = carry  # [B,K,G,T], [B,K,G,T], [B,K,G,T,D]
    m_new = jnp.maximum(m, jnp.max(scores, -1))
    if tree is not None:  # a row with no cached slot yet: all -inf so far
      m_new = jnp.where(jnp.isfinite(m_new), m_new, 0.0)
    p = jnp.exp(scores - m_new[..., None])
    scale = jnp.exp(m - m_new)
    acc = acc * scale[..., None] + jnp.einsum("bkgts,bksd->bkgtd", p, vb,
                                             preferred_element_type=jnp.float32)
    return m_new, l * scale + jnp.sum(p, -1), acc

  def body(i, carry):
    # The last block may be cut by the capacity: read the slots before it
    # again, masked out (they belong to the previous block).
    start = jnp.minimum(i * block, s_cap - block)
    kb = jax.lax.dynamic_slice_in_dim(k_cache, start, block, 2)  # [B, K, blk, D]
    vb = jax.lax.dynamic_slice_in_dim(v_cache, start, block, 2)
    scores = jnp.einsum("btkgd,bksd->bkgts", q, kb, preferred_element_type=jnp.float32)
    slots = start + jnp.arange(block)
    mask = visible(slots) & (slots >= i * block)[None, None]
    scores = jnp.where(mask[:, None, None], scores, -jnp.inf)
    return fold(carry, scores, vb)

  init = (jnp.full((b, k, g, t), -jnp.inf, jnp.float32), jnp.zeros((b, k, g, t), jnp.float32),
          jnp.zeros((b, k, g, t, d), jnp.float32))
  carry = jax.lax.fori_loop(0, n_blocks, body, init)
  if tree is not None:  # the new tokens' block, under the tree mask
    scores = jnp.einsum("btkgd,bkjd->bkgtj", q, tree.k, preferred_element_type=jnp.float32)
    scores = jnp.where(tree.mask[:, None, None], scores, -jnp.inf)  # [B, K, G, T, T]
    carry = fold(carry, scores, tree.v)
  _, l, acc = carry
  return jnp.transpose(acc / l[..., None], (0, 3, 1, 2, 4)).astype(dtype)


def cache_mask(positions, s_cap: int, tree: TreeBlock | None = None, slots=None):
  """Which cache slots each new token sees, bool [B, T, S]: slots <= its
  position (a chain); with `tree`, the cached slots before the block's start
  (the TreeBlock's lengths) and, of the block from there (written before
  attending, see tree_block), its row of the tree mask. `slots` [B, n]:
  the same for those slot indices (a Window's) instead of 0 .. S - 1."""
  slots = jnp.arange(s_cap)[None, :] if slots is None else slots  # [1 or B, S]
  if tree is None:
    return slots[:, None, :] <= positions[:, :, None]
  j = slots - tree.lengths[:, None]  # [B, S]: index in the block
  mask = jnp.broadcast_to(tree.mask, (j.shape[0],) + tree.mask.shape[1:])  # [B, T, W]
  w = mask.shape[-1]
  cols = jnp.broadcast_to(jnp.clip(j, 0, w - 1)[:, None, :], mask.shape[:2] + j.shape[-1:])
  in_block = jnp.take_along_axis(mask, cols, axis=2) & ((j >= 0) & (j < w))[:, None, :]
  return (j < 0)[:, None, :] | in_block


def attend_window(q, k_cache, v_cache, positions, window: kv_cache.Window, dtype, tree=None):
  """Attention over a Window's slots alone: their K/V gathered per row into
  a compact [B, K, n, D] view (n = sinks + size + span), masked by the slot
  each entry came from (cache_mask) and whether it is real, so the cost is
  flat in the cache's length. The cache holds K rotated at its own
  position: the view needs no RoPE. q [B, T, K, G, D] -> [B, T, K, G, D]."""
  slots, real = window.slots(k_cache.shape[2])  # [B, n]
  view = lambda c: jnp.take_along_axis(c, slots[:, None, :, None], axis=2)  # [B, K, n, D]
  mask = cache_mask(positions, k_cache.shape[2], tree, slots) & real[:, None, :]  # [B, T, n]
  scores = jnp.einsum("btkgd,bknd->bkgtn", q, view(k_cache),
                      preferred_element_type=jnp.float32) / math.sqrt(q.shape[-1])
  scores = jnp.where(mask[:, None, None], scores, -jnp.inf)
  probs = jax.nn.softmax(scores, axis=-1).astype(dtype)
  return weigh_values(probs, view(v_cache))


def fused_implementation(dtype) -> str:
  """jax.nn.dot_product_attention's implementation: cuDNN's fused kernel on
  a GPU for 16-bit operands (it takes no float32), XLA's otherwise."""
  half = jnp.dtype(dtype) in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))
  return "cudnn" if half and jax.default_backend() == "gpu" else "xla"


def attend_fused(q, k_cache, v_cache, mask, dtype):
  """attend_masked through jax.nn.dot_product_attention (the 'fused' kind).

  q [B, T, K, G, D]; k_cache, v_cache [B, K, S, D]; mask [B, T, S] (cache_mask).
  Its layout is [B, S, K, D]: the cache is transposed for it (a copy XLA may
  fold into the kernel's operand layout). Returns [B, T, K, G, D]."""
  b, t, k, g, d = q.shape
  to_bskd = lambda c: jnp.swapaxes(c, 1, 2).astype(q.dtype)
  out = jax.nn.dot_product_attention(
      q.reshape(b, t, k * g, d), to_bskd(k_cache), to_bskd(v_cache), mask=mask[:, None],
      implementation=fused_implementation(q.dtype))  # [B, T, H, D]
  return out.reshape(b, t, k, g, d).astype(dtype)


class Attention(nn.Module):
  """Grouped-query attention over a preallocated cache.

  The G = H // K query heads that share a kv head are grouped on their own
  axis, so repeated kv heads are never materialised; the cache is laid out
  [B, K, S, D], so scores and outputs are batched products over (B, K) that
  read it in place. cfg.attention chooses the kernel (config.ATTENTIONS):
  'blocked' (and 'auto', unresolved) with cfg.attn_block and a capacity
  larger than one block follows the used length (attend_blocked); 'masked',
  or attn_block 0, is one masked pass over the capacity (attend_masked: what
  training differentiates); 'fused' is jax.nn.dot_product_attention.

  tree_mask (optional, bool [T, T] or [B, T, T]): the T new tokens are a token
  tree's verify block (tree_mask[a, b]: b is a or an ancestor of a); each
  attends to the cached slots < lengths and to its ancestors-or-self in the
  block. They are still written at slots lengths .. lengths + T - 1 (scratch
  slots until kv_cache.commit_path). [.., T, W] with W > T: the new tokens
  are the last T of a W-wide block begun at slot lengths - (W - T) (a draft
  tree's next level; see tree_block). None: the causal chain (unchanged).
  window (optional, a kv_cache.Window): attend to its slots alone
  (attend_window; a streaming draft), whatever cfg.attention says.
  packed (optional, a packed.Packed; x [1, N, E]): each token written into its
  row's cache at its position, its query attending in a [B, W] view of rows.
  """
  cfg: ModelConfig

  @nn.compact
  def __call__(self, x, positions, k_cache, v_cache, lengths, tree_mask=None, window=None,
               packed=None):
    # x [B, T, E]; positions [B, T]; k_cache, v_cache [B, K, S, D]; lengths [B]
    cfg = self.cfg
    b, t, _ = x.shape
    h, k, d = cfg.n_heads, cfg.n_kv_heads, cfg.d_head
    q = dense(cfg, h * d, "wq")(x).reshape(b, t, h, d)
    kk = dense(cfg, k * d, "wk")(x).reshape(b, t, k, d)
    vv = dense(cfg, k * d, "wv")(x).reshape(b, t, k, d)
    inv_freq = rope_inv_freq(cfg)
    q, kk = apply_rope(q, positions, inv_freq), apply_rope(kk, positions, inv_freq)

    # Write first, then attend: the new tokens see themselves and nothing
    # stale past the row's length.
    if packed is None:
      k_cache = kv_cache.write(k_cache, kk, lengths)
      v_cache = kv_cache.write(v_cache, vv, lengths)
    else:  # per row: its own cache, its own block, causal by position
      k_cache, v_cache = packed.write(k_cache, kk[0]), packed.write(v_cache, vv[0])
      q, positions = packed.to_rows(q[0], lengths), packed.row_positions(lengths)
      b, t = q.shape[:2]  # the [B, W] view

    q = q.reshape(b, t, k, h // k, d)  # [B, T, K, G, D]
    tree = (None if tree_mask is None else
            tree_block(kk, vv, tree_mask, lengths, k_cache, v_cache))
    block = cfg.attn_block
    if window is not None:
      out = attend_window(q, k_cache, v_cache, positions, window, cfg.jnp_dtype, tree)
    elif cfg.attention == "fused":
      out = attend_fused(q, k_cache, v_cache, cache_mask(positions, k_cache.shape[2], tree),
                         cfg.jnp_dtype)
    elif block and k_cache.shape[2] > block and cfg.attention in ("auto", "blocked"):
      out = attend_blocked(q, k_cache, v_cache, positions, block, cfg.jnp_dtype, tree)
    else:
      out = attend_masked(q, k_cache, v_cache, positions, cfg.jnp_dtype, tree)
    if packed is not None:  # back to the packed block
      out, b, t = packed.from_rows(out, lengths)[None], 1, packed.size
    out = dense(cfg, cfg.dim, "wo")(out.reshape(b, t, h * d))
    return out, k_cache, v_cache


class MLP(nn.Module):
  """SwiGLU: down(silu(gate(x)) * up(x))."""
  cfg: ModelConfig

  @nn.compact
  def __call__(self, x):
    cfg = self.cfg
    gate = dense(cfg, cfg.ffn_dim, "w_gate")(x)
    up = dense(cfg, cfg.ffn_dim, "w_up")(x)
    return dense(cfg, cfg.dim, "w_down")(jax.nn.silu(gate) * up)


class Block(nn.Module):
  """Pre-norm transformer block."""
  cfg: ModelConfig

  @nn.compact
  def __call__(self, x, positions, k_cache, v_cache, lengths, tree_mask=None, window=None,
               packed=None):
    h, k_cache, v_cache = Attention(self.cfg, name="attn")(
        RMSNorm(self.cfg, name="attn_norm")(x), positions, k_cache, v_cache, lengths,
        tree_mask, window, packed)
    x = x + h
    x = x + MLP(self.cfg, name="mlp")(RMSNorm(self.cfg, name="mlp_norm")(x))
    return x, k_cache, v_cache
