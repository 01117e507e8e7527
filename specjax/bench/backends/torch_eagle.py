"""drafters/eagle.py's EAGLE-1 head in PyTorch, for the cost surface's
PyTorch side (bench/studies/cost_surface.py): `TorchEagleHead` runs the
head's one decoder layer (torch_llama.block) over fc([embedding of x_{i+1} ;
feature f_i (; embedding of x_i)]) on its own one-layer cache, and the
target's LM head on a predicted feature; `propose` is the JAX drafter's
greedy chain (the refresh of the pending pairs, the root's feature, then
one pair a drafted token); `TorchHeadProbe` times it per drafted token on a
cache of random K/V. Exact against the JAX drafter:
tests/bench/test_torch_eagle.py.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from specjax.bench.backends.torch_llama import Cache, TorchLlama, block, layout
from specjax.bench.backends.torch_drafts import REPEATS, ProposalProbe


def root_index(n, start, width: int):
  """[B] the root pair's index among the pending pairs: slot n - 2, from
  `start`, clipped into them (eagle.root_index)."""
  return (n - 2 - start).clamp(0, width - 1)


def _linear(p) -> Any:
  """A flax Dense kernel [in, out] as a torch weight [out, in]."""
  import torch  # pylint: disable=import-outside-toplevel
  return torch.from_numpy(np.array(p["kernel"], np.float32).T.copy())


class TorchEagleHead:
  """The head's params (eagle.load_eagle's, float32) on a TorchLlama target
  (its embedding and LM head, its RoPE frequencies); caches are Cache with
  one layer."""

  def __init__(self, target: TorchLlama, hparams):
    torch = self.torch = target.torch
    self.target, self.cfg = target, target.cfg
    b = hparams["block"]
    attn, mlp = b["attn"], b["mlp"]
    vec = lambda a: torch.from_numpy(np.array(a, np.float32))
    self.fc = _linear(hparams["fc"])
    self.fc_bias = vec(hparams["fc"]["bias"])
    self.layer = {"attn_norm": vec(b["attn_norm"]["scale"]),
                  "mlp_norm": vec(b["mlp_norm"]["scale"]),
                  **{n: _linear(attn[n]) for n in ("wq", "wk", "wv", "wo")},
                  **{n: _linear(mlp[n]) for n in ("w_gate", "w_up", "w_down")}}
    self.prev_token = self.fc.shape[1] == 3 * self.fc.shape[0]  # eagle.reads_prev_token

  def new_cache(self, batch: int, capacity: int) -> Cache:
    """The head's own one-layer cache (float32, as the head runs)."""
    return Cache.zeros(self.cfg, 1, batch, capacity, self.torch.float32)

  def forward(self, feats, tokens, cache: Cache, prev_tokens=None):
    """T pairs (feats [B, T, E], tokens [B, T]) at cache.lengths -> the
    predicted next features [B, T, E] (eagle.head_forward); lengths += T.
    prev_tokens [B, T]: each pair's current token, read by a head that
    reads it."""
    torch = self.torch
    w = self.target.w
    parts = [w["embed"][tokens].float(), feats.float()]
    if self.prev_token:
      parts.append(w["embed"][prev_tokens].float())
    x = torch.nn.functional.linear(torch.cat(parts, -1), self.fc, self.fc_bias)
    at = layout(cache.lengths, tokens.shape[1], cache.capacity, w["inv_freq"])
    with torch.inference_mode():
      out = block(x, self.layer, cache.k[0], cache.v[0], at, self.cfg.n_heads,
                  self.cfg.n_kv_heads, self.cfg.norm_eps)
    cache.lengths += tokens.shape[1]
    return out

  def logits(self, g):
    """f32 logits [..., V] of predicted features: the target's LM head, no
    norm (the features are final-normed already; eagle.EagleDrafter.logits)."""
    return self.torch.nn.functional.linear(g, self.target.w["lm_head"].float()).float()

  def propose(self, pending_feats, pending_tokens, prev, start, n, cache: Cache, gamma: int,
              logits: bool = False):
    """gamma greedy drafts [B, gamma] from the pending pairs (feats [B, P, E],
    tokens [B, P], the first pair's current token prev [B]) fed from head slot
    `start` [B], the target's length n [B]: the refresh rolled back to n - 1,
    the root's feature (pair n - 2), then each draft's pair (the parent's
    feature, the draft) at slots n - 1 ..; the cache handed back at n - 1.
    With `logits`, also each draft's f32 logits [B, gamma, V]."""
    torch = self.torch
    prev_all = torch.cat([prev[:, None], pending_tokens[:, :-1]], 1)
    cache.lengths.copy_(start)
    pred = self.forward(pending_feats, pending_tokens, cache, prev_all)
    root = root_index(n, start, pending_tokens.shape[1])
    rows = torch.arange(n.shape[0])
    feat, tok = pred[rows, root], pending_tokens[rows, root]
    cache.lengths.copy_(n - 1)
    drafts, outs = [], []
    for i in range(gamma):
      if i:  # the parent's pair: its feature and the token drafted from it
        feat = self.forward(feat[:, None], drafts[-1][:, None], cache, tok[:, None])[:, 0]
        tok = drafts[-1]
      out = self.logits(feat)
      outs.append(out)
      drafts.append(torch.argmax(out, -1))
    cache.lengths.copy_(n - 1)
    drafts = torch.stack(drafts, 1)
    return (drafts, torch.stack(outs, 1)) if logits else drafts


class TorchHeadProbe(ProposalProbe):
  """ProposalProbe of the torch head at batch `batch`: each proposal after a
  refresh of `pairs` pending pairs, on a head cache of random K/V holding
  depth - 1 pairs per row (XLA's probe: cost_surface.xla_draft_probe)."""

  def __init__(self, head: TorchEagleHead, batch: int, capacity: int, depth: int, gamma: int,
               pairs: int, seed: int = 0, k: int = REPEATS):
    torch = head.torch
    self.head, self.gamma, self.k = head, gamma, k
    self.cache = head.new_cache(batch, capacity).randomized(depth - 1, seed)
    gen = torch.Generator().manual_seed(seed)
    self.feats = torch.randn((batch, pairs, head.cfg.dim), generator=gen)
    self.tokens = torch.randint(0, head.cfg.vocab_size, (batch, pairs), generator=gen)
    self.prev = self.tokens[:, 0].clone()
    self.n = torch.full((batch,), depth, dtype=torch.int64)
    self.start = self.n - 1

  def propose_once(self) -> None:
    with self.head.torch.inference_mode():
      self.head.propose(self.feats, self.tokens, self.prev, self.start, self.n, self.cache,
                        self.gamma)
