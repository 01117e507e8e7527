"""A small functional LLaMA forward in PyTorch (`TorchLlama`) over the weights
of an HF `LlamaForCausalLM` (`hf.to_torch_model`: the one conversion),
written like specjax's `llama.forward`: a static (preallocated) KV cache per
layer [B, K, S, D] (`Cache`), explicit per-row `lengths` [B], writes at slots
lengths[b] .. lengths[b] + T - 1, a query at position p attending to slots
<= p (one masked pass over the capacity S, as specjax's `attend_masked`),
rolling back = setting `lengths`; a token tree's verify block under its
mask. Its one timed call (a forward over T new tokens per row and the argmax
of its logits) is `torch.compile`d per static shape; prefill runs eager.
torch_spec.py runs the speculative loop on it. torch is imported on first use.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Sequence

from specjax.bench.backends.base import first_line
from specjax.bench.backends.pytorch import import_torch
from specjax.errors import CacheOverflowError, ConfigError
from specjax.formats import hf
from specjax.model import kv_cache as kvc
from specjax.model.config import ModelConfig


def dynamo_graphs() -> int:
  """Graphs torch.compile has built so far in this process (recompiles count)."""
  import_torch()
  from torch._dynamo.utils import counters  # pylint: disable=import-outside-toplevel
  return int(counters["stats"]["unique_graphs"])


def window_slots(start, sinks: int, size: int, span: int, capacity: int):
  """kv_cache.Window.slots in torch: (slots [B, n] clipped into the cache,
  real [B, n] bool), n = sinks + size + span: the first `sinks` slots, then
  start - size .. start + span - 1 (start [B] int64: the step's kept length)."""
  torch = import_torch()
  start = start[:, None]
  cut = torch.clamp(start, max=sinks)  # sinks below it are real
  sink = torch.arange(sinks)[None, :].expand(start.shape[0], sinks)
  recent = start - size + torch.arange(size + span)[None, :]
  slots = torch.cat([sink, recent], 1)
  real = torch.cat([sink < cut, (recent >= cut) & (recent < capacity)], 1)
  return slots.clamp(0, capacity - 1), real


def rms_norm(x, scale, eps: float):
  """RMSNorm in f32, cast back to x's dtype (HF's LlamaRMSNorm)."""
  torch = import_torch()
  x32 = x.float()
  return scale * (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


def rotate(x, cos, sin):
  """RoPE by HF's rotate_half; cos and sin broadcast against x [..., heads, D]."""
  torch = import_torch()
  x1, x2 = x.chunk(2, -1)
  return x * cos.to(x.dtype) + torch.cat([-x2, x1], -1) * sin.to(x.dtype)


def mlp_residual(x, lw: dict[str, Any], eps: float):
  """x plus the layer's SwiGLU MLP of its normed x (HF's LlamaMLP)."""
  torch = import_torch()
  lin = torch.nn.functional.linear
  y = rms_norm(x, lw["mlp_norm"], eps)
  return x + lin(torch.nn.functional.silu(lin(y, lw["w_gate"])) * lin(y, lw["w_up"]),
                 lw["w_down"])


def lm_head(x, w: dict[str, Any], eps: float, logits: bool):
  """The final norm and the LM head: f32 logits [..., V], or their argmax."""
  torch = import_torch()
  out = torch.nn.functional.linear(rms_norm(x, w["final_norm"], eps), w["lm_head"]).float()
  return out if logits else torch.argmax(out, -1)


@dataclasses.dataclass
class Layout:
  """Where a forward's T new tokens per row go and what they see (the
  same for every layer): slots [B, T], rows [B, 1], the additive mask
  bias [B, 1, 1, T, S or n], RoPE's cos and sin [B, T, 1, D], the
  window's gathered slots (or None)."""
  slots: Any
  rows: Any
  bias: Any
  cos: Any
  sin: Any
  window: Any = None


def layout(lengths, t: int, s_cap: int, inv_freq, tree=None, window=None) -> Layout:
  """The Layout of T tokens per row written from `lengths` [B] int64 into a
  cache of s_cap slots. tree: None (a chain: causal), or (mask [T, T] bool,
  depths [T] int64) of a token tree's verify block (model.tree.Tree.mask,
  block_depths): RoPE at lengths + depth, attention to the cache's slots <
  lengths and to the block's slots the mask allows. window: None, or
  (slots [B, n], real [B, n]) (window_slots): attention to those slots
  alone, gathered per row (layers.attend_window), masked by slot <=
  position and real."""
  torch = import_torch()
  b, dev = lengths.shape[0], lengths.device
  slots = lengths[:, None] + torch.arange(t, device=dev)[None, :]  # [B, T]
  rows = torch.arange(b, device=dev)[:, None]  # [B, 1]
  cols = torch.arange(s_cap, device=dev)[None, None, :]  # [1, 1, S]
  if tree is None:
    positions, mask = slots, cols <= slots[:, :, None]
  else:
    positions = lengths[:, None] + tree[1][None, :]
    j = cols - lengths[:, None, None]  # [B, 1, S] block index of each slot
    allowed = tree[0][None].expand(b, t, t).gather(2, j.clamp(0, t - 1).expand(b, t, s_cap))
    mask = (j < 0) | ((j < t) & allowed)
  if window is not None:  # a chain over the window's slots
    mask = (window[0][:, None, :] <= slots[:, :, None]) & window[1][:, None, :]  # [B, T, n]
  bias = torch.zeros(mask.shape, dtype=torch.float32, device=dev)
  bias = bias.masked_fill(~mask, float("-inf"))[:, None, None]  # [B, 1, 1, T, S]
  freqs = positions[..., None].float() * inv_freq  # [B, T, D/2]
  emb = torch.cat([freqs, freqs], -1)[:, :, None, :]    # [B, T, 1, D]
  return Layout(slots, rows, bias, emb.cos(), emb.sin(), window)


def block(x, lw: dict[str, Any], kc, vc, at: Layout, n_heads: int, n_kv_heads: int,
          eps: float):
  """One pre-norm decoder layer over x [B, T, E] (layers.Block): its K and
  V written into kc, vc [B, K, S, D] at at.slots first (the new tokens see
  themselves), then grouped attention under at.bias and the MLP."""
  torch = import_torch()
  b, t = x.shape[:2]
  h, k, d = n_heads, n_kv_heads, kc.shape[3]
  lin = torch.nn.functional.linear
  rope = lambda y: rotate(y, at.cos, at.sin)  # y [B, T, N, D]
  y = rms_norm(x, lw["attn_norm"], eps)
  q = rope(lin(y, lw["wq"]).view(b, t, h, d))
  kk = rope(lin(y, lw["wk"]).view(b, t, k, d))
  vv = lin(y, lw["wv"]).view(b, t, k, d)
  kc[at.rows, :, at.slots] = kk.to(kc.dtype)
  vc[at.rows, :, at.slots] = vv.to(vc.dtype)
  if at.window is not None:  # the window's slots gathered: [B, K, n, D]
    kc, vc = (c[at.rows, :, at.window[0]].permute(0, 2, 1, 3) for c in (kc, vc))
  g = h // k  # a group's G x T queries in one product: K and V read once, never expanded
  qg = q.view(b, t, k, g, d).permute(0, 2, 3, 1, 4).reshape(b, k, g * t, d)  # [B, K, GT, D]
  scores = torch.matmul(qg.float(), kc.transpose(-1, -2).float()).view(b, k, g, t, -1)
  scores = scores / math.sqrt(d) + at.bias  # [B, K, G, T, S or n]
  probs = torch.softmax(scores, -1).to(x.dtype).view(b, k, g * t, -1)
  out = torch.matmul(probs, vc).view(b, k, g, t, d)  # [B, K, G, T, D]
  out = out.permute(0, 3, 1, 2, 4).reshape(b, t, h * d)
  return mlp_residual(x + lin(out, lw["wo"]), lw, eps)


def _forward(w: dict[str, Any], tokens, lengths, ks: list, vs: list, n_heads: int,
             n_kv_heads: int, eps: float, logits: bool = False, tree=None, window=None):
  """T new tokens per row against the cache; the caches are written in place.

  w: weights (torch layout, [out, in]); tokens [B, T] int64; lengths [B]
  int64 (row b is written at slots lengths[b]..); ks, vs: L x [B, K, S, D];
  tree, window: see `layout`. Returns the argmax [B, T] of the logits (or
  the f32 logits [B, T, V]).
  """
  at = layout(lengths, tokens.shape[1], ks[0].shape[2], w["inv_freq"], tree, window)
  x = w["embed"][tokens]  # [B, T, E]
  for lw, kc, vc in zip(w["layers"], ks, vs):
    x = block(x, lw, kc, vc, at, n_heads, n_kv_heads, eps)
  return lm_head(x, w, eps, logits)


class TorchLlama:
  """A LLaMA model in torch over an HF LlamaForCausalLM's weights, with a
  static cache. `step(tokens, cache)` is the timed call (forward + argmax;
  `torch.compile`d when `compile`), `logits` the same forward eager."""

  def __init__(self, cfg: ModelConfig, params=None, model=None, compile: bool = True,
               threads: int | None = None):
    torch = self.torch = import_torch()
    if threads:
      torch.set_num_threads(threads)
    self.cfg = cfg
    if model is None:
      model = hf.to_torch_model(cfg, params)
    self.model = model
    sd = {k: v.detach() for k, v in model.state_dict().items()}
    layer = lambda i, n: sd[f"model.layers.{i}.{n}.weight"]
    self.w = {
        "embed": sd["model.embed_tokens.weight"],
        "final_norm": sd["model.norm.weight"],
        "lm_head": sd.get("lm_head.weight", sd["model.embed_tokens.weight"]),
        "inv_freq": model.model.rotary_emb.inv_freq.detach().float(),
        "layers": [{"attn_norm": layer(i, "input_layernorm"),
                    "wq": layer(i, "self_attn.q_proj"), "wk": layer(i, "self_attn.k_proj"),
                    "wv": layer(i, "self_attn.v_proj"), "wo": layer(i, "self_attn.o_proj"),
                    "mlp_norm": layer(i, "post_attention_layernorm"),
                    "w_gate": layer(i, "mlp.gate_proj"), "w_up": layer(i, "mlp.up_proj"),
                    "w_down": layer(i, "mlp.down_proj")} for i in range(cfg.n_layers)]}
    if float(getattr(model.model.rotary_emb, "attention_scaling", 1.0)) != 1.0:
      raise ConfigError(f"{cfg.name}: RoPE attention scaling != 1 is not supported")
    self.dtype = self.w["embed"].dtype
    self.compiled = bool(compile)
    self.compile_note = None
    kw = dict(n_heads=cfg.n_heads, n_kv_heads=cfg.n_kv_heads, eps=cfg.norm_eps)
    eager = lambda w, tok, lens, ks, vs, tree=None, window=None: _forward(
        w, tok, lens, ks, vs, **kw, tree=tree, window=window)
    self._eager_logits = lambda w, tok, lens, ks, vs, tree=None, window=None: _forward(
        w, tok, lens, ks, vs, **kw, logits=True, tree=tree, window=window)
    self._eager = eager
    self._fn = eager
    if self.compiled:
      for limit in ("recompile_limit", "cache_size_limit"):
        if hasattr(torch._dynamo.config, limit):  # pylint: disable=protected-access
          setattr(torch._dynamo.config, limit, 256)  # pylint: disable=protected-access
      self._fn = torch.compile(eager, dynamic=False)

  def new_cache(self, batch: int, capacity: int) -> "Cache":
    return Cache.zeros(self.cfg, self.cfg.n_layers, batch, capacity, self.dtype)

  def _check(self, tokens, cache: "Cache", live=None) -> None:
    lens = cache.lengths.numpy()
    kvc.check_capacity(lens if live is None else lens[live], tokens.shape[1], cache.capacity)

  def step(self, tokens, cache: "Cache", live=None, tree=None, window=None):
    """argmax [B, T] of a forward over tokens [B, T]; lengths += T. Capacity
    is checked first (for the `live` rows when given: the others ride
    along, their writes inside the capacity by construction). window: the
    slots every layer attends to (window_slots; a streaming draft)."""
    self._check(tokens, cache, live)
    with self.torch.inference_mode():
      try:
        out = self._fn(self.w, tokens, cache.lengths, cache.k, cache.v, tree, window)
      except Exception as e:  # pylint: disable=broad-except
        if not self.compiled:
          raise
        # torch.compile broken here: record why, go on eager.
        self.compile_note = f"torch.compile failed, eager fallback: {first_line(e)}"
        self.compiled, self._fn = False, self._eager
        out = self._fn(self.w, tokens, cache.lengths, cache.k, cache.v, tree, window)
    cache.lengths += tokens.shape[1]
    return out

  def logits(self, tokens, cache: "Cache", tree=None, window=None):
    """f32 logits [B, T, V] of the same forward, eager (`tree`: a tree
    verify, `window`: a streaming draft's slots, see _forward); lengths += T."""
    self._check(tokens, cache)
    with self.torch.inference_mode():
      out = self._eager_logits(self.w, tokens, cache.lengths, cache.k, cache.v, tree, window)
    cache.lengths += tokens.shape[1]
    return out

  def prefill(self, prompts: Sequence[Sequence[int]], cache: "Cache", chunk: int = 512):
    """Writes each row's prompt at slots 0..len-1 (right-padded batch, eager,
    `chunk` tokens per forward: a long prompt's scores and logits stay
    bounded); returns the argmax [B] at each row's last prompt token."""
    torch = self.torch
    lens = torch.tensor([len(p) for p in prompts], dtype=torch.int64)
    pad = max(len(p) for p in prompts)
    ids = torch.tensor([list(p) + [0] * (pad - len(p)) for p in prompts], dtype=torch.int64)
    best = []
    for lo in range(0, pad, chunk):
      cache.lengths.fill_(lo)
      best.append(torch.argmax(self.logits(ids[:, lo:lo + chunk], cache), -1))
    cache.lengths.copy_(lens)  # padding slots are past the lengths: never attended
    return torch.cat(best, 1)[torch.arange(len(prompts)), lens - 1]

  def random_cache(self, batch: int, capacity: int, depth: int, seed: int = 0) -> "Cache":
    """A cache whose first `depth` slots per row hold random K/V (not the
    model's; cost_surface.random_cache in torch, for timing at a long context)."""
    return self.new_cache(batch, capacity).randomized(depth, seed)


@dataclasses.dataclass
class Cache:
  k: list   # L x [B, K, S, D]
  v: list
  lengths: Any  # [B] int64

  @property
  def capacity(self) -> int:
    return self.k[0].shape[2]

  @classmethod
  def zeros(cls, cfg: ModelConfig, layers: int, batch: int, capacity: int, dtype) -> "Cache":
    """An empty cache of `layers` layers, [B, K, S, D] each (cfg's K and D)."""
    if capacity <= 0 or batch <= 0:
      raise CacheOverflowError(f"cache needs batch>0 and capacity>0, got "
                               f"batch={batch}, capacity={capacity}")
    torch = import_torch()
    shape = (batch, cfg.n_kv_heads, capacity, cfg.d_head)
    zeros = lambda: [torch.zeros(shape, dtype=dtype) for _ in range(layers)]
    return cls(zeros(), zeros(), torch.zeros((batch,), dtype=torch.int64))

  def randomized(self, depth: int, seed: int = 0) -> "Cache":
    """This cache with random K/V in its first `depth` slots per row and
    every length at `depth` (a long context without its prefill, for timing)."""
    torch = import_torch()
    gen = torch.Generator().manual_seed(seed)
    for c in self.k + self.v:
      c[:, :, :depth] = torch.randn(c[:, :, :depth].shape, generator=gen, dtype=c.dtype)
    self.lengths.fill_(depth)
    return self

  def clone(self) -> "Cache":
    """A copy (a run that starts from a prefilled cache writes into its own)."""
    return Cache([k.clone() for k in self.k], [v.clone() for v in self.v], self.lengths.clone())

  @classmethod
  def stack(cls, rows: Sequence["Cache"]) -> "Cache":
    """Caches of one capacity stacked along the batch (row caches of batch 1
    into one batch: each prompt prefilled once, run in many batches)."""
    torch = import_torch()
    cat = lambda xs: torch.cat(list(xs), 0)
    return cls([cat(layer) for layer in zip(*(r.k for r in rows))],
               [cat(layer) for layer in zip(*(r.v for r in rows))],
               cat(r.lengths for r in rows))
