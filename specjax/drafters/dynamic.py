"""EAGLE-2's dynamic draft tree (model.tree.DynamicTree k, depth, N), drafted
from any feeder (drafters/walkers.py), and a prompt-lookup chain grafted on.

Per row: feed the root, take the top-k children of every fed node by
cumulative draft log-probability, make the level's top k candidates the
next frontier and feed it, for `depth` levels; then keep the N candidates
with the highest cumulative log-probability (ties: the shallower first, so
a kept node's parent is kept), in BFS order, siblings by probability. The
feed layout: the root at fed index 0, level d's frontier (d >= 1) at fed
indices 1 + (d - 1) k .. d k; `feed(state, tokens, lo, anc, parent)` runs
one level and returns (logits, state). docs/trees.md (EAGLE-2's dynamic
tree).
"""

from __future__ import annotations

from typing import Any, Callable

import jax
import jax.numpy as jnp

from specjax.drafters.base import DraftedTree
from specjax.model.tree import DynamicTree

Feed = Callable[..., tuple[jax.Array, Any]]


def level_span(d: int, k: int) -> tuple[int, int]:
  """Level d's fed indices [lo, hi): the root (d = 0), else its frontier."""
  return (0, 1) if d == 0 else (1 + (d - 1) * k, 1 + d * k)


def select(feed: Feed, state, root_token, tree: DynamicTree) -> tuple[DraftedTree, Any]:
  """The dynamic tree of each row (module docstring), fed by `feed` from `state`.

  Returns (a DraftedTree with per-row parents, mask and fed (each block's
  fed index, -1: a node outside every frontier, never fed), no q (top-k
  siblings: deterministic) and caught_up all False, the feed's state)."""
  k, depth, n_keep = tree.k, tree.depth, tree.n_nodes
  b, f = root_token.shape[0], tree.n_fed
  rows = jnp.arange(b)[:, None]
  fed_tok = jnp.zeros((b, f), jnp.int32).at[:, 0].set(root_token)
  fed_anc = jnp.zeros((b, f, f), bool).at[:, 0, 0].set(True)  # ancestors-or-self, feed layout
  fed_score = jnp.zeros((b, f), jnp.float32)
  fed_cand = jnp.full((b, f), -1, jnp.int32)  # each fed node's candidate index (root: -1)
  fed_par = jnp.full((b, f), -1, jnp.int32)  # each fed node's parent's fed index (root: -1)
  toks, scores, depths, parent_cand, fed_of = [], [], [], [], []
  n_cand = 0
  for d in range(depth):  # feed level d's frontier, propose level d + 1
    lo, hi = level_span(d, k)
    logits, state = feed(state, fed_tok[:, lo:hi], lo, fed_anc[:, lo:hi, :hi], fed_par[:, lo:hi])
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
      fed_par = fed_par.at[:, nlo:nlo + k].set(par.astype(jnp.int32))
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
  return DraftedTree(tokens=jnp.take_along_axis(tok, keep, 1),
                     q=jnp.zeros((b, t, 0), jnp.float32), caught_up=jnp.zeros((b,), bool),
                     parents=parents, mask=mask, fed=fed), state


def graft_chain(d: DraftedTree, chain, n_chain) -> DraftedTree:
  """Each row's tree with a chain of tokens grafted on from the root
  (DynamicTree.ngram): chain [B, L], its first n_chain [B] real.

  The chain follows the tree's drafted nodes while one of the reached
  node's children has its next token, then goes on as new nodes N + j
  below the last node reached (node N + j for chain token j), so no node
  has two children of one token and a chain node's depth is j + 1 <= L.
  The L slots a row does not use (merged or past n_chain) are undrafted
  (never tried) children of the root, attending to the root and themselves.
  BFS order is kept where it matters: every parent is an earlier node."""
  b, n = d.tokens.shape
  length = chain.shape[1]
  t = 1 + n + length
  rows = jnp.arange(b)
  parents = jnp.concatenate([d.parents, jnp.full((b, length), -1, jnp.int32)], 1)
  tokens = jnp.concatenate([d.tokens, jnp.zeros((b, length), jnp.int32)], 1)
  old = jnp.ones((b, n), bool) if d.drafted is None else d.drafted
  drafted = jnp.concatenate([old, jnp.zeros((b, length), bool)], 1)
  mask = jnp.zeros((b, t, t), bool).at[:, :1 + n, :1 + n].set(d.mask)
  new = jnp.arange(1 + n, t)
  mask = mask.at[:, new, 0].set(True).at[:, new, new].set(True)
  cur = jnp.full((b,), -1, jnp.int32)  # the node the chain has reached (-1: the root)
  merging = jnp.ones((b,), bool)
  for j in range(length):
    tok = chain[:, j].astype(jnp.int32)
    real = j < n_chain
    match = (parents == cur[:, None]) & (tokens == tok[:, None]) & drafted  # [B, N + L]
    found = merging & real & jnp.any(match, -1)
    add = real & ~found
    i = n + j
    parents = parents.at[:, i].set(jnp.where(add, cur, -1))
    tokens = tokens.at[:, i].set(jnp.where(add, tok, 0))
    drafted = drafted.at[:, i].set(add)
    row = mask[rows, cur + 1] | jax.nn.one_hot(1 + i, t, dtype=bool)[None]  # parent's row + self
    mask = mask.at[:, 1 + i].set(jnp.where(add[:, None], row, mask[:, 1 + i]))
    cur = jnp.where(found, jnp.argmax(match, -1).astype(jnp.int32), jnp.where(add, i, cur))
    merging = found
  fed = None if d.fed is None else jnp.concatenate(
      [d.fed, jnp.full((b, length), -1, jnp.int32)], 1)
  q = jnp.concatenate([d.q, jnp.zeros((b, length) + d.q.shape[2:], d.q.dtype)], 1)
  return d.replace(tokens=tokens, q=q, parents=parents, mask=mask, fed=fed, drafted=drafted)
