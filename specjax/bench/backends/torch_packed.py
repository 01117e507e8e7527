"""The packed verify in PyTorch, laid out as vLLM lays out a batch: the rows'
tokens flattened into one block of N tokens (`flatten`: a segment id and a
position per token, padding after the rows' total), the dense layers over
the N tokens, each token's K/V written into its own row's cache at its own
position (nothing past a row's block; padding nowhere), then attention over
every row's cache slots at once, [N, B x S], under a block-diagonal mask
(`block_mask`: row segment[i]'s slots <= pos[i]; its cached prefix and its
own earlier block tokens, causal within the row). It is the XLA packed
verify's (model/packed.py) other layout: there each row attends in a [B, W]
view; here the mask is dense, so attention scores cost N x B x S, not
N x S. Same weights as TorchLlama (`TorchPackedVerify` wraps one); the
lengths grow by each row's count, as steps.packed_verify's. Parity:
tests/bench/test_torch_packed.py; costs: docs/packed_verify.md.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Sequence

import numpy as np

from specjax.bench.backends.pytorch import import_torch
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


def packed_forward(w: dict[str, Any], packed: TorchPacked, ks: list, vs: list, n_heads: int,
                   n_kv_heads: int, eps: float, logits: bool = False):
  """The packed block's forward; the caches (L x [B, K, S, D]) are written in
  place. Returns the f32 logits [N, V] (or their argmax [N]); padding: junk."""
  torch = import_torch()
  n, h, k = packed.tokens.shape[0], n_heads, n_kv_heads
  b, _, s_cap, d = ks[0].shape
  g = h // k
  bias = torch.zeros((n, b * s_cap), dtype=torch.float32)
  bias = bias.masked_fill(~block_mask(packed, s_cap), float("-inf"))  # [N, BS]
  freqs = packed.pos[:, None].float() * w["inv_freq"]      # [N, D/2]
  emb = torch.cat([freqs, freqs], -1)[:, None, :]          # [N, 1, D]
  cos, sin = emb.cos(), emb.sin()
  seg, pos = packed.segment[:packed.n_real], packed.pos[:packed.n_real]

  def norm(x, scale):  # RMSNorm in f32 (HF's LlamaRMSNorm)
    x32 = x.float()
    return scale * (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)

  def rope(x):  # x [N, heads, D], HF's rotate_half
    x1, x2 = x.chunk(2, -1)
    return x * cos.to(x.dtype) + torch.cat([-x2, x1], -1) * sin.to(x.dtype)

  lin = torch.nn.functional.linear
  x = w["embed"][packed.tokens]  # [N, E]
  for i, (kc, vc) in enumerate(zip(ks, vs)):
    lw = w["layers"][i]
    y = norm(x, lw["attn_norm"])
    q = rope(lin(y, lw["wq"]).view(n, h, d))
    kk = rope(lin(y, lw["wk"]).view(n, k, d))
    kc[seg, :, pos] = kk[:packed.n_real].to(kc.dtype)  # write first: a block reads itself
    vc[seg, :, pos] = lin(y, lw["wv"]).view(n, k, d)[:packed.n_real].to(vc.dtype)
    keys = kc.permute(1, 0, 2, 3).reshape(k, b * s_cap, d)  # every row's slots: [K, BS, D]
    vals = vc.permute(1, 0, 2, 3).reshape(k, b * s_cap, d)
    qg = q.view(n, k, g, d).permute(1, 2, 0, 3).reshape(k, g * n, d)  # [K, GN, D]
    scores = torch.matmul(qg.float(), keys.transpose(-1, -2).float()).view(k, g, n, -1)
    probs = torch.softmax(scores / math.sqrt(d) + bias, -1).to(x.dtype)  # [K, G, N, BS]
    out = torch.matmul(probs.view(k, g * n, -1), vals).view(k, g, n, d)
    x = x + lin(out.permute(2, 0, 1, 3).reshape(n, h * d), lw["wo"])
    y = norm(x, lw["mlp_norm"])
    x = x + lin(torch.nn.functional.silu(lin(y, lw["w_gate"])) * lin(y, lw["w_up"]),
                lw["w_down"])
  out = lin(norm(x, w["final_norm"]), w["lm_head"]).float()
  return out if logits else torch.argmax(out, -1)


class TorchPackedVerify:
  """A TorchLlama's packed verify: `step` (argmax [N], the timed call,
  `torch.compile`d when the model is) and `logits` (f32 [N, V], eager).
  Each checks capacity first and adds each row's count to its length."""

  def __init__(self, m: TorchLlama):
    self.m, self.torch = m, m.torch
    c = m.cfg
    kw = dict(n_heads=c.n_heads, n_kv_heads=c.n_kv_heads, eps=c.norm_eps)
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
