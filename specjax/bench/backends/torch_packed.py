"""The packed verify in PyTorch, laid out as vLLM lays out a batch: the rows'
tokens flattened into one block of N tokens (`flatten`: a segment id and a
position per token, padding after the rows' total), the dense layers over
the N tokens, each token's K/V written into its own row's cache at its own
position (nothing past a row's block; padding nowhere), then attention over
every row's cache slots at once, [N, B x S], under a block-diagonal mask
(`block_mask`: row segment[i]'s slots <= pos[i]; its cached prefix and its
own earlier block tokens, causal within the row). The XLA packed verify
(model/packed.py) attends in a [B, W] view instead. A dense mask makes the
scores cost N x B x S, not N x S: `attend_rows` computes its diagonal
blocks alone, row by row, as a varlen kernel does. Same weights as
TorchLlama (`TorchPackedVerify` wraps one); the lengths grow by each row's
count, as steps.packed_verify's. Parity: tests/bench/test_torch_packed.py;
costs: docs/packed_verify.md.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Sequence

import numpy as np

from specjax.bench.backends.pytorch import import_torch
from specjax.bench.backends import torch_llama as tl
from specjax.bench.backends.torch_llama import Cache, TorchLlama
from specjax.errors import CacheOverflowError, ConfigError


@dataclasses.dataclass
class TorchPacked:
  tokens: Any   # [N] int64
  segment: Any  # [N] int64: the row of each token (padding: 0)
  pos: Any      # [N] int64: its position, the cache slot it is written to (padding: 0)
  n_real: int   # tokens before the padding (the rows' total)
  batch: int    # B

  def counts(self):
    """[B] int64: how many tokens each row holds."""
    return self.segment[:self.n_real].bincount(minlength=self.batch)


def flatten(tokens, counts: Sequence[int], lengths, size: int) -> TorchPacked:
  """The first counts[b] tokens of each row of tokens [B, T] (torch int64)
  end to end, row 0 first, at positions lengths[b] .. (lengths [B] torch
  int64), in a block of `size` entries, padded after the rows' total
  (vLLM's host-side flattening; the same layout as model/packed.py's pack)."""
  torch = import_torch()
  b, t = tokens.shape
  counts = np.asarray(counts, np.int64)
  if counts.shape != (b,) or counts.min() < 1 or counts.max() > t or counts.sum() > size:
    raise ConfigError(f"a packed block of {size} needs 1 <= counts <= {t} for {b} rows and "
                      f"sum(counts) <= {size}, got counts {counts.tolist()}")
  n = int(counts.sum())
  seg = np.repeat(np.arange(b), counts)
  off = np.arange(n) - np.repeat(np.cumsum(counts) - counts, counts)
  pad = lambda a: torch.from_numpy(np.concatenate([a, np.zeros(size - n, np.int64)]))
  segment, offset = pad(seg), pad(off)
  real = torch.arange(size) < n
  return TorchPacked(tokens=torch.where(real, tokens[segment, offset], 0), segment=segment,
                     pos=torch.where(real, lengths[segment] + offset, 0), n_real=n, batch=b)


def block_mask(packed: TorchPacked, capacity: int):
  """[N, B x S] bool: token i may read row b's slot s iff b == segment[i]
  and s <= pos[i] (block-diagonal over the rows, causal within each). A
  padding token reads row 0's slot 0 alone (its output is junk, but finite)."""
  torch = import_torch()
  row = torch.arange(packed.batch).repeat_interleave(capacity)[None, :]  # [1, BS]
  slot = torch.arange(capacity).repeat(packed.batch)[None, :]            # [1, BS]
  mask = (row == packed.segment[:, None]) & (slot <= packed.pos[:, None])
  pad = torch.arange(mask.shape[0])[:, None] >= packed.n_real
  return torch.where(pad, (row == 0) & (slot == 0), mask)


def attend(q, keys, vals, bias, n_kv_heads: int):
  """q [n, H, D] against keys, vals [K, M, D] under bias [n, M] (0 or -inf)
  -> [n, H x D]; a group's G x n queries in one product (K, V never expanded)."""
  torch = import_torch()
  (n, h, d), k = q.shape, n_kv_heads
  g = h // k
  qg = q.view(n, k, g, d).permute(1, 2, 0, 3).reshape(k, g * n, d)  # [K, Gn, D]
  scores = torch.matmul(qg.float(), keys.transpose(-1, -2).float()).view(k, g, n, -1)
  probs = torch.softmax(scores / math.sqrt(d) + bias, -1).to(q.dtype)  # [K, G, n, M]
  out = torch.matmul(probs.view(k, g * n, -1), vals).view(k, g, n, d)
  return out.permute(2, 0, 1, 3).reshape(n, h * d)


def attend_masked(q, kc, vc, bias, n_kv_heads: int, packed: TorchPacked):
  """Every token against every row's slots (kc, vc [B, K, S, D] read as
  [K, B x S, D]) under the block-diagonal bias [N, B x S]: vLLM's layout
  with a dense mask; the scores cost N x B x S."""
  del packed
  b, k, s_cap, d = kc.shape
  flat = lambda c: c.permute(1, 0, 2, 3).reshape(k, b * s_cap, d)
  return attend(q, flat(kc), flat(vc), bias, n_kv_heads)


def attend_rows(q, kc, vc, bias, n_kv_heads: int, packed: TorchPacked):
  """The same mask's diagonal blocks alone, as a varlen kernel computes
  them: row b's tokens (contiguous) against row b's S slots; the scores cost
  N x S, one product per row (a host loop); padding gets zeros."""
  torch = import_torch()
  s_cap, outs, lo = kc.shape[2], [], 0
  for b, c in enumerate(packed.counts().tolist()):
    cols = slice(b * s_cap, (b + 1) * s_cap)
    outs.append(attend(q[lo:lo + c], kc[b], vc[b], bias[lo:lo + c, cols], n_kv_heads))
    lo += c
  outs.append(q.new_zeros((q.shape[0] - lo, q.shape[1] * q.shape[2])))
  return torch.cat(outs, 0)


ATTENTION = {"mask": attend_masked, "rows": attend_rows}


def packed_forward(w: dict[str, Any], packed: TorchPacked, ks: list, vs: list, n_heads: int,
                   n_kv_heads: int, eps: float, logits: bool = False, attention: str = "mask"):
  """The packed block's forward; the caches (L x [B, K, S, D]) are written in
  place. attention: "mask" (attend_masked) or "rows" (attend_rows). Returns
  the f32 logits [N, V] (or their argmax [N]); padding: junk."""
  torch = import_torch()
  n, h, k = packed.tokens.shape[0], n_heads, n_kv_heads
  b, _, s_cap, d = ks[0].shape
  bias = torch.zeros((n, b * s_cap), dtype=torch.float32)
  bias = bias.masked_fill(~block_mask(packed, s_cap), float("-inf"))  # [N, BS]
  freqs = packed.pos[:, None].float() * w["inv_freq"]      # [N, D/2]
  emb = torch.cat([freqs, freqs], -1)[:, None, :]          # [N, 1, D]
  cos, sin = emb.cos(), emb.sin()
  seg, pos = packed.segment[:packed.n_real], packed.pos[:packed.n_real]
  attn = ATTENTION[attention]

  rope = lambda x: tl.rotate(x, cos, sin)  # x [N, heads, D]
  lin = torch.nn.functional.linear
  x = w["embed"][packed.tokens]  # [N, E]
  for i, (kc, vc) in enumerate(zip(ks, vs)):
    lw = w["layers"][i]
    y = tl.rms_norm(x, lw["attn_norm"], eps)
    q = rope(lin(y, lw["wq"]).view(n, h, d))
    kk = rope(lin(y, lw["wk"]).view(n, k, d))
    kc[seg, :, pos] = kk[:packed.n_real].to(kc.dtype)  # write first: a block reads itself
    vc[seg, :, pos] = lin(y, lw["wv"]).view(n, k, d)[:packed.n_real].to(vc.dtype)
    x = tl.mlp_residual(x + lin(attn(q, kc, vc, bias, k, packed), lw["wo"]), lw, eps)
  return tl.lm_head(x, w, eps, logits)


class TorchPackedVerify:
  """A TorchLlama's packed verify: `step` (argmax [N], the timed call,
  `torch.compile`d when the model is) and `logits` (f32 [N, V], eager).
  Each checks capacity first and adds each row's count to its length.
  attention: "mask" (the dense block-diagonal mask) or "rows" (its
  diagonal blocks, row by row)."""

  def __init__(self, m: TorchLlama, attention: str = "mask"):
    if attention not in ATTENTION:
      raise ConfigError(f"attention {attention!r}: one of {sorted(ATTENTION)}")
    self.m, self.torch, self.attention = m, m.torch, attention
    c = m.cfg
    kw = dict(n_heads=c.n_heads, n_kv_heads=c.n_kv_heads, eps=c.norm_eps, attention=attention)
    self._eager = lambda w, p, ks, vs, logits=False: packed_forward(w, p, ks, vs, **kw,
                                                                     logits=logits)
    self._fn = (self.torch.compile(self._eager, dynamic=False) if m.compiled
                else self._eager)

  def _run(self, fn, packed: TorchPacked, cache: Cache, logits: bool):
    counts = packed.counts()
    ends = (cache.lengths + counts).numpy()
    if ends.max() > cache.capacity:
      r = int(ends.argmax())
      raise CacheOverflowError(f"KV cache overflow: row {r}'s block of {int(counts[r])} "
                               f"token(s) needs {int(ends[r])} slots but the cache holds "
                               f"{cache.capacity}")
    with self.torch.inference_mode():
      out = fn(self.m.w, packed, cache.k, cache.v, logits=logits)
    cache.lengths += counts
    return out

  def step(self, packed: TorchPacked, cache: Cache):
    return self._run(self._fn, packed, cache, False)

  def logits(self, packed: TorchPacked, cache: Cache):
    return self._run(self._eager, packed, cache, True)
