"""Network drafters: a drafter that runs a network is a feeder; the walkers
(drafters/walkers.py) draft every shape from it.

A subclass provides its properties and three traced functions:
  begin(dparams, dstate, tcache, tail, n, live, sc, width) -> (fst, caught_up)
      the step's feeding state (width: its feed layout's slots), after what
      the step owes first (a chain's catch-up, EAGLE's pending pairs)
  feed(dparams, fst, tokens [B, w], lo, anc, parent, sc) -> (logits, fst)
      fed indices lo .. lo + w - 1 (0: the root); anc their ancestors-or-self
      (None: a chain), parent their parents' fed indices; lo is a Python int
      but inside the chain's scan (traced, >= 1)
  end(dparams, fst, dstate, tcache, n, sc) -> (dstate, tcache)
`CacheFeed` and `catch_up` are what a KV-cached model shares
(draft_model.py); a new drafter in one class: ARCHITECTURE.md.
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar

import jax
import jax.numpy as jnp
from flax import struct

from specjax.drafters import vocab
from specjax.drafters import walkers
from specjax.drafters.base import Drafted, Drafter
from specjax.model import kv_cache as kvc


@struct.dataclass
class CacheFeed:
  """A KV-cached model's feeding state: fed index f sits at slot base + f."""
  cache: kvc.KVCache
  base: jax.Array  # [B]


def catch_up(forward, cache: kvc.KVCache, tail, n, live):
  """Feeds d_gamma of a fully accepted last step (the row's cache is then one
  behind, length n - 2) as slot n - 2: (cache with length n - 1 for the live
  rows, behind [B] bool). `forward(tokens [B, 1], cache) -> cache`."""
  behind = live & (cache.lengths < n - 1)
  cache = jax.lax.cond(jnp.any(behind),
                       lambda c: forward(tail[:, :1], kvc.rollback(c, n - 2)), lambda c: c, cache)
  return cache, behind


@dataclasses.dataclass(frozen=True)
class NetworkDrafter(Drafter):
  """A drafter that runs a network (module docstring): propose and
  propose_tree are the walkers over its feed. `vocab` (spec suffix
  ':vocab=V'): its LM head over a reduced set of ids (drafters/vocab.py;
  '': the set stored with its weights, if any; 'full': none)."""
  vocab: str = dataclasses.field(default="", kw_only=True)
  drafts_to_depth: ClassVar[bool] = True

  @property
  def base_spec(self) -> str:
    """The spec without its vocabulary."""
    return self.kind

  @property
  def spec(self) -> str:
    return f"{self.base_spec}:vocab={self.vocab}" if self.vocab else self.base_spec

  def vocab_ids(self, vocab_size: int, default_dir=None):
    """The reduced set's sorted ids (None: the full vocabulary)."""
    return vocab.resolve(self.vocab, vocab_size, default_dir)

  def begin(self, dparams, dstate, tcache, tail, n, live, sc, width: int):
    raise NotImplementedError

  def feed(self, dparams, fst, tokens, lo, anc, parent, sc):
    raise NotImplementedError

  def end(self, dparams, fst, dstate, tcache, n, sc):
    raise NotImplementedError

  def propose(self, dparams, dstate, tcache, tail, n, live, key, sc, depth=None):
    fst, behind = self.begin(dparams, dstate, tcache, tail, n, live, sc, sc.gamma)
    tokens, q, n_drafted, fst = walkers.chain(self, dparams, fst, tail[:, 1], key, sc, depth)
    dstate, tcache = self.end(dparams, fst, dstate, tcache, n, sc)
    return Drafted(tokens=tokens, q=q, n_drafted=n_drafted, caught_up=behind), dstate, tcache

  def propose_tree(self, dparams, dstate, tcache, tail, n, live, key, sc):
    fst, behind = self.begin(dparams, dstate, tcache, tail, n, live, sc, sc.tree.fed_slots)
    d, fst = walkers.tree(self, dparams, fst, tail[:, 1], key, sc)
    dstate, tcache = self.end(dparams, fst, dstate, tcache, n, sc)
    return d.replace(caught_up=behind), dstate, tcache
