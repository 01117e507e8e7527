"""A token tree's speculative step (--tree): the verify of [last, node_0 ..
node_{N-1}] in one pass under the tree mask (steps.tree_verify: each node at
position length + depth, the block in scratch slots), the judge
(tree_acceptance.judge_tree: greedy's deepest matching path, SpecInfer's
multi-draft rejection sampling, or a simulated rule's table by depth and
rank), and the verdict `TreeJudged`, which commits itself: the kept path's
K/V moved into place (kv_cache.commit_path) in the target's cache, and the
draft's through drafters.base.TreeCommitted. The same signature as
chain_step.ChainStep; a chain-shaped tree is the chain, token for token
(tests/decode/test_trees.py). docs/trees.md.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from specjax.decode import tree_acceptance
from specjax.decode.acceptance import AcceptRule
from specjax.decode.chain_step import ChainStep, Judged
from specjax.drafters.base import DraftedTree, TreeCommitted
from specjax.model import kv_cache as kvc
from specjax.model import sampling
from specjax.model import steps
from specjax.model.tree import Tree


def accept_probs(rule: AcceptRule, tree: Tree) -> np.ndarray:
  """The traced acceptance table of a simulated rule on `tree`
  [max_depth, width] (ones for the real rule: unused)."""
  return tree_acceptance.accept_table(rule, tree.max_depth, tree.width)


@struct.dataclass
class TreeJudged(Judged):
  """A tree step's verdict: the chain's, with the accepted path."""
  path: jax.Array = None        # [B, D] the accepted nodes' block indices (-1 past n_acc)
  draft_path: jax.Array = None  # [B, D] ... their slots in the draft's scratch layout (-1: never fed)

  @property
  def leaf(self) -> jax.Array:
    return jnp.take_along_axis(jnp.concatenate([jnp.zeros_like(self.path[:, :1]), self.path], 1),
                               self.n_acc[:, None], 1)[:, 0]

  def commit_target(self, tcache, kept, dropped, live, features):
    """The kept path's K/V into place (root + kept - 1 nodes), its features in order."""
    del dropped
    tcache = kvc.commit_path(tcache, self.path, jnp.where(live, kept - 1, -1))
    return tcache, None if features is None else path_features(features, self.path)

  def committed(self, **kw) -> TreeCommitted:
    return TreeCommitted(n_acc=self.n_acc, emitted=self.emitted, d_len=self.d_len,
                         path=self.path, draft_path=self.draft_path, **kw)


def verify_phase(tparams, tcache, tail, d: DraftedTree, sc):
  """Target distributions p [B, 1+N, V] over the tree block, tcache with the
  block in scratch slots (lengths unchanged), and the target's hidden states
  [B, 1+N, E] for a drafter that `needs_features` (else None; its
  `feature_layers`: those layers' outputs, [B, 1+N, len * E])."""
  block = jnp.concatenate([tail[:, 1:], d.tokens], 1)  # [B, 1+N]
  mask = sc.tree.mask() if d.mask is None else d.mask
  out = steps.tree_verify(tparams, block, mask, tcache, sc.target,
                          return_hidden=sc.drafter.needs_features,
                          hidden_layers=sc.drafter.feature_layers)
  feats = out[2] if sc.drafter.needs_features else None
  return sampling.probs(out[0], sc.sp), out[1], feats


def verdict(key, accept_table, p, d: DraftedTree, sc) -> tree_acceptance.TreeVerdict:
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
  its deepest level (drafters/walkers.py `static_tree`'s layout)."""
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


def accept_phase(key, accept_table, p, drafted: DraftedTree, tail, n, live, sc) -> TreeJudged:
  """The accepted path's tokens then the target's token, as a chain of that
  length would emit them; rows that are not `live` keep their state."""
  v = verdict(key, accept_table, p, drafted, sc)
  block = jnp.concatenate([tail[:, 1:], drafted.tokens], 1)  # [B, 1+N]
  toks = emitted(block, v)  # [B, D+1]
  last = jnp.take_along_axis(toks, v.n_accepted[:, None], 1)[:, 0]
  prev = jnp.take_along_axis(jnp.concatenate([tail[:, 1:], toks], 1),
                             v.n_accepted[:, None], 1)[:, 0]
  keep = lambda new, old: jnp.where(live, new, old)
  new_n = n + v.n_accepted + 1
  # The draft fed the root and every accepted node but perhaps the last (a
  # static tree's deepest level, a dynamic tree's node outside its frontier).
  dpath = draft_path(drafted, v.path, sc)
  n_fed = jnp.sum(dpath >= 0, -1)
  return TreeJudged(n_acc=v.n_accepted, emitted=toks,
                    tail=jnp.where(live[:, None], jnp.stack([prev, last], 1), tail),
                    n=keep(new_n, n), t_len=keep(new_n - 1, n - 1),
                    d_len=keep(n + n_fed, n - 1), path=v.path, draft_path=dpath)


class TreeStep(ChainStep):
  """A token tree's phases (module docstring); no per-row state (ChainStep's
  start_rows, allot)."""

  @staticmethod
  def propose(dparams, dstate, tcache, tail, n, live, key, sc):
    return sc.drafter.propose_tree(dparams, dstate, tcache, tail, n, live, key, sc)

  @staticmethod
  def verify(tparams, tcache, tail, drafted: DraftedTree, sc):
    return verify_phase(tparams, tcache, tail, drafted, sc)

  @staticmethod
  def judge(key, accept_table, p, drafted, tail, n, live, sc) -> TreeJudged:
    return accept_phase(key, accept_table, p, drafted, tail, n, live, sc)

  @staticmethod
  def accept_table(rule: AcceptRule, sc) -> np.ndarray:
    return accept_probs(rule, sc.tree)


TREE = TreeStep()
