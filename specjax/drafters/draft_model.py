"""The draft model and layer skip: drafters that run a LLaMA (the draft's own
weights, or a subset of the target's layers) for gamma T=1 steps over a KV
cache, with the catch-up after a fully accepted step (see drafters/base.py
for the interface and the spec strings)."""

from __future__ import annotations

import dataclasses
from typing import ClassVar

import jax
import jax.numpy as jnp
import numpy as np

from specjax.model import sampling
from specjax.drafters import dynamic
from specjax.drafters.base import Drafted, DraftedTree, Drafter, rollback_draft_cache
from specjax.errors import ConfigError
from specjax.model import kv_cache as kvc
from specjax.model import llama
from specjax.model import steps
from specjax.model.tree import DynamicTree


def draft_phase(dparams, dcache, tail, n, live, key, sc):
  """Drafts gamma tokens per row from the draft model (sc.draft): the
  `model` drafter's proposal, and layerskip's.

  Returns (Drafted, dcache holding n-1+gamma entries)."""
  cfg, sp = sc.draft, sc.sp
  behind = live & (dcache.lengths < n - 1)  # rows that accepted every draft last step

  def catch_up(c):  # feed d_gamma, left over from a fully accepted step
    c = kvc.rollback(c, n - 2)
    return llama.forward(dparams, tail[:, :1], c, cfg)[1]

  dcache = jax.lax.cond(jnp.any(behind), catch_up, lambda c: c, dcache)

  def body(carry, k):
    tok, c, active = carry
    logits, c = llama.forward(dparams, tok[:, None], c, cfg)
    logits = logits[:, 0]
    q = sampling.probs(logits, sp)
    nxt = jnp.argmax(logits, -1).astype(jnp.int32) if sp.greedy else sampling.sample(k, q)
    if sc.p_min > 0:
      top = jnp.max(jax.nn.softmax(logits) if sp.greedy else q, -1)
      active = active & (top >= sc.p_min)
    return (nxt, c, active), (nxt, q if sc.needs_q else q[:, :0], active)

  b = tail.shape[0]
  init = (tail[:, 1], dcache, jnp.ones((b,), bool))
  (_, dcache, _), (drafts, q, active) = jax.lax.scan(
      body, init, jax.random.split(key, sc.gamma))
  return Drafted(tokens=drafts.T, q=jnp.swapaxes(q, 0, 1),
                 n_drafted=jnp.sum(active, 0).astype(jnp.int32), caught_up=behind), dcache


def draft_tree_phase(dparams, dcache, tail, n, live, key, sc):
  """Drafts sc.tree (a static token tree) per row from the draft model, one
  forward per level over all of that level's nodes: the `model` and
  `layerskip` drafters' tree proposal.

  The draft writes its tree block where the target's verify will: block
  index j (0 = the tail) at slot n - 1 + j, each level attending to the
  cached slots < n - 1 and its ancestors in the block (a tree mask
  [level, block so far]). Each node's children are its top-k by the draft's
  logits (sc.siblings 'topk': ranks follow the draft's order) or i.i.d.
  draws from its q ('stochastic'). The deepest level is never fed, as a
  chain's d_gamma is not. Returns (DraftedTree, dcache with lengths n - 1:
  the block in scratch slots, for kv_cache.commit_path)."""
  cfg, sp, tree = sc.draft, sc.sp, sc.tree
  behind = live & (dcache.lengths < n - 1)  # the last step's deepest node was accepted

  def catch_up(c):  # feed it first, as a chain feeds d_gamma
    c = kvc.rollback(c, n - 2)
    return llama.forward(dparams, tail[:, :1], c, cfg)[1]

  dcache = jax.lax.cond(jnp.any(behind), catch_up, lambda c: c, dcache)
  base = dcache.lengths  # n - 1 for live rows
  mask, depths, kids = tree.mask(), tree.block_depths(), tree.child_table()  # static numpy
  b, t = tail.shape[0], tree.block_size
  block = jnp.zeros((b, t), jnp.int32).at[:, 0].set(tail[:, 1])
  q_all = jnp.zeros((b, t, cfg.padded_vocab if sc.needs_q else 0), jnp.float32)
  for d, k in enumerate(jax.random.split(key, tree.max_depth)):
    lo, hi = int(np.argmax(depths == d)), int(np.nonzero(depths == d)[0][-1]) + 1
    logits, dcache = llama.forward(dparams, block[:, lo:hi], kvc.rollback(dcache, base + lo),
                                   cfg, tree_mask=mask[lo:hi, :hi])
    q = sampling.probs(logits, sp)  # [B, w, V]
    if sc.needs_q:
      q_all = q_all.at[:, lo:hi].set(q)
    parent, rank = np.nonzero(kids[lo:hi] >= 0)  # this level's children, by parent and rank
    if sc.siblings == "topk" or sp.greedy:
      cand = jax.lax.top_k(logits, tree.width)[1]  # [B, w, width]
    else:
      cand = jax.random.categorical(k, jnp.log(q)[:, :, None], axis=-1,
                                    shape=(b, hi - lo, tree.width))
    block = block.at[:, kids[lo:hi][parent, rank]].set(cand[:, parent, rank].astype(jnp.int32))
  return DraftedTree(tokens=block[:, 1:], q=q_all, caught_up=behind), kvc.rollback(dcache, base)


def draft_dynamic_phase(dparams, dcache, tail, n, live, key, sc):
  """Drafts a dynamic tree (sc.tree a model.tree.DynamicTree k, depth, N),
  EAGLE-2's way, per row (the selection: drafters/dynamic.py, shared with
  the EAGLE head): the top-k children of every frontier node by cumulative
  draft log-probability, the frontier of each level its top k candidates,
  then the N candidates with the highest cumulative log-probability, in BFS
  order, siblings by probability.

  The draft feeds the root and each level's frontier (1 + (depth - 1) k
  tokens) at slots n - 1 + its feed index, each level attending to the
  cached slots < n - 1 and its fed ancestors, so its scratch layout is not
  the verify block's: DraftedTree.fed maps one to the other for the commit.
  Returns (DraftedTree with per-row parents, mask and fed, dcache with
  lengths n - 1)."""
  del key  # top-k children: deterministic
  cfg = sc.draft
  behind = live & (dcache.lengths < n - 1)

  def catch_up(c):
    c = kvc.rollback(c, n - 2)
    return llama.forward(dparams, tail[:, :1], c, cfg)[1]

  dcache = jax.lax.cond(jnp.any(behind), catch_up, lambda c: c, dcache)
  base = dcache.lengths

  def feed(tokens, anc, parent):  # fed indices lo .. hi-1 at slots base + lo ..
    del parent  # the cache holds every fed ancestor's K/V
    nonlocal dcache
    lo = anc.shape[-1] - tokens.shape[1]
    logits, dcache = llama.forward(dparams, tokens, kvc.rollback(dcache, base + lo), cfg,
                                   tree_mask=anc)
    return logits

  drafted = dynamic.select(feed, tail[:, 1], sc.tree)
  return drafted.replace(caught_up=behind), kvc.rollback(dcache, base)


def _draft_tree(dparams, dcache, tail, n, live, key, sc):
  """A static tree's or a dynamic tree's draft phase."""
  phase = draft_dynamic_phase if isinstance(sc.tree, DynamicTree) else draft_tree_phase
  return phase(dparams, dcache, tail, n, live, key, sc)


@dataclasses.dataclass(frozen=True)
class ModelDrafter(Drafter):
  """The draft model: its own KV cache, gamma T=1 steps in a lax.scan."""
  kind: ClassVar[str] = "model"
  needs_draft_model: ClassVar[bool] = True

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
    return draft.params

  def init(self, sc, target, dparams, prompts, capacity, first):
    m = steps.Runner(sc.draft, dparams)
    return m.prefill(prompts, m.new_cache(len(prompts), capacity))[1]

  def propose(self, dparams, dstate, tcache, tail, n, live, key, sc):
    d, dcache = draft_phase(dparams, dstate, tail, n, live, key, sc)
    return d, dcache, tcache

  def propose_tree(self, dparams, dstate, tcache, tail, n, live, key, sc):
    d, dcache = _draft_tree(dparams, dstate, tail, n, live, key, sc)
    return d, dcache, tcache

  def commit(self, dstate, c):
    return rollback_draft_cache(dstate, c)


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
class LayerSkipDrafter(Drafter):
  """The target with a subset of its layers (its own arrays, no copy)."""
  layers: tuple[int, ...] = (0,)
  kind: ClassVar[str] = "layerskip"

  @property
  def prefix(self) -> bool:
    """The first N layers: the draft shares the target's cache of them."""
    return self.layers == tuple(range(len(self.layers)))

  @property
  def spec(self) -> str:
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
    return params

  def init(self, sc, target, dparams, prompts, capacity, first):
    if self.prefix:
      return ()  # the target's cache holds the draft's layers
    m = steps.Runner(sc.draft, dparams)
    return m.prefill(prompts, m.new_cache(len(prompts), capacity))[1]

  def propose(self, dparams, dstate, tcache, tail, n, live, key, sc):
    if not self.prefix:
      d, dcache = draft_phase(dparams, dstate, tail, n, live, key, sc)
      return d, dcache, tcache
    k = len(self.layers)
    # The target's cache holds the kept sequence minus `last` (n - 1): the
    # draft's own invariant, so the draft phase never catches up.
    shared = kvc.KVCache(k=tcache.k[:k], v=tcache.v[:k], lengths=tcache.lengths)
    d, shared = draft_phase(dparams, shared, tail, n, live, key, sc)
    # The slots the draft wrote (n-1 .. n-2+gamma) are rewritten by the
    # verify, which starts at the target's unchanged lengths.
    return d, dstate, tcache.replace(k=shared.k + tcache.k[k:], v=shared.v + tcache.v[k:])

  def propose_tree(self, dparams, dstate, tcache, tail, n, live, key, sc):
    if not self.prefix:
      d, dcache = _draft_tree(dparams, dstate, tail, n, live, key, sc)
      return d, dcache, tcache
    k = len(self.layers)
    shared = kvc.KVCache(k=tcache.k[:k], v=tcache.v[:k], lengths=tcache.lengths)
    d, shared = _draft_tree(dparams, shared, tail, n, live, key, sc)
    # the verify rewrites the whole block the draft wrote, at the same slots
    return d, dstate, tcache.replace(k=shared.k + tcache.k[k:], v=shared.v + tcache.v[k:])

  def commit(self, dstate, c):
    return dstate if self.prefix else rollback_draft_cache(dstate, c)
