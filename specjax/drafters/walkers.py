"""Walkers: draft a chain, a static tree or a dynamic tree from any feeder.

A feeder is a network drafter (drafters/network.py): `feed(dparams, fst,
tokens, lo, anc, parent, sc) -> (logits, fst)` runs fed indices lo ..
lo + w - 1 of the step's feed layout (index 0: the root, the step's last
token) and returns the logits their children are drawn from. A walker
decides what is fed and how children are drawn; the feeder, how a node is
run (a KV-cached LLaMA, an EAGLE head over its parent's feature, ...).
  chain   the root, then d_1 .. d_{gamma-1} one by one (a lax.scan): d_j at
          fed index j; d_gamma is never fed
  static  a model.tree.Tree level by level, fed index = block index; the
          deepest level is never fed
  dynamic EAGLE-2's per-row tree (drafters/dynamic.py `select`)
Children are the top-k of their parent's logits (greedy, or siblings
'topk') or i.i.d. draws from its q ('stochastic'); docs/trees.md.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from specjax.drafters import dynamic
from specjax.drafters.base import Drafted, DraftedTree
from specjax.model import sampling
from specjax.model.tree import DynamicTree


def _draw(logits, key, sc):
  """(token [B], q [B, V] or [B, 0] unless sc.needs_q, top probability [B])."""
  q = sampling.probs(logits, sc.sp)
  if sc.sp.greedy:
    tok, top = sampling.argmax(logits), jnp.max(jax.nn.softmax(logits), -1)
  else:
    tok, top = sampling.sample(key, q), jnp.max(q, -1)
  return tok, (q if sc.needs_q else q[..., :0]), top


def chain(feeder, dparams, fst, root, key, sc, depth=None):
  """gamma drafts per row: (tokens [B, gamma], q [B, gamma, V or 0], n_drafted [B], fst).

  With sc.p_min > 0 a row stops drafting (n_drafted) at the first draw
  whose top probability is below p_min; the scan still runs gamma draws.
  `depth` (traced): d_j for j > depth is not drafted (no feed; its token
  and q are junk), so the draft costs the depth's feeds; the root always is."""
  keys = jax.random.split(key, sc.gamma)
  logits, fst = feeder.feed(dparams, fst, root[:, None], 0, None, None, sc)
  tok, q, top = _draw(logits[:, 0], keys[0], sc)
  active = top >= sc.p_min if sc.p_min > 0 else jnp.ones(root.shape, bool)
  if isinstance(depth, int) and depth == 0:  # the root alone, known when traced: no scan
    return root_alone(tok, q, active, fst, sc)

  def draft(carry, xs):
    tok, fst, active = carry
    j, k = xs
    parent = jnp.broadcast_to(j - 1, tok.shape)[:, None].astype(jnp.int32)
    logits, fst = feeder.feed(dparams, fst, tok[:, None], j, None, parent, sc)
    nxt, q, top = _draw(logits[:, 0], k, sc)
    if sc.p_min > 0:
      active = active & (top >= sc.p_min)
    return (nxt, fst, active), (nxt, q, active)

  def body(carry, xs):
    if depth is None:
      return draft(carry, xs)
    skip = lambda c, x: (c, jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype),
                                          jax.eval_shape(draft, c, x)[1]))
    return jax.lax.cond(xs[0] < depth, draft, skip, carry, xs)

  (_, fst, _), (toks, qs, actives) = jax.lax.scan(
      body, (tok, fst, active), (jnp.arange(1, sc.gamma), keys[1:]))
  tokens = jnp.concatenate([tok[:, None], toks.T], 1)
  q = jnp.concatenate([q[:, None], jnp.swapaxes(qs, 0, 1)], 1)
  n_drafted = active.astype(jnp.int32) + jnp.sum(actives, 0).astype(jnp.int32)
  return tokens, q, n_drafted, fst


def root_alone(tok, q, active, fst, sc):
  """chain's outputs at a depth of 0 known when traced (a tails-only step,
  SpecConfig.tails_only): d_1 and zeros past it. The scan of skipped draws
  it replaces copied the feeding state (the head's cache) at each draw's
  conditional."""
  junk = sc.gamma - 1
  tokens = jnp.pad(tok[:, None], ((0, 0), (0, junk)))
  q = jnp.pad(q[:, None], ((0, 0), (0, junk), (0, 0)))
  return tokens, q, active.astype(jnp.int32), fst


def static_tree(feeder, dparams, fst, root, key, sc):
  """sc.tree (a static Tree) per row, one feed per level over all of its
  nodes: (DraftedTree with q [B, 1+N, V or 0] (q[:, j]: what block j's
  children were drawn from), fst)."""
  tree = sc.tree
  mask, depths, kids = tree.mask(), tree.block_depths(), tree.child_table()  # static numpy
  parents = tree.block_parents()
  b, t = root.shape[0], tree.block_size
  block = jnp.zeros((b, t), jnp.int32).at[:, 0].set(root)
  qs = []
  for d, k in enumerate(jax.random.split(key, tree.max_depth)):
    lo, hi = int(np.argmax(depths == d)), int(np.nonzero(depths == d)[0][-1]) + 1
    par = jnp.broadcast_to(jnp.asarray(parents[lo:hi]), (b, hi - lo))
    logits, fst = feeder.feed(dparams, fst, block[:, lo:hi], lo, mask[lo:hi, :hi], par, sc)
    q = sampling.probs(logits, sc.sp)  # [B, w, V]
    qs.append(q if sc.needs_q else q[..., :0])
    parent, rank = np.nonzero(kids[lo:hi] >= 0)  # this level's children, by parent and rank
    if sc.siblings == "topk" or sc.sp.greedy:
      cand = jax.lax.top_k(logits, tree.width)[1]  # [B, w, width]
    else:
      cand = jax.random.categorical(k, jnp.log(q)[:, :, None], axis=-1,
                                    shape=(b, hi - lo, tree.width))
    block = block.at[:, kids[lo:hi][parent, rank]].set(cand[:, parent, rank].astype(jnp.int32))
  deepest = t - sum(q.shape[1] for q in qs)  # the deepest level: never fed
  qs.append(jnp.zeros((b, deepest, qs[0].shape[-1]), qs[0].dtype))
  return DraftedTree(tokens=block[:, 1:], q=jnp.concatenate(qs, 1),
                     caught_up=jnp.zeros((b,), bool)), fst


def dynamic_tree(feeder, dparams, fst, root, key, sc):
  """sc.tree (a DynamicTree) per row, EAGLE-2's way (dynamic.select):
  (DraftedTree with per-row parents, mask and fed, fst)."""
  del key  # top-k children: deterministic
  feed = lambda s, tokens, lo, anc, parent: feeder.feed(dparams, s, tokens, lo, anc, parent, sc)
  return dynamic.select(feed, fst, root, sc.tree)


def tree(feeder, dparams, fst, root, key, sc):
  """The walker of sc.tree's shape: a DynamicTree's, or a static Tree's."""
  walk = dynamic_tree if isinstance(sc.tree, DynamicTree) else static_tree
  return walk(feeder, dparams, fst, root, key, sc)
