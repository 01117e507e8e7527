"""The sparse-KV self-draft (MagicDec's draft, StreamingLLM's attention):
the target's own weights, or its first K layers (`+layerskip:K`), each draft
token attending only to the first S slots (sinks) and the last W slots of
its row's kept cache, plus the drafts fed before it in this step.

It shares the target's cache, as the layer-skip prefix does: `begin` views
it, fed index f is written at slot n - 1 + f, `end` hands it back, and the
verify (from the target's unchanged length n - 1) rewrites those slots; it
never catches up and keeps no copy of the KV. Its attention gathers the
window's S + W + fed slots per row and reads nothing else
(layers.attend_window), so a draft step's cost stays flat as the context
grows. With a kept length <= S + W the window is the whole cache and the
draft is the target (its first K layers). docs/streaming.md.
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar

import jax.numpy as jnp
from flax import struct

from specjax.drafters import draft_model
from specjax.drafters import network
from specjax.drafters import vocab
from specjax.errors import ConfigError
from specjax.model import kv_cache as kvc


@struct.dataclass
class WindowFeed:
  """The feeding state: the target's cache (its first K layers), fed index f
  at slot window.start + f, and the window each fed token attends to."""
  cache: kvc.KVCache
  window: kvc.Window


@dataclasses.dataclass(frozen=True)
class StreamingDrafter(network.NetworkDrafter):
  """`streaming:W[,S][+layerskip:K]` (module docstring); layers 0: all."""
  window: int = 256
  sinks: int = 4
  layers: int = 0
  kind: ClassVar[str] = "streaming"
  reads_batch_cache: ClassVar[bool] = True

  @property
  def base_spec(self) -> str:
    skip = f"+layerskip:{self.layers}" if self.layers else ""
    return f"streaming:{self.window},{self.sinks}{skip}"

  def draft_config(self, target, draft):
    k = self.layers or target.n_layers
    if k > target.n_layers:
      raise ConfigError(f"drafter {self.spec}: keeps {k} layers, the target {target.name} "
                        f"has {target.n_layers}")
    return target.replace(name=f"{target.name}[{self.spec}]", n_layers=k)

  def draft_params(self, tparams, draft):
    n = sum(key.startswith("layers_") for key in tparams)
    params = {k: v for k, v in dict(tparams).items()
              if not k.startswith("layers_") or int(k[7:]) < (self.layers or n)}
    vocab_size = params["embed"]["embedding"].shape[0]  # padded: the ids are checked below it
    return vocab.attach(params, tparams, self.vocab_ids(vocab_size))

  def init(self, sc, target, dparams, prompts, capacity, first):
    return ()  # the target's cache is the draft's

  def begin(self, dparams, dstate, tcache, tail, n, live, sc, width):
    # The target's cache holds the kept sequence minus `last` (n - 1): the
    # window ends there, and the step's fed tokens follow it.
    k = sc.draft.n_layers
    shared = kvc.KVCache(k=tcache.k[:k], v=tcache.v[:k], lengths=tcache.lengths)
    cap = tcache.capacity  # a window wider than the cache is the whole cache
    window = kvc.Window(start=tcache.lengths, sinks=min(self.sinks, cap),
                        size=min(self.window, cap), span=width)
    return WindowFeed(cache=shared, window=window), jnp.zeros(n.shape, bool)

  def feed(self, dparams, fst, tokens, lo, anc, parent, sc):
    cache = kvc.rollback(fst.cache, fst.window.start + lo)
    logits, cache = draft_model.run(dparams, tokens, cache, sc.draft, anc, fst.window)
    return logits, fst.replace(cache=cache)

  def end(self, dparams, fst, dstate, tcache, n, sc):
    # the verify rewrites the slots the draft wrote, from the target's unchanged lengths
    k = sc.draft.n_layers
    return dstate, tcache.replace(k=fst.cache.k + tcache.k[k:], v=fst.cache.v + tcache.v[k:])

  def commit(self, dstate, c):
    return dstate
