"""The draft model and layer skip: network drafters that run a LLaMA (the
draft's own weights, or a subset of the target's layers) over a KV cache.

Fed index f sits at slot n - 1 + f (the verify's layout: a chain's d_j at
n - 1 + j, a static tree's block index j at n - 1 + j); a chain's d_gamma
and a tree's deepest level are never fed, so after a fully accepted step
the next step first catches up (network.catch_up). A layer-skip prefix
(the first N layers) shares the target's cache instead: the verify
rewrites the slots the draft wrote, and it never catches up.
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar

import jax.numpy as jnp

from specjax.drafters import network
from specjax.drafters import vocab
from specjax.errors import ConfigError
from specjax.model import kv_cache as kvc
from specjax.model import llama
from specjax.model import steps


def run(dparams, tokens, cache: kvc.KVCache, cfg, anc=None, window=None):
  """One feed of a KV-cached LLaMA (llama.forward's tree_mask and window):
  (logits [B, w, V], cache), through the reduced vocabulary's head where
  one is attached (drafters/vocab.py)."""
  if vocab.PARAMS_KEY not in dparams:
    return llama.forward(dparams, tokens, cache, cfg, tree_mask=anc, window=window)
  _, cache, hidden = llama.forward(dparams, tokens, cache, cfg, tree_mask=anc, head=False,
                                   window=window)
  return vocab.draft_logits(dparams, hidden, cfg.padded_vocab), cache


@dataclasses.dataclass(frozen=True)
class ModelDrafter(network.NetworkDrafter):
  """The draft model (--model_draft) on a KV cache of its own."""
  kind: ClassVar[str] = "model"
  needs_draft_model: ClassVar[bool] = True
  catches_up: ClassVar[bool] = True

  def draft_config(self, target, draft):
    if draft is None:
      raise ConfigError("drafter 'model' needs a draft model (--model_draft)")
    if draft.vocab_size == target.vocab_size and draft.padded_vocab != target.padded_vocab:
      # q and p are compared column by column (sharding.pad_vocab pads both alike)
      raise ConfigError(f"draft {draft.name} and target {target.name} are padded to "
                        f"{draft.padded_vocab} and {target.padded_vocab} tokens: load "
                        f"both on the same mesh")
    return draft

  def draft_params(self, tparams, draft):
    if draft is None:
      raise ConfigError("drafter 'model' needs a draft model (--model_draft)")
    return vocab.attach(draft.params, draft.params, self.vocab_ids(draft.cfg.vocab_size))

  def own_params(self, dparams) -> int:
    return llama.param_count({k: v for k, v in dparams.items() if k != vocab.PARAMS_KEY})

  def init(self, sc, target, dparams, prompts, capacity, first):
    m = steps.Runner(sc.draft, dparams)
    return m.prefill(prompts, m.new_cache(len(prompts), capacity))[1]

  def begin(self, dparams, dstate, tcache, tail, n, live, sc, width):
    forward = lambda tokens, c: llama.forward(dparams, tokens, c, sc.draft)[1]
    cache, behind = network.catch_up(forward, dstate, tail, n, live)
    return network.CacheFeed(cache=cache, base=cache.lengths), behind

  def feed(self, dparams, fst, tokens, lo, anc, parent, sc):
    logits, cache = run(dparams, tokens, kvc.rollback(fst.cache, fst.base + lo), sc.draft, anc)
    return logits, fst.replace(cache=cache)

  def end(self, dparams, fst, dstate, tcache, n, sc):
    return kvc.rollback(fst.cache, fst.base), tcache

  def commit(self, dstate, c):
    return c.roll(dstate)


MODEL = ModelDrafter()


# ---------------------------------------------------------------- layerskip


def _ranges(layers: tuple[int, ...]) -> str:
  """(0, 1, 2, 5, 7, 8) -> '0-2,5,7-8'."""
  parts, i = [], 0
  while i < len(layers):
    j = i
    while j + 1 < len(layers) and layers[j + 1] == layers[j] + 1:
      j += 1
    parts.append(str(layers[i]) if i == j else f"{layers[i]}-{layers[j]}")
    i = j + 1
  return ",".join(parts)


@dataclasses.dataclass(frozen=True)
class LayerSkipDrafter(ModelDrafter):
  """The target with a subset of its layers (its own arrays, no copy)."""
  layers: tuple[int, ...] = (0,)
  kind: ClassVar[str] = "layerskip"
  needs_draft_model: ClassVar[bool] = False

  @property
  def catches_up(self) -> bool:
    """A prefix shares the target's cache, never behind."""
    return not self.prefix

  def own_params(self, dparams) -> int:
    return 0  # the target's arrays

  @property
  def prefix(self) -> bool:
    """The first N layers: the draft shares the target's cache of them."""
    return self.layers == tuple(range(len(self.layers)))

  @property
  def base_spec(self) -> str:
    if self.prefix:
      return f"layerskip:{len(self.layers)}"
    if len(self.layers) == 1:  # 'layerskip:K' alone would mean the first K layers
      return f"layerskip:{self.layers[0]}-{self.layers[0]}"
    return f"layerskip:{_ranges(self.layers)}"

  def draft_config(self, target, draft):
    if self.layers[-1] >= target.n_layers:
      raise ConfigError(f"drafter {self.spec}: layer {self.layers[-1]} is out of range, the "
                        f"target {target.name} has layers 0..{target.n_layers - 1}")
    return target.replace(name=f"{target.name}[{self.spec}]", n_layers=len(self.layers))

  def draft_params(self, tparams, draft):
    params = {k: v for k, v in dict(tparams).items() if not k.startswith("layers_")}
    params.update({f"layers_{i}": tparams[f"layers_{l}"] for i, l in enumerate(self.layers)})
    vocab_size = params["embed"]["embedding"].shape[0]  # padded: the ids are checked below it
    return vocab.attach(params, tparams, self.vocab_ids(vocab_size))

  def init(self, sc, target, dparams, prompts, capacity, first):
    if self.prefix:
      return ()  # the target's cache holds the draft's layers
    return ModelDrafter.init(self, sc, target, dparams, prompts, capacity, first)

  def begin(self, dparams, dstate, tcache, tail, n, live, sc, width):
    if not self.prefix:
      return ModelDrafter.begin(self, dparams, dstate, tcache, tail, n, live, sc, width)
    # The target's cache holds the kept sequence minus `last` (n - 1): the
    # draft's own invariant, so it never catches up.
    k = len(self.layers)
    shared = kvc.KVCache(k=tcache.k[:k], v=tcache.v[:k], lengths=tcache.lengths)
    return network.CacheFeed(cache=shared, base=shared.lengths), jnp.zeros(n.shape, bool)

  def end(self, dparams, fst, dstate, tcache, n, sc):
    if not self.prefix:
      return ModelDrafter.end(self, dparams, fst, dstate, tcache, n, sc)
    # the verify rewrites the slots the draft wrote, from the target's unchanged lengths
    k = len(self.layers)
    return dstate, tcache.replace(k=fst.cache.k + tcache.k[k:], v=fst.cache.v + tcache.v[k:])

  def commit(self, dstate, c):
    return dstate if self.prefix else c.roll(dstate)
