"""Token trees in theory: tokens per step under positional acceptance,
Sequoia's optimal tree, the predicted speedup from measured costs, and the
positional acceptance vector estimated by rank.

Sources: [S24] Chen et al., "Sequoia: Scalable, Robust, and Hardware-aware
Speculative Decoding" (arXiv:2402.12374), the positional acceptance model
and the dynamic program over trees; [L23] Leviathan et al., ICML 2023,
Equation (1), what a chain reduces to.

A tree is given as its rank paths (metrics never imports model): node i is
the tuple of sibling ranks from the root, e.g. (0,), (1,), (0, 0); the root
is implicit. `canonical_paths` checks them (ranks without gaps, every parent
present) and sorts them into BFS order, that of specjax.model.tree.Tree.
The derivations (rank weights, the law of the accepted length, the DP, the
rank estimate): docs/trees.md, "Trees: theory". Pure numpy.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Union

import numpy as np

from specjax.errors import ConfigError, SpecjaxError
from specjax.metrics import theory

Path = tuple[int, ...]
Paths = Sequence[Sequence[int]]
# Seconds of one draft level as a function of its width (nodes drafted from):
# a callable, {width: seconds}, a sequence indexed by width, or one number.
DraftCost = Union[Callable[[int], float], Mapping[int, float], Sequence[float], float]

PRIOR_P = (0.7, 0.3, 0.2, 0.1)  # rank 0 as autogamma's PRIOR_ALPHA; later ranks repeat the last
PRIOR_WEIGHT = 2.0              # pseudo-trials per rank at the prior
MARGINAL_SLACK = 1e-6           # a marginal vector's sum may pass 1 by float32 rounding


# --- Topology as rank paths ----------------------------------------------------


def canonical_paths(paths: Paths) -> tuple[Path, ...]:
  """The rank paths checked and in BFS order: by depth, then parent, then rank.

  Within a depth, BFS order (parents in their own order, siblings by rank)
  is the lexicographic order of the paths, so the order is (len, path)
  whatever the input order. Raises ConfigError (one line) for a malformed
  path, a duplicate, a node whose parent is missing, or a rank gap.
  """
  if isinstance(paths, (str, bytes)) or not isinstance(paths, Sequence):
    raise ConfigError(f"a tree is a list of paths (lists of sibling ranks), got {paths!r}")
  if not paths:
    raise ConfigError("a tree needs at least one node, got an empty list")
  seen: set[Path] = set()
  for raw in paths:
    raw = raw.tolist() if isinstance(raw, np.ndarray) else raw
    ok = (isinstance(raw, Sequence) and not isinstance(raw, (str, bytes)) and len(raw) > 0
          and all(isinstance(r, (int, np.integer)) and not isinstance(r, bool) and r >= 0
                  for r in raw))
    if not ok:
      raise ConfigError(f"malformed path {raw!r}: a path is a non-empty list of sibling "
                        "ranks >= 0 (the root is implicit)")
    path = tuple(int(r) for r in raw)
    if path in seen:
      raise ConfigError(f"duplicate path {list(path)} in the tree")
    seen.add(path)
  for path in seen:
    if len(path) > 1 and path[:-1] not in seen:
      raise ConfigError(f"path {list(path)} has no parent {list(path[:-1])} in the tree")
    if path[-1] > 0 and path[:-1] + (path[-1] - 1,) not in seen:
      raise ConfigError(f"path {list(path)} has no earlier sibling "
                        f"{list(path[:-1] + (path[-1] - 1,))} (sibling ranks count from 0 "
                        "without gaps)")
  return tuple(sorted(seen, key=lambda q: (len(q), q)))


def paths_from_parents(parents: Sequence[int], ranks: Sequence[int]) -> tuple[Path, ...]:
  """Rank paths of nodes given by parent index (-1 = the root) and rank;
  a parent must come before its children."""
  out: list[Path] = []
  for i, (a, r) in enumerate(zip(parents, ranks)):
    if not -1 <= a < i:
      raise ConfigError(f"node {i} has parent {a}: parents must come first (BFS order)")
    out.append((out[a] if a >= 0 else ()) + (int(r),))
  return tuple(out)


def draft_widths(paths: Paths) -> tuple[int, ...]:
  """Nodes the draft runs at each level: level d (1..D) drafts the children
  of the depth d-1 nodes, so its width is their number (the root: 1).
  A chain of gamma gives (1,) * gamma."""
  paths = canonical_paths(paths)
  depth = max(len(q) for q in paths)
  counts = np.bincount([len(q) for q in paths], minlength=depth + 1)
  counts[0] = 1
  return tuple(int(c) for c in counts[:depth])


# --- Tokens per step -------------------------------------------------------------


def _sibling_probs(p: Sequence[float]) -> np.ndarray:
  arr = np.asarray(p, dtype=float).ravel()
  if arr.size == 0 or np.any(~((arr >= 0.0) & (arr <= 1.0))):
    raise SpecjaxError(f"p must be a non-empty vector of probabilities in [0, 1], got {p!r}")
  return arr


def rank_weights(p: Sequence[float], width: int) -> np.ndarray:
  """w_k = p_k prod_{j<k} (1 - p_j), k = 0..width-1: the probability that the
  rank-k child is the accepted one, given its parent was accepted [S24].
  Ranks at or past len(p) get 0. Shape [width]."""
  arr = _sibling_probs(p)
  q = np.zeros(max(int(width), 0))
  q[:min(arr.size, q.size)] = arr[:q.size]
  missed = np.concatenate([[1.0], np.cumprod(1.0 - q)[:-1]])[:q.size]
  return q * missed


def conditional_from_marginal(w: Sequence[float]) -> np.ndarray:
  """specjax's p from [S24]'s acceptance vector, the inverse of `rank_weights`:
  p_k = w_k / (1 - sum_{j<k} w_j), w_k being the probability that the rank-k
  child is the accepted one (what Sequoia's tree_search reads, without its
  leading 0 and its last entry, P(no child accepted)). Ranks that the earlier
  ones leave no mass to get p = 0. Exact: rank_weights(p, len(w)) == w.
  Raises ConfigError (one line) when w is not a sub-probability vector."""
  arr = np.asarray(w, dtype=float).ravel()
  if arr.size == 0 or np.any(~((arr >= 0.0) & (arr <= 1.0))):
    raise ConfigError(f"a marginal acceptance vector holds probabilities in [0, 1], got {w!r}")
  if arr.sum() > 1.0 + MARGINAL_SLACK:
    raise ConfigError(f"a marginal acceptance vector sums to at most 1 (each entry is the "
                      f"chance that that rank is the accepted child), got {arr.sum():.6g}")
  left = 1.0 - np.concatenate([[0.0], np.cumsum(arr)[:-1]])  # mass not taken by ranks < k
  return np.where(left > MARGINAL_SLACK, np.clip(arr / np.maximum(left, MARGINAL_SLACK), 0.0, 1.0),
                  0.0)


def path_probs(paths: Paths, p: Sequence[float]) -> np.ndarray:
  """P(node i lies on the accepted path), nodes in BFS order: [N]."""
  paths = canonical_paths(paths)
  w = rank_weights(p, 1 + max(max(q) for q in paths))
  return np.array([float(np.prod(w[list(q)])) for q in paths])


def tokens_per_step(paths: Paths, p: Sequence[float]) -> float:
  """Expected tokens per step of a tree under positional acceptance:
  1 + sum over nodes of the product of w_rank along the node's path (the
  accepted drafts plus the correction or bonus token). On a chain of gamma
  it is [L23] Equation (1) at alpha = p_0."""
  return float(1.0 + path_probs(paths, p).sum())


def accept_pmf(paths: Paths, p: Sequence[float]) -> np.ndarray:
  """P(accepted drafts = k), k = 0..max depth: the law of the accepted
  length (theory.expected_batch_steps takes it). At most one node of each
  depth is on the accepted path, so P(k >= d) is the sum of the depth-d
  nodes' path probabilities."""
  paths = canonical_paths(paths)
  depth = np.array([len(q) for q in paths])
  reach = np.concatenate([[1.0], np.bincount(depth, weights=path_probs(paths, p))[1:]])
  return reach - np.concatenate([reach[1:], [0.0]])


# --- Sequoia's dynamic program ---------------------------------------------------


def _dp(w: np.ndarray, n: int, depth: int):
  """V[d][m]: the best sum of path probabilities of m nodes hung below one
  node, at most d levels deep (-inf where impossible); pick[d][r][m]: how
  many nodes the best puts in the subtree of the rank-r child when ranks
  r.. share m nodes (0: no rank-r child, hence none after it)."""
  V = np.full((depth + 1, n + 1), -np.inf)
  V[:, 0] = 0.0
  pick = np.zeros((depth + 1, n + 1, n + 1), dtype=np.int64)  # [d, r, m]
  m = np.arange(n + 1)[:, None]
  s = np.arange(n + 1)[None, :]
  for d in range(1, depth + 1):
    below = V[d - 1]                                       # [n+1]: sizes s-1 below the child
    fits = np.isfinite(below)
    below = np.where(fits, below, 0.0)
    sub = np.full(n + 1, -np.inf)                          # s -> value of a rank-r subtree of s nodes
    g = np.where(np.arange(n + 1) == 0, 0.0, -np.inf)      # ranks >= n: nothing more to place
    for r in range(n - 1, -1, -1):
      sub[1:] = np.where(fits[:-1], w[r] * (1.0 + below[:-1]), -np.inf)
      rest = np.where(s <= m, g[np.clip(m - s, 0, n)], -np.inf)     # [m, s]
      cand = np.where((s >= 1) & (s <= m), sub[s.ravel()][None, :] + rest, -np.inf)
      cand[:, 0] = np.where(m.ravel() == 0, 0.0, -np.inf)  # stop: only with nothing left
      pick[d, r] = np.argmax(cand, axis=1)
      g = cand[np.arange(n + 1), pick[d, r]]
    V[d] = g
  return V, pick


def best_tree(p: Sequence[float], n: int, max_depth: int) -> tuple[tuple[Path, ...], float]:
  """The tree of n nodes and depth <= max_depth with the most expected
  tokens per step under positional acceptance p, and that value ([S24]'s
  dynamic program, derived here).

  The root's children take ranks 0..c-1 and split the n nodes into subtrees
  of s_0.. s_{c-1} >= 1 nodes; the rank-r subtree is worth w_r (1 + V(s_r - 1,
  d - 1)), V(m, d) the best value of m nodes below a node at most d deep.
  Ranks are placed in order with the nodes left, G_r(m) = max(0 if m == 0,
  max_s w_r (1 + V(s-1, d-1)) + G_{r+1}(m - s)), V(m, d) = G_0(m):
  O(n^3 d) in numpy. Ties go to the smaller first subtree.

  Returns:
    (rank paths in BFS order, expected tokens per step = 1 + V(n, max_depth)).
  """
  n, max_depth = int(n), int(max_depth)
  if n < 1 or max_depth < 1:
    raise ConfigError(f"a tree needs n >= 1 nodes and depth >= 1, got n={n}, depth={max_depth}")
  depth = min(max_depth, n)
  w = rank_weights(p, n)
  V, pick = _dp(w, n, depth)
  out: list[Path] = []

  def place(prefix: Path, d: int, m: int) -> None:
    r = 0
    while m > 0:
      size = int(pick[d, r, m])
      out.append(prefix + (r,))
      place(prefix + (r,), d - 1, size - 1)
      m, r = m - size, r + 1

  place((), depth, n)
  return canonical_paths(out), float(1.0 + V[depth, n])


def best_values(p: Sequence[float], n: int, max_depth: int) -> np.ndarray:
  """Expected tokens per step of the best tree of m nodes, m = 0..n, depth
  <= max_depth (one dynamic program): [n + 1], entry 0 = 1 (no drafts)."""
  depth = max(1, min(int(max_depth), int(n)))
  V, _ = _dp(rank_weights(p, n), int(n), depth)
  return 1.0 + V[depth]


def live_paths(paths: Paths, p: Sequence[float]) -> tuple[Path, ...]:
  """The nodes of `paths` that p can accept (path probability > 0), and the
  earlier siblings such a node's rank needs (a p_k = 0 rank before a
  positive one): the tree without the nodes that only take verify slots.
  The DP fills n nodes whatever p, so past what depth and p's nonzero ranks
  hold (p = (0.6, 0.2, 0.1), depth 2: 3 + 9 = 12) the rest weigh 0. Same
  tokens per step; BFS order; raises ConfigError when p accepts no node."""
  paths = canonical_paths(paths)
  live = {q for q, w in zip(paths, path_probs(paths, p)) if w > 0.0}
  if not live:
    raise ConfigError(f"p = {list(np.ravel(p))} accepts no node of the tree")
  keep = live | {q[:-1] + (r,) for q in live for r in range(q[-1])}
  return tuple(q for q in paths if q in keep)


# --- Predicted speedup and the chooser -------------------------------------------


def _draft_seconds(t_draft_level: DraftCost, widths: Sequence[int]) -> float:
  if callable(t_draft_level):
    costs = [t_draft_level(w) for w in widths]
  elif isinstance(t_draft_level, Mapping):
    missing = [w for w in widths if w not in t_draft_level]
    if missing:
      raise SpecjaxError(f"no measured draft cost at width(s) {sorted(set(missing))}")
    costs = [t_draft_level[w] for w in widths]
  elif isinstance(t_draft_level, Sequence) or np.ndim(t_draft_level) == 1:
    table = np.asarray(t_draft_level, dtype=float)
    if max(widths) >= table.size:
      raise SpecjaxError(f"draft cost table has widths < {table.size}, needs {max(widths)}")
    costs = [table[w] for w in widths]
  else:
    costs = [float(t_draft_level)] * len(widths)
  costs = np.asarray(costs, dtype=float)
  if np.any(~(costs >= 0.0)):
    raise SpecjaxError(f"draft level costs must be >= 0, got {costs.tolist()}")
  return float(costs.sum())


def tree_speedup(tokens: float, widths: Sequence[int], t_draft_level: DraftCost,
                 t_target: float, t_verify: float, t_accept: float = 0.0) -> float:
  """Predicted speedup of a tree from measured costs at one batch B:

    tokens * T_target(B, 1) / (sum_levels T_draft_level(B, width) + T_target(B, N+1) + T_accept)

  with `widths` the draft's width per level (`draft_widths`). A chain of
  gamma (widths (1,) * gamma) is theory.measured_cost_speedup with
  t_draft = T_draft_level(1) and t_overhead = T_accept.
  """
  step = _draft_seconds(t_draft_level, widths) + float(t_verify) + float(t_accept)
  if not (step > 0.0 and t_target > 0.0):
    raise SpecjaxError(f"need positive times, got a step of {step} s, T_target(1) = {t_target} s")
  return float(tokens) * float(t_target) / step


def predicted_speedups(trees: Mapping[str, Paths], p: Sequence[float], curve: theory.Curve,
                       t_draft_level: DraftCost,
                       t_accept: Union[float, Mapping[str, float]] = 0.0,
                       n_tokens: int | None = None, rows: int = 1) -> dict[str, float]:
  """Predicted speedup of each candidate tree at the batch its costs were
  measured at: T_target(B, n) read off `curve` (theory.verify_time_from_curve;
  it must cover 1 and every N + 1). Steady state, or, given n_tokens, a run of
  n_tokens per row over `rows` rows with the tail effect
  (theory.batch_speedup_at_step on `accept_pmf`)."""
  t1 = theory.verify_time_from_curve(curve, 1)
  out = {}
  for name, paths in trees.items():
    paths = canonical_paths(paths)
    accept = t_accept.get(name, 0.0) if isinstance(t_accept, Mapping) else t_accept
    step = (_draft_seconds(t_draft_level, draft_widths(paths))
            + theory.verify_time_from_curve(curve, len(paths) + 1) + float(accept))
    if n_tokens is None:
      out[name] = float(tokens_per_step(paths, p) * t1 / step)
    else:
      out[name] = theory.batch_speedup_at_step(accept_pmf(paths, p), n_tokens, rows, t1, step)
  return out


def choose(trees: Mapping[str, Paths], p: Sequence[float], curve: theory.Curve,
           t_draft_level: DraftCost, t_accept: Union[float, Mapping[str, float]] = 0.0,
           n_tokens: int | None = None, rows: int = 1) -> str:
  """The candidate with the largest predicted speedup (on a tie, the one with
  fewer nodes, then the first given)."""
  pred = predicted_speedups(trees, p, curve, t_draft_level, t_accept, n_tokens, rows)
  order = {name: i for i, name in enumerate(trees)}
  return max(pred, key=lambda k: (pred[k], -len(trees[k]), -order[k]))


def candidates(p: Sequence[float], sizes: Sequence[int] = (4, 8, 16, 32, 64),
               max_depth: int = 8, chains: Sequence[int] = (1, 2, 4, 8)) -> dict[str, tuple[Path, ...]]:
  """Candidate trees for `choose`: the chains 'chain:g' and the best trees
  'sequoia:n,d' of each size at this p (names that model.tree.parse reads),
  without the nodes p cannot accept (`live_paths`)."""
  out = {f"chain:{g}": tuple((0,) * k for k in range(1, g + 1)) for g in chains}
  for n in sizes:
    out[f"sequoia:{n},{max_depth}"] = live_paths(best_tree(p, n, max_depth)[0], p)
  return out


# --- The positional acceptance vector from counts ---------------------------------


def rank_counts(paths: Paths, accepted: Sequence[int]) -> tuple[np.ndarray, np.ndarray]:
  """(accepted [W], tried [W]) by rank for one step that accepted the node
  path `accepted` (its ranks from the root; () when nothing was accepted),
  W the tree's widest sibling group: at each level the children of the
  accepted node are tried in rank order up to the accepted one, or all of
  them where the step ended."""
  paths = canonical_paths(paths)
  width = 1 + max(max(q) for q in paths)
  kids: dict[Path, int] = {}
  for q in paths:
    kids[q[:-1]] = max(kids.get(q[:-1], 0), q[-1] + 1)
  acc, tried = np.zeros(width, np.int64), np.zeros(width, np.int64)
  node: Path = ()
  known = set(paths)
  for r in list(accepted) + [None]:
    if r is not None and node + (r,) not in known:
      raise SpecjaxError(f"accepted path {list(accepted)} is not in the tree")
    upto = kids.get(node, 0) if r is None else r + 1
    tried[:upto] += 1
    if r is None:
      break
    acc[r] += 1
    node = node + (r,)
  return acc, tried


def estimate_p(accepted: Sequence[float], tried: Sequence[float],
               prior: Sequence[float] = PRIOR_P, prior_weight: float = PRIOR_WEIGHT) -> np.ndarray:
  """p_k = (accepted_k + w prior_k) / (tried_k + w) for each rank k, the
  positional model's maximum likelihood with w pseudo-trials at the prior
  (as decode/autogamma.estimate_alpha); prior ranks past its end repeat its
  last value. [len(tried)]."""
  a, t = np.asarray(accepted, dtype=float), np.asarray(tried, dtype=float)
  if a.shape != t.shape or a.ndim != 1 or np.any(a < 0) or np.any(a > t):
    raise SpecjaxError(f"need 0 <= accepted <= tried by rank, got {accepted!r}, {tried!r}")
  pri = _sibling_probs(prior)
  pri = np.concatenate([pri, np.full(max(0, t.size - pri.size), pri[-1])])[:t.size]
  return (a + prior_weight * pri) / (t + prior_weight)
