"""How a drafted token tree is judged: the path the target keeps and its next token.

The verify block is [root, node_0 .. node_{N-1}] in BFS order (parents[i] =
-1 for a child of the root); p[:, j] is the target's law for block j's
children and q[:, j] the draft's. `judge_tree` returns the accepted path,
its length, the token after it and per-rank counts of the children tried
and accepted, for the greedy rule (the deepest matching path), SpecInfer's
multi-draft rejection sampling (stochastic or top-k siblings; the emitted
sequence follows the target's law) and the simulated table rules. One
uniform per (row, depth, rank) drives every rule, so on a chain it is
acceptance.judge draw for draw. The rules, the per-rank estimates and
Sequoia's unconditional p: docs/trees.md (judging a tree).
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from specjax.decode import acceptance
from specjax.decode.acceptance import AcceptRule
from specjax.errors import ConfigError
from specjax.model import sampling

SIBLINGS = ("stochastic", "topk")


class TreeVerdict(NamedTuple):
  """What one step keeps of each row's tree."""
  path: jax.Array        # [B, Dmax] int32 accepted nodes' block indices, depth 1 first; -1 past n
  n_accepted: jax.Array  # [B] int32
  next_token: jax.Array  # [B] int32 the target's token after the path
  tries: jax.Array       # [B, K] int32 children tried at each sibling rank
  accepts: jax.Array     # [B, K] int32 children accepted at each rank


def _traced(x) -> bool:
  """Whether `x` is a tracer (inside jit: no concrete tree shape to read)."""
  tracer = getattr(getattr(jax, "core", None), "Tracer", None)
  if tracer is not None:
    return isinstance(x, tracer)
  try:  # a jax without the public jax.core.Tracer
    np.asarray(x)
  except jax.errors.TracerArrayConversionError:
    return True
  return False


def tree_shape(parents) -> tuple[int, int]:
  """(max_depth, max_children) of concrete parents [N] or [B, N] (over rows).

  Checks the conventions this module relies on: every parent is -1 or an
  earlier node. Raises ConfigError (one line) otherwise.
  """
  par = np.atleast_2d(np.asarray(parents))
  if par.ndim != 2 or not np.issubdtype(par.dtype, np.integer):
    raise ConfigError(f"tree parents must be integers [N] or [B, N], got {par.dtype} {par.shape}")
  n = par.shape[1]
  if n == 0:
    return 0, 0
  bad = (par < -1) | (par >= np.arange(n))
  if bad.any():
    r, i = np.argwhere(bad)[0]
    raise ConfigError(f"tree node {i} (row {r}) has parent {par[r, i]}: parents must be -1 "
                      "or an earlier node (BFS order)")
  depth = np.zeros_like(par)
  for i in range(n):
    depth[:, i] = np.where(par[:, i] < 0, 1, depth[np.arange(len(par)), par[:, i]] + 1)
  kids = max(int(np.bincount(row + 1).max()) for row in par)
  return int(depth.max()), kids


def accept_table(rule: AcceptRule, max_depth: int, max_children: int) -> np.ndarray:
  """A simulated rule on a tree: accept_p [max_depth, max_children] (float32),
  the probability that the rank-k child tried at depth d + 1 is accepted given
  that the ranks before it were rejected.

    siblings:P1,..  P_k at every depth; ranks past the list take its last value.
    bernoulli:P     P for every child tried (= siblings:P).
    always          1: the rank-0 path to its end.
    fraction:F      1 at depths <= ceil(F * max_depth), 0 deeper (the chain's
                    positions, by depth).
    mean_length:L   on a chain (max_children 1) only: bernoulli with the P
                    whose chain expectation is L. On a wider tree the accepted
                    length is not monotone in P, so it is refused.
  On a chain (max_children 1), column 0 is acceptance.position_probs.
  """
  d, k = int(max_depth), int(max_children)
  if rule.kind == "mean_length" and k > 1:
    raise ConfigError(f"{rule} is defined on chains; on a tree use bernoulli:P or "
                      "siblings:P1,P2,...")
  if rule.kind == "siblings":
    probs = list(rule.probs)
    row = [probs[min(r, len(probs) - 1)] for r in range(k)]
    return np.tile(np.asarray(row, np.float32), (d, 1))
  by_depth = acceptance.position_probs(rule, d)  # bernoulli, fraction, always (real: ones)
  return np.repeat(by_depth[:, None], k, axis=1).astype(np.float32)


def _rows(parents: jax.Array, b: int) -> jax.Array:
  """parents [N] or [B, N] -> [B, N] int32."""
  parents = jnp.asarray(parents, jnp.int32)
  return jnp.broadcast_to(parents, (b, parents.shape[-1]))


def children_table(parents: jax.Array, max_children: int, drafted: jax.Array | None = None,
                   ranks: jax.Array | None = None) -> jax.Array:
  """children [B, 1+N, K]: the block index of the rank-k child of block j, -1
  where there is none (the first-child/next-sibling structure as a table).

  Ranks default to the order of the (drafted) siblings, the conventions' BFS
  order; given ranks may leave gaps (empty slots are skipped). Nodes not
  drafted, and ranks >= max_children, get no slot.
  parents [B, N]; drafted [B, N] bool or None; ranks [B, N] or None.
  """
  b, n = parents.shape
  live = jnp.ones((b, n), bool) if drafted is None else jnp.asarray(drafted, bool)
  if ranks is None:
    earlier = jnp.arange(n)[None, :] < jnp.arange(n)[:, None]  # [i, j]: j < i
    same = (parents[:, :, None] == parents[:, None, :]) & earlier[None] & live[:, None, :]
    ranks = jnp.sum(same, -1)
  ranks = jnp.where(live, jnp.asarray(ranks, jnp.int32), max_children)  # out of range: dropped
  table = jnp.full((b, n + 1, max_children), -1, jnp.int32)
  rows = jnp.broadcast_to(jnp.arange(b)[:, None], (b, n))
  blocks = jnp.broadcast_to(jnp.arange(1, n + 1, dtype=jnp.int32)[None], (b, n))
  return table.at[rows, parents + 1, ranks].set(blocks, mode="drop")


def residual(r: jax.Array, law: jax.Array) -> jax.Array:
  """r after a rejected sibling drawn from `law`: norm(max(0, r - law)).

  With law = onehot(x) this is r with x's mass removed, renormalized. When no
  mass is left the rejection had probability 0, and r is kept.
  r, law [B, V].
  """
  res = jnp.maximum(r - law, 0.0)
  mass = jnp.sum(res, -1, keepdims=True)
  return jnp.where(mass > 0, res / jnp.where(mass > 0, mass, 1.0), r)


def sibling_law(siblings: str, q_node: jax.Array | None, x: jax.Array, v: int) -> jax.Array:
  """The law a sibling was drawn from [B, V]: q at its parent (stochastic),
  or onehot(x) (top-k: the draft's k-th choice is a function of the context)."""
  if siblings == "topk":
    return jax.nn.one_hot(x, v, dtype=jnp.float32)
  return q_node


def _walk(u, children, drafts, p, q, accept_p, siblings: str, simulated: bool):
  """The exact (or simulated) walk: (path [B, D], law of the next token [B, V]).

  u [B, D, K]; children [B, T, K]; drafts [B, N]; p, q [B, T, V] (q None for
  top-k siblings or a simulated rule); accept_p [D, K].
  """
  b, _, v = p.shape
  d_max, k_max = u.shape[1:]
  rows = jnp.arange(b)

  def level(d, st):
    node, done, r, path = st                           # [B], [B], [B, V], [B, D]
    kids = children[rows, node]                        # [B, K]
    trying = ~done & jnp.any(kids >= 0, -1)
    r = jnp.where(trying[:, None], p[rows, node], r)   # a leaf keeps its parent's r
    q_node = None if q is None else q[rows, node]

    def sibling(k, inner):
      took, r = inner
      child = kids[:, k]
      live = trying & (child >= 0) & (took < 0)
      x = drafts[rows, jnp.maximum(child - 1, 0)]
      if simulated:
        ok = u[:, d, k] < accept_p[d, k]
      else:
        law = sibling_law(siblings, q_node, x, v)
        ok = acceptance.exact_accepts(u[:, d, k], r[rows, x], law[rows, x])
        r = jnp.where((live & ~ok)[:, None], residual(r, law), r)
      return jnp.where(live & ok, child, took), r

    took, r = jax.lax.fori_loop(0, k_max, sibling, (jnp.full((b,), -1, jnp.int32), r))
    path = path.at[:, d].set(took)
    return jnp.where(took >= 0, took, node), done | (took < 0), r, path

  init = (jnp.zeros((b,), jnp.int32), jnp.zeros((b,), bool), p[:, 0],
          jnp.full((b, d_max), -1, jnp.int32))
  node, _, r, path = jax.lax.fori_loop(0, d_max, level, init)
  leaf = ~jnp.any(children[rows, node] >= 0, -1)
  return path, jnp.where(leaf[:, None], p[rows, node], r)  # the bonus at a leaf


def _deepest(parents, drafts, p, live, max_depth: int):
  """Greedy: path [B, D] of the deepest node whose path matches the target's
  argmax at every parent (first in BFS order on ties), and p at its end."""
  b, n = parents.shape
  rows = jnp.arange(b)
  # draft == argmax at the parent, as p(draft) == max p (one-hot p: the same;
  # XLA's CPU argmax over [B, T, V] costs ~40x a max)
  p_x = p[rows[:, None], parents + 1, drafts]                          # [B, N]
  match = (p_x >= jnp.take_along_axis(jnp.max(p, -1), parents + 1, 1)) & live
  ok, depth = match, jnp.ones_like(parents)
  up = jnp.maximum(parents, 0)
  for _ in range(max_depth - 1):  # ancestors' matches, one level per pass
    ok = match & ((parents < 0) | jnp.take_along_axis(ok, up, 1))
    depth = jnp.where(parents < 0, 1, jnp.take_along_axis(depth, up, 1) + 1)
  score = jnp.where(ok, depth * (n + 1) - jnp.arange(n), -1)
  best = jnp.argmax(score, -1).astype(jnp.int32)
  found = jnp.max(score, -1) >= 0
  n_acc = jnp.where(found, depth[rows, best], 0)
  path = jnp.full((b, max_depth), -1, jnp.int32)
  cur = best
  for j in range(max_depth):  # the j-th ancestor sits at depth n_acc - j
    at = jnp.where(n_acc - 1 - j >= 0, n_acc - 1 - j, max_depth)
    path = path.at[rows, at].set(cur + 1, mode="drop")
    cur = jnp.maximum(parents[rows, cur], 0)
  end = jnp.where(found, best + 1, 0)
  return path, p[rows, end]


def rank_counts(children: jax.Array, path: jax.Array) -> tuple[jax.Array, jax.Array]:
  """(tries, accepts) [B, K]: at the root and each accepted node, its children
  up to the accepted one's rank were tried (all of them at the last node)."""
  b, _, k_max = children.shape
  rows, ranks = jnp.arange(b), jnp.arange(k_max)
  tries = accepts = jnp.zeros((b, k_max), jnp.int32)
  node, active = jnp.zeros((b,), jnp.int32), jnp.ones((b,), bool)
  for d in range(path.shape[1] + 1):
    chosen = path[:, d] if d < path.shape[1] else jnp.full((b,), -1, jnp.int32)
    kids = children[rows, node]                                       # [B, K]
    hit = (kids == chosen[:, None]) & (chosen >= 0)[:, None]
    rank = jnp.where(jnp.any(hit, -1), jnp.argmax(hit, -1), k_max)
    tries += ((kids >= 0) & (ranks <= rank[:, None]) & active[:, None]).astype(jnp.int32)
    accepts += (hit & active[:, None]).astype(jnp.int32)
    active &= chosen >= 0
    node = jnp.maximum(chosen, 0)
  return tries, accepts


def judge_tree(key, parents, drafts, p, q=None, *, greedy: bool = False,
               siblings: str = "stochastic", simulated: bool = False, accept_p=None,
               max_depth: int | None = None, max_children: int | None = None,
               drafted=None, ranks=None) -> TreeVerdict:
  """Decides which path of each row's tree to keep and the token after it.

  Meant to be traced inside the caller's jit: the keyword settings are static
  (greedy, siblings, simulated, max_depth, max_children), the arrays may be
  traced.
  Args:
    key: PRNG key for this step's acceptance.
    parents: [N] or [B, N] int32, -1 for a child of the root (module doc).
    drafts: [B, N] the nodes' draft tokens.
    p: [B, 1+N, V] target distributions after the sampling transforms.
    q: [B, 1+N, V] the distributions the children were drawn from (used by
      exact sampling with stochastic siblings; may be None otherwise).
    greedy: temperature 0 (p is one-hot; the real rule matches argmaxes).
    siblings: "stochastic" (i.i.d. from q) or "topk" (the draft's top-k).
    simulated: a simulated rule with accept_p [max_depth, max_children] from
      accept_table (may be traced: one compilation serves every rule).
    max_depth, max_children: static bounds of the tree; derived from concrete
      parents when omitted (required when parents are traced).
    drafted: [B, N] bool, nodes really drafted (others are never tried).
    ranks: [B, N] sibling ranks when they are not the BFS order's.
  Returns:
    TreeVerdict(path [B, Dmax], n_accepted [B], next_token [B], tries [B, K],
    accepts [B, K]).
  """
  if siblings not in SIBLINGS:
    raise ConfigError(f"siblings must be one of {', '.join(SIBLINGS)}, got {siblings!r}")
  if max_depth is None or max_children is None:
    if _traced(parents):
      raise ConfigError("judge_tree needs max_depth and max_children for traced parents")
    depth, kids = tree_shape(parents)
    max_depth = depth if max_depth is None else max_depth
    max_children = kids if max_children is None else max_children
  elif not _traced(parents):
    depth, kids = tree_shape(parents)
    if depth > max_depth or kids > max_children:
      raise ConfigError(f"tree of depth {depth} with {kids} children per node exceeds "
                        f"max_depth={max_depth}, max_children={max_children}")
  if q is None and not (greedy or simulated or siblings == "topk"):
    raise ConfigError("exact sampling with stochastic siblings needs the draft's q")
  b = drafts.shape[0]
  parents = _rows(parents, b)
  drafts = jnp.asarray(drafts, jnp.int32)
  live = jnp.ones(drafts.shape, bool) if drafted is None else jnp.asarray(drafted, bool)
  children = children_table(parents, max_children, live, ranks)
  k_u, k_tok = jax.random.split(key)
  u = jax.random.uniform(k_u, (b, max_depth, max_children))
  if greedy and not simulated:
    path, law = _deepest(parents, drafts, p, live, max_depth)
  else:
    table = (jnp.ones((max_depth, max_children)) if accept_p is None
             else jnp.asarray(accept_p, jnp.float32))
    path, law = _walk(u, children, drafts, p, q, table, siblings, simulated)
  nxt = sampling.argmax(law) if greedy else sampling.sample(k_tok, law)
  tries, accepts = rank_counts(children, path)
  return TreeVerdict(path, jnp.sum(path >= 0, -1).astype(jnp.int32), nxt, tries, accepts)

