"""One speculative step over a token tree (--tree): verify and accept.

The chain's step (speculative.py) with three phases changed, everything
else (the loops, keep_tokens, records, the drafter's commit) shared:
  draft:   the drafter's `propose_tree` (drafters/base.py) drafts sc.tree's
           N nodes per row and the q they were drawn from
  verify:  one target forward over the block [last, node_0 .. node_{N-1}]
           at fixed shape (steps.tree_verify: each node at position
           length + depth, attending to the cache and its own ancestors);
           the block stays in scratch slots
  accept:  tree_acceptance.judge_tree: the accepted path (greedy: the
           deepest matching one; sampling: SpecInfer's multi-draft rejection
           sampling; a simulated rule: its table by depth and sibling rank)
           and the token after it
  commit:  kv_cache.commit_path moves the kept path's K/V into place (the
           draft cache's too, where the drafter keeps one).
A chain-shaped tree is the chain, token for token (tests/decode/test_trees.py).
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np

from specjax.decode import tree_acceptance
from specjax.decode.acceptance import AcceptRule
from specjax.drafters.base import DraftedTree
from specjax.model import sampling
from specjax.model import steps
from specjax.model.tree import Tree


def accept_probs(rule: AcceptRule, tree: Tree) -> np.ndarray:
  """The traced acceptance table of a simulated rule on `tree`
  [max_depth, width] (ones for the real rule: unused)."""
  return tree_acceptance.accept_table(rule, tree.max_depth, tree.width)


def verify_phase(tparams, tcache, tail, d: DraftedTree, sc):
  """Target distributions p [B, 1+N, V] over the tree block, tcache with the
  block in scratch slots (lengths unchanged), and the target's hidden states
  [B, 1+N, E] for a drafter that `needs_features` (else None)."""
  block = jnp.concatenate([tail[:, 1:], d.tokens], 1)  # [B, 1+N]
  mask = sc.tree.mask() if d.mask is None else d.mask
  out = steps.tree_verify(tparams, block, mask, tcache, sc.target,
                          return_hidden=sc.drafter.needs_features)
  feats = out[2] if sc.drafter.needs_features else None
  return sampling.probs(out[0], sc.sp), out[1], feats


def judge(key, accept_table, p, d: DraftedTree, sc) -> tree_acceptance.TreeVerdict:
  """The accepted path of each row's tree and the target's token after it."""
  tree = sc.tree
  parents = np.asarray(tree.parents, np.int32) if d.parents is None else d.parents
  top_k = sc.sp.greedy or sc.drafter.deterministic or d.parents is not None
  return tree_acceptance.judge_tree(
      key, parents, d.tokens, p, d.q if d.q.shape[-1] else None, greedy=sc.sp.greedy,
      siblings="topk" if top_k else sc.siblings, simulated=sc.simulated,
      accept_p=accept_table if sc.simulated else None, max_depth=tree.max_depth,
      max_children=tree.width, drafted=d.drafted)


def draft_path(d: DraftedTree, path, sc):
  """The accepted nodes' slots in the draft's scratch layout [B, D] (-1:
  never fed): DraftedTree.fed, or a static tree's own block indices above
  its deepest level (draft_model.draft_tree_phase's layout)."""
  if d.fed is None:
    depths = sc.tree.block_depths()
    fed = jnp.asarray(np.where(depths < sc.tree.max_depth, np.arange(len(depths)), -1),
                      jnp.int32)[None]
    fed = jnp.broadcast_to(fed, (path.shape[0], fed.shape[1]))
  else:
    fed = d.fed
  return jnp.where(path >= 0, jnp.take_along_axis(fed, jnp.maximum(path, 0), 1), -1)


def emitted(block_tokens, verdict: tree_acceptance.TreeVerdict):
  """[B, D+1]: the accepted path's tokens, then the target's token at
  position n_accepted (past it: filler, never kept)."""
  path = verdict.path  # [B, D] block indices, -1 past n_accepted
  toks = jnp.take_along_axis(block_tokens, jnp.maximum(path, 0), 1)  # [B, D]
  padded = jnp.concatenate([toks, toks[:, :1]], 1)
  pos = jnp.arange(padded.shape[1])[None, :]
  return jnp.where(pos == verdict.n_accepted[:, None], verdict.next_token[:, None], padded)


def path_features(feats, path):
  """The target's hidden states [B, 1+N, E] along [root, accepted path
  [B, D]] -> [B, D+1, E]: what a chain's verify returns at [last, d_1 ..,
  d_k] (EAGLE's features)."""
  idx = jnp.concatenate([jnp.zeros_like(path[:, :1]), jnp.maximum(path, 0)], 1)
  return jnp.take_along_axis(feats, idx[:, :, None], 1)
