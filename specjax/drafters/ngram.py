"""Prompt lookup (n-gram) drafting: no model, the continuation of the latest
earlier match of the row's last n tokens, on device at fixed shapes; for a
token tree (sc.tree), the trie of the continuations of every match
(`ngram_tree`)."""

from __future__ import annotations

import dataclasses
from typing import ClassVar

import jax
import jax.numpy as jnp
import numpy as np

from specjax.drafters.base import Drafted, DraftedTree, Drafter
from specjax.errors import ConfigError
from specjax.model.tree import DynamicTree

CANDIDATES_PER_NODE = 2  # a tree of N nodes reads the best 2N continuations


@dataclasses.dataclass(frozen=True)
class NgramDrafter(Drafter):
  """Prompt lookup: the continuation of the latest earlier match of the
  row's last n tokens (n = n_max down to n_min), on device, fixed shapes."""
  n_min: int = 1
  n_max: int = 4
  kind: ClassVar[str] = "ngram"
  deterministic: ClassVar[bool] = True
  may_draft_nothing: ClassVar[bool] = True

  @property
  def spec(self) -> str:
    return f"ngram:{self.n_min}-{self.n_max}"

  def draft_config(self, target, draft):
    return None

  def draft_params(self, tparams, draft):
    return None

  def init(self, sc, target, dparams, prompts, capacity, first):
    """The token history [B, capacity]: prompt and first token (its length is
    SpecState.n)."""
    hist = np.zeros((len(prompts), capacity), np.int32)
    first = np.asarray(first)
    for b, p in enumerate(prompts):
      hist[b, :len(p)] = p
      hist[b, len(p)] = first[b]
    return jnp.asarray(hist)

  def propose(self, dparams, dstate, tcache, tail, n, live, key, sc, depth=None):
    del depth  # a lookup costs the same at any depth
    tokens, n_drafted = ngram_propose(dstate, n, sc.gamma, self.n_min, self.n_max)
    b = n.shape[0]
    return Drafted(tokens=tokens, q=jnp.zeros((b, sc.gamma, 0), jnp.float32),
                   n_drafted=jnp.where(live, n_drafted, 0),
                   caught_up=jnp.zeros((b,), bool)), dstate, tcache

  def check_tree(self, tree):
    """A dynamic tree is ranked by the draft's distribution; prompt lookup has
    none, so it drafts static trees only."""
    Drafter.check_tree(self, tree)
    if isinstance(tree, DynamicTree):
      raise ConfigError(f"drafter {self.spec} drafts static trees only; {tree.spec} needs a "
                        "drafter with a draft distribution (model, layerskip, eagle)")

  def propose_tree(self, dparams, dstate, tcache, tail, n, live, key, sc):
    tree = sc.tree
    k = min(dstate.shape[1], CANDIDATES_PER_NODE * tree.n)
    tokens, drafted = ngram_tree(dstate, n, tree, k, self.n_min, self.n_max)
    b = n.shape[0]
    return DraftedTree(tokens=tokens, q=jnp.zeros((b, tree.block_size, 0), jnp.float32),
                       caught_up=jnp.zeros((b,), bool),
                       drafted=drafted & live[:, None]), dstate, tcache

  def commit(self, dstate, c):
    # emitted lands at n_prev..; only the first `kept` lie inside the new
    # length n. A finished row is left alone (its write could run past the
    # capacity, where dynamic_update_slice would clamp it onto its history).
    write = jax.vmap(lambda h, e, at: jax.lax.dynamic_update_slice(h, e, (at,)))
    return jnp.where(c.live[:, None], write(dstate, c.emitted, c.n_prev), dstate)


def ngram_propose(hist, n, gamma: int, n_min: int, n_max: int):
  """Prompt lookup over hist [B, S] (row b's history is hist[b, :n[b]]).

  For each n-gram size m (the largest one that matches wins), the key is the
  row's last m tokens; a match is a start j with hist[j:j+m] == key and
  j + m < n (strictly earlier than the key itself, at least one token after
  it); the latest match proposes hist[j+m : j+m+gamma], cut at the end of
  the history. Returns (tokens [B, gamma] (0 past n_drafted), n_drafted [B]).
  """
  b, s = hist.shape
  idx = jnp.arange(s)[None, :]                      # [1, S] candidate starts j
  best_j = jnp.full((b,), -1, jnp.int32)
  best_m = jnp.zeros((b,), jnp.int32)
  for m in range(n_min, n_max + 1):                 # a larger m overrides
    key_pos = jnp.clip(n[:, None] - m + jnp.arange(m)[None, :], 0, s - 1)
    key = jnp.take_along_axis(hist, key_pos, 1)     # [B, m]
    ok = (idx + m < n[:, None]) & (n[:, None] > m)  # [B, S]
    for i in range(m):  # hist[b, j + i] == key[b, i]
      shifted = jnp.pad(hist[:, i:], ((0, 0), (0, i)), constant_values=-1)
      ok = ok & (shifted == key[:, i:i + 1])
    j = jnp.max(jnp.where(ok, idx, -1), 1).astype(jnp.int32)
    found = j >= 0
    best_j = jnp.where(found, j, best_j)
    best_m = jnp.where(found, m, best_m)
  start = best_j + best_m                           # first proposed position
  n_drafted = jnp.where(best_j >= 0, jnp.clip(n - start, 0, gamma), 0).astype(jnp.int32)
  pos = jnp.arange(gamma)[None, :]
  tokens = jnp.take_along_axis(hist, jnp.clip(start[:, None] + pos, 0, s - 1), 1)
  return jnp.where(pos < n_drafted[:, None], tokens, 0).astype(jnp.int32), n_drafted


def ngram_candidates(hist, n, k: int, n_min: int, n_max: int):
  """The k best continuation starts [B, k] of a row's history hist[b, :n[b]],
  best first, -1 where there are fewer.

  A start s (s < n) continues a match of length L(s) = the number of
  tokens before it that equal the row's last ones (hist[s-i] == hist[n-i],
  i = 1..L, capped at n_max); it is a candidate when L(s) >= n_min, ranked
  by L (longer first), then by s (later first): ngram_propose's order, whose
  choice is the first candidate (a match of size m at j is the start j + m,
  and every start matching at m matches at each smaller size too, so
  ordering the starts by L lists each continuation once)."""
  b, s = hist.shape
  idx = jnp.arange(s)[None, :]                          # [1, S] continuation starts
  run = jnp.zeros((b, s), jnp.int32)
  still = jnp.ones((b, s), bool)
  for i in range(1, n_max + 1):
    key = jnp.take_along_axis(hist, jnp.clip(n - i, 0, s - 1)[:, None], 1)  # [B, 1]
    before = jnp.pad(hist[:, :s - i], ((0, 0), (i, 0)), constant_values=-1)  # hist[s - i]
    still = still & (before == key) & (idx >= i)
    run = run + still
  ok = (run >= n_min) & (idx < n[:, None])
  score = jnp.where(ok, run * s + idx, -1)              # [B, S]
  best = jax.lax.top_k(score, k)[0]                     # [B, k] descending
  return jnp.where(best >= 0, best % s, -1).astype(jnp.int32)


def ngram_tree(hist, n, tree, k: int, n_min: int, n_max: int):
  """A static token tree from prompt lookup: (tokens [B, N] (0 where not
  drafted), drafted [B, N] bool).

  The k best continuations (ngram_candidates), each cut at the end of the
  history and at the tree's depth, form a trie: a node stands for the
  candidates whose first tokens are its path, and its rank-r child is the
  r-th distinct next token among them, in candidate order. So rank 0
  follows the best match, ngram_propose's chain, as far as it goes (past
  the end of the history, the best candidate that agrees with it so far
  continues it), and siblings are other matches' continuations, each token
  once. A node with no such token is not drafted (nor its subtree)."""
  b, s = hist.shape
  depth = tree.max_depth
  start = ngram_candidates(hist, n, k, n_min, n_max)    # [B, K]
  pos = start[:, :, None] + jnp.arange(depth)[None, None, :]
  cand = jnp.take_along_axis(hist, jnp.clip(pos, 0, s - 1).reshape(b, -1), 1).reshape(pos.shape)
  valid = (start[:, :, None] >= 0) & (pos < n[:, None, None])  # [B, K, D]
  depths, kids = tree.block_depths(), tree.child_table()      # static numpy
  t = tree.block_size
  block = jnp.zeros((b, t), jnp.int32)
  drafted = jnp.zeros((b, t), bool)
  member = jnp.zeros((b, t, k), bool).at[:, 0].set(True)      # a node's candidates
  earlier = jnp.tril(jnp.ones((k, k), bool), -1)              # [k, k']: k' < k
  for d in range(depth):
    lo, hi = int(np.argmax(depths == d)), int(np.nonzero(depths == d)[0][-1]) + 1
    tok, has = cand[:, None, :, d], member[:, lo:hi] & valid[:, None, :, d]  # [B, 1|w, K]
    same = tok[..., :, None] == tok[..., None, :]                            # [B, 1, K, K]
    dup = jnp.any(same & earlier & has[..., None, :], -1)  # an earlier candidate has it
    first = has & ~dup                                     # [B, w, K] each token once
    rank = jnp.cumsum(first, -1) - 1
    parent, r = np.nonzero(kids[lo:hi] >= 0)               # this level's children
    child = kids[lo:hi][parent, r]                         # their block indices
    pick = first[:, parent] & (rank[:, parent] == r[None, :, None])  # [B, c, K]
    found = jnp.any(pick, -1)
    token = jnp.sum(jnp.where(pick, tok[:, 0][:, None, :], 0), -1)  # the one picked
    block = block.at[:, child].set(jnp.where(found, token, 0).astype(jnp.int32))
    drafted = drafted.at[:, child].set(found)
    member = member.at[:, child].set(has[:, parent] & (tok[:, 0][:, None, :] == token[..., None])
                                     & found[..., None])
  return block[:, 1:], drafted[:, 1:]
