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
  EAGLE-2's way, per row: the top-k children of every frontier node by
  cumulative draft log-probability, the frontier of each level its top k
  candidates (k + (depth - 1) k^2 candidates), then the N candidates with
  the highest cumulative log-probability (ties: the shallower first, so a
  kept node's parent is kept), in BFS order, siblings by probability.

  The draft feeds the root and each level's frontier (1 + (depth - 1) k
  tokens) at slots n - 1 + its feed index, so its scratch layout is not the
  verify block's: DraftedTree.fed maps one to the other for the commit.
  Returns (DraftedTree with per-row parents, mask and fed, dcache with
  lengths n - 1)."""
  del key  # top-k children: deterministic
  cfg, tree = sc.draft, sc.tree
  k, depth, n_keep = tree.k, tree.depth, tree.n_nodes
  behind = live & (dcache.lengths < n - 1)

  def catch_up(c):
    c = kvc.rollback(c, n - 2)
    return llama.forward(dparams, tail[:, :1], c, cfg)[1]

  dcache = jax.lax.cond(jnp.any(behind), catch_up, lambda c: c, dcache)
  base, b, f = dcache.lengths, tail.shape[0], tree.n_fed
  rows = jnp.arange(b)[:, None]
  fed_tok = jnp.zeros((b, f), jnp.int32).at[:, 0].set(tail[:, 1])
  fed_anc = jnp.zeros((b, f, f), bool).at[:, 0, 0].set(True)  # ancestors-or-self, feed layout
  fed_score = jnp.zeros((b, f), jnp.float32)
  fed_cand = jnp.full((b, f), -1, jnp.int32)  # each fed node's candidate index (root: -1)
  toks, scores, depths, parent_cand, fed_of = [], [], [], [], []
  n_cand = 0
  for d in range(depth):  # feed level d's frontier, propose level d + 1
    lo, hi = (0, 1) if d == 0 else (1 + (d - 1) * k, 1 + d * k)
    logits, dcache = llama.forward(dparams, fed_tok[:, lo:hi], kvc.rollback(dcache, base + lo),
                                   cfg, tree_mask=fed_anc[:, lo:hi, :hi])
    logp = fed_score[:, lo:hi, None] + jax.nn.log_softmax(logits.astype(jnp.float32), -1)
    top, tok = jax.lax.top_k(logp, k)  # [B, w, k]
    w = hi - lo
    toks.append(tok.reshape(b, w * k).astype(jnp.int32))
    scores.append(top.reshape(b, w * k))
    depths.append(jnp.full((b, w * k), d + 1, jnp.int32))
    parent_cand.append(jnp.repeat(fed_cand[:, lo:hi], k, axis=1))
    level = jnp.full((b, w * k), -1, jnp.int32)
    if d + 1 < depth:  # the next frontier: this level's top k
      best = jax.lax.top_k(scores[-1], k)[1]  # [B, k] positions in the level
      nlo = 1 + d * k
      par = lo + best // k  # their parents' feed index
      fed_tok = fed_tok.at[:, nlo:nlo + k].set(jnp.take_along_axis(toks[-1], best, 1))
      fed_score = fed_score.at[:, nlo:nlo + k].set(jnp.take_along_axis(scores[-1], best, 1))
      fed_cand = fed_cand.at[:, nlo:nlo + k].set(n_cand + best)
      anc = fed_anc[rows, par] | jax.nn.one_hot(nlo + jnp.arange(k), f, dtype=bool)[None]
      fed_anc = fed_anc.at[:, nlo:nlo + k].set(anc)
      level = level.at[rows, best].set(nlo + jnp.arange(k, dtype=jnp.int32)[None])
    fed_of.append(level)
    n_cand += w * k
  tok, score, dep, par_c, fed_c = (jnp.concatenate(x, 1) for x in
                                   (toks, scores, depths, parent_cand, fed_of))
  keep = jnp.lexsort((dep, -score), axis=-1)[:, :n_keep]  # best first; ties: shallower
  keep = jnp.take_along_axis(keep, jnp.lexsort((-jnp.take_along_axis(score, keep, 1),
                                                jnp.take_along_axis(dep, keep, 1)), axis=-1), 1)
  pos = jnp.full((b, n_cand), -1, jnp.int32).at[rows, keep].set(
      jnp.arange(n_keep, dtype=jnp.int32)[None])  # candidate -> node (BFS order)
  par_k = jnp.take_along_axis(par_c, keep, 1)
  parents = jnp.where(par_k >= 0, jnp.take_along_axis(pos, jnp.maximum(par_k, 0), 1), -1)
  t = n_keep + 1
  mask = jnp.broadcast_to(jnp.eye(t, dtype=bool), (b, t, t)).at[:, :, 0].set(True)
  for i in range(n_keep):  # BFS: a parent's row is complete before its children's
    mask = mask.at[:, i + 1].set(mask[:, i + 1] | mask[rows[:, 0], parents[:, i] + 1])
  fed = jnp.concatenate([jnp.zeros((b, 1), jnp.int32), jnp.take_along_axis(fed_c, keep, 1)], 1)
  drafted = DraftedTree(tokens=jnp.take_along_axis(tok, keep, 1),
                        q=jnp.zeros((b, t, 0), jnp.float32), caught_up=behind,
                        parents=parents, mask=mask, fed=fed)
  return drafted, kvc.rollback(dcache, base)


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
