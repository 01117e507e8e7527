"""Token-tree shapes and the `--tree=SPEC` flag.

A `Tree` is N draft nodes in BFS order (siblings in rank order) below an
implicit root, the step's last token; the verify block is [root, node_0 ..
node_{N-1}], block j at RoPE position length + its depth, attending to the
cache and its ancestors (`mask`). A `DynamicTree` (EAGLE-2, one per row) is
described by its fixed shapes; its arrays are built on device. Both share
one small protocol: `n`, `max_depth`, `block_size`, `fed_slots`, `width`,
`graft`, `spec`. `parse` reads chain[:G], JSON rank paths or a .json file,
kary:K,D, sequoia:N,D[:p..|:marginal=w..], dynamic:K,D,N[+ngram:L], one
line of error for each bad spec (`auto` is a run mode: decode/plan.py).
The specs and the theory: docs/trees.md.
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Sequence

import numpy as np
from absl import logging

from specjax.errors import CacheOverflowError, ConfigError
from specjax.metrics import tree_theory

MAX_NODES = 1024                 # a bigger static tree is surely a typo
SEQUOIA_P = (0.6, 0.2, 0.1)      # sequoia:N,D's positional acceptance unless given
MARGINAL_SUM_ONE = 1e-4          # marginal w this close to summing to 1: P(none) left in


@dataclasses.dataclass(frozen=True)
class Tree:
  """A static tree of N nodes in BFS order (module docstring).

  parents[i]: the parent node of node i (-1: a child of the root);
  depths[i]: 1 for a child of the root; ranks[i]: 0-based rank among its
  siblings. `name` is the spec it came from (not part of equality).
  """
  parents: tuple[int, ...]
  depths: tuple[int, ...]
  ranks: tuple[int, ...]
  name: str = dataclasses.field(default="", compare=False)

  def __post_init__(self):
    for field in ("parents", "depths", "ranks"):  # tuples of ints: hashable, a static arg
      object.__setattr__(self, field, tuple(int(x) for x in getattr(self, field)))
    if not len(self.parents) == len(self.depths) == len(self.ranks):
      raise ConfigError(f"tree arrays differ in length: parents {len(self.parents)}, "
                        f"depths {len(self.depths)}, ranks {len(self.ranks)}")
    paths = tree_theory.paths_from_parents(self.parents, self.ranks)
    if tuple(len(q) for q in paths) != tuple(self.depths):
      raise ConfigError(f"tree depths {list(self.depths)} do not follow from its parents")
    if tree_theory.canonical_paths(paths) != paths:
      raise ConfigError("tree nodes are not in BFS order (by depth, parent, rank)")
    if len(paths) > MAX_NODES:
      raise ConfigError(f"a tree of {len(paths)} nodes is over the limit of {MAX_NODES}")

  @property
  def n(self) -> int:
    """Draft nodes N (the verify block is 1 + N tokens)."""
    return len(self.parents)

  @property
  def block_size(self) -> int:
    return 1 + self.n

  @property
  def max_depth(self) -> int:
    return max(self.depths)

  @property
  def width(self) -> int:
    """The most children of any node: the top-k a deterministic drafter needs."""
    return 1 + max(self.ranks)

  @property
  def is_chain(self) -> bool:
    return self.width == 1

  @property
  def fed_slots(self) -> int:
    """Slots of the draft's feed layout: the block's (the deepest level is never fed)."""
    return self.block_size

  @property
  def graft(self) -> int:
    """Tokens of a grafted prompt-lookup chain: none on a static tree."""
    return 0

  @property
  def spec(self) -> str:
    """The name it was parsed from, else its paths as JSON (parse reads both)."""
    return self.name or self.to_json()

  def paths(self) -> tuple[tuple[int, ...], ...]:
    """Each node's sibling ranks from the root, BFS order."""
    return tree_theory.paths_from_parents(self.parents, self.ranks)

  def to_json(self) -> str:
    return json.dumps([list(q) for q in self.paths()], separators=(",", ":"))

  def ancestors(self, i: int) -> tuple[int, ...]:
    """Node i's ancestor nodes, the depth-1 one first (the root excluded)."""
    out = []
    a = self.parents[i]
    while a >= 0:
      out.append(a)
      a = self.parents[a]
    return tuple(reversed(out))

  def block_parents(self) -> np.ndarray:
    """[1 + N] int32: each block index's parent block index (-1 for the root)."""
    return np.array([-1] + [a + 1 for a in self.parents], dtype=np.int32)

  def block_depths(self) -> np.ndarray:
    """[1 + N] int32: depth per block index (root 0); RoPE position = length + this."""
    return np.array((0,) + self.depths, dtype=np.int32)

  def mask(self) -> np.ndarray:
    """[1 + N, 1 + N] bool: M[a, b] = block b is block a or an ancestor of it."""
    t = self.block_size
    m = np.eye(t, dtype=np.bool_)
    m[:, 0] = True
    for i in range(self.n):  # BFS: a parent's row is complete before its children's
      if self.parents[i] >= 0:
        m[i + 1] |= m[self.parents[i] + 1]
    return m

  def child_table(self) -> np.ndarray:
    """[1 + N, width] int32: block indices of each block's children in rank
    order, -1 where it has fewer (the try order of the acceptance)."""
    table = np.full((self.block_size, self.width), -1, dtype=np.int32)
    for i, (a, r) in enumerate(zip(self.parents, self.ranks)):
      table[a + 1, r] = i + 1
    return table

  def level_widths(self) -> tuple[int, ...]:
    """Nodes at each depth 1..max_depth."""
    return tuple(int(c) for c in np.bincount(self.depths, minlength=self.max_depth + 1)[1:])

  def draft_widths(self) -> tuple[int, ...]:
    """Nodes a drafter runs at each level (the depth d-1 nodes drafting level d)."""
    return (1,) + self.level_widths()[:-1]


def from_paths(paths, name: str = "") -> Tree:
  """A Tree from Medusa-style rank paths, in any order (checked: one line)."""
  paths = tree_theory.canonical_paths(paths)
  if len(paths) > MAX_NODES:
    raise ConfigError(f"a tree of {len(paths)} nodes is over the limit of {MAX_NODES}")
  index = {q: i for i, q in enumerate(paths)}
  parents = tuple(index[q[:-1]] if len(q) > 1 else -1 for q in paths)
  return Tree(parents, tuple(len(q) for q in paths), tuple(q[-1] for q in paths), name)


def chain(gamma: int) -> Tree:
  """gamma nodes, each the rank-0 child of the one before: today's verify."""
  if int(gamma) < 1:
    raise ConfigError(f"a chain needs gamma >= 1, got {gamma}")
  g = int(gamma)
  return Tree(tuple(range(-1, g - 1)), tuple(range(1, g + 1)), (0,) * g, f"chain:{g}")


def kary(k: int, d: int) -> Tree:
  """The full k-ary tree of depth d: k + k^2 + .. + k^d nodes."""
  k, d = int(k), int(d)
  if k < 1 or d < 1:
    raise ConfigError(f"kary:K,D needs K >= 1 and D >= 1, got K={k}, D={d}")
  if sum(k**j for j in range(1, d + 1)) > MAX_NODES:
    raise ConfigError(f"kary:{k},{d} has over {MAX_NODES} nodes")
  level = [()]
  paths = []
  for _ in range(d):
    level = [q + (r,) for q in level for r in range(k)]
    paths += level
  return from_paths(paths, f"kary:{k},{d}")


def sequoia(n: int, d: int, p: Sequence[float] = SEQUOIA_P, marginal: bool = False) -> Tree:
  """The best tree of at most n nodes and depth <= d at positional acceptance
  p: conditional (p_k: rank k accepted given ranks 0..k-1 rejected), or with
  `marginal` Sequoia's vector (w_k: rank k is the accepted child), converted
  exactly (tree_theory.conditional_from_marginal). The DP's nodes that p can
  never accept are dropped (tree_theory.live_paths); one log line says what
  was built, a warning when nodes were dropped."""
  if not 1 <= int(n) <= 256:
    raise ConfigError(f"sequoia:N,D needs 1 <= N <= 256, got N={n}")
  cond = tree_theory.conditional_from_marginal(p) if marginal else tuple(p)
  full, value = tree_theory.best_tree(cond, n, d)
  paths = tree_theory.live_paths(full, cond)
  ps = ",".join(np.format_float_positional(float(x), trim="-") for x in p)  # exact round trip
  name = f"sequoia:{int(n)},{int(d)}:{'marginal=' if marginal else ''}{ps}"
  form = "Sequoia's marginal w, converted" if marginal else "conditional p"
  said = (f"{name}: {form}; {len(paths)} nodes, depth {max(map(len, paths))}, "
          f"{value:.4f} tokens/step")
  if len(paths) < len(full):
    logging.warning("%s (%d of the DP's %d nodes dropped: p gives them probability 0)",
                    said, len(full) - len(paths), len(full))
  else:
    logging.info("%s", said)
  return from_paths(paths, name)


@dataclasses.dataclass(frozen=True)
class DynamicTree:
  """EAGLE-2's per-row tree, by its fixed shapes: expand the top-k children
  of each frontier node for `depth` levels, keep the n_nodes with the highest
  cumulative draft log-probability. The verify block is 1 + n_nodes tokens
  of depth <= `depth`; with EAGLE-2's beam (the top k of each level are its
  frontier) there are n_candidates = k + (depth - 1) k^2 to choose from.

  ngram = L > 0 (`dynamic:K,D,N+ngram:L`): the block has L more slots, for
  the prompt-lookup continuation of the row's history (up to L tokens,
  drafters/ngram.py's chain) grafted onto the tree from the root: it
  follows the head's nodes while their tokens agree and goes on as new
  nodes below the last one (drafters/dynamic.py `graft_chain`), so a copy
  from the prompt and the head's guesses are verified in one block."""
  k: int
  depth: int
  n_nodes: int
  ngram: int = 0

  def __post_init__(self):
    if self.k < 1 or self.depth < 1 or self.n_nodes < 1:
      raise ConfigError(f"dynamic:K,D,N needs K, D, N >= 1, got {self.k},{self.depth},{self.n_nodes}")
    if self.n_nodes + self.ngram > MAX_NODES:
      raise ConfigError(f"{self.spec} keeps {self.n_nodes + self.ngram} nodes, over the limit "
                        f"of {MAX_NODES}")
    if self.n_nodes > self.n_candidates:
      raise ConfigError(f"dynamic:{self.k},{self.depth},{self.n_nodes} keeps more nodes than the "
                        f"{self.n_candidates} candidates of K={self.k}, D={self.depth}")
    if not 0 <= self.ngram <= 64:
      raise ConfigError(f"{self.spec}: the grafted prompt-lookup chain takes 1 to 64 tokens, "
                        f"got {self.ngram}")

  @property
  def n(self) -> int:
    return self.n_nodes + self.ngram

  @property
  def max_depth(self) -> int:
    return max(self.depth, self.ngram)

  @property
  def block_size(self) -> int:
    return 1 + self.n_nodes + self.ngram

  @property
  def width(self) -> int:
    """Most children of one node (the acceptance's sibling bound): the
    grafted chain adds at most one child to one node."""
    return self.k + (1 if self.ngram else 0)

  @property
  def n_fed(self) -> int:
    """Tokens the draft feeds: the root, then the top k of each level but the last."""
    return 1 + (self.depth - 1) * self.k

  @property
  def fed_slots(self) -> int:
    return self.n_fed

  @property
  def graft(self) -> int:
    """Up to this many prompt-lookup tokens grafted on (`+ngram:L`)."""
    return self.ngram

  @property
  def n_candidates(self) -> int:
    return self.k + (self.depth - 1) * self.k * self.k

  @property
  def spec(self) -> str:
    graft = f"+ngram:{self.ngram}" if self.ngram else ""
    return f"dynamic:{self.k},{self.depth},{self.n_nodes}{graft}"


def check_capacity(tree, capacity: int, length) -> None:
  """Raises CacheOverflowError (one line) when a verify block of the tree at
  cache `length` (an int or per-row lengths: the longest counts) runs past
  `capacity`: its 1 + N tokens take slots length .. length + N."""
  longest = int(np.max(np.asarray(length)))
  if longest + tree.block_size > capacity:
    raise CacheOverflowError(
        f"tree {tree.spec} ({tree.n} nodes, depth {tree.max_depth}) needs {tree.block_size} "
        f"slots at position {longest}, {longest + tree.block_size} in all, but the cache "
        f"holds {capacity}")


def _ints(spec: str, body: str, count: int) -> list[int]:
  try:
    vals = [int(x) for x in body.split(",")]
  except ValueError:
    vals = []
  if len(vals) != count:
    raise ConfigError(f"--tree={spec}: expected {count} comma-separated integers after "
                      f"{spec.split(':')[0]}:")
  return vals


def _json_tree(spec: str, text: str, where: str) -> Tree:
  try:
    paths = json.loads(text)
  except json.JSONDecodeError as e:
    raise ConfigError(f"--tree: {where} is not a JSON list of paths ({e.msg} at char {e.pos})") \
        from None
  return from_paths(paths, spec)


def _sequoia_spec(s: str, body: str, p: Sequence[float] | None) -> Tree:
  """sequoia:N,D[:p1,..], sequoia:N,D:conditional=p1,.. or :marginal=w1,..
  (docs/trees.md); refuses what reads wrongly in either form, in one line."""
  sizes, _, probs = body.partition(":")
  n, d = _ints(s, sizes, 2)
  form, eq, values = probs.partition("=")
  form, values = (form.strip(), values) if eq else ("", probs)
  if form not in ("", "conditional", "marginal") or (eq and not values.strip()):
    raise ConfigError(f"--tree={s}: after N,D: expected p1,p2,.. (conditional), "
                      "conditional=p1,p2,.. or marginal=w1,w2,.. (Sequoia's form)")
  if values:
    try:
      p = tuple(float(x) for x in values.split(","))
    except ValueError:
      raise ConfigError(f"--tree={s}: the p after N,D: must be comma-separated numbers") from None
  p = SEQUOIA_P if p is None else tuple(p)
  if not all(0.0 <= x <= 1.0 for x in p):
    raise ConfigError(f"--tree={s}: p must be probabilities in [0, 1], got {list(p)}")
  if p[0] == 0.0:
    raise ConfigError(f"--tree={s}: p starts with 0 (the draft's first choice never accepted); "
                      "Sequoia's saved vector starts with an unused 0 and ends with P(no child "
                      "accepted): drop both and write sequoia:N,D:marginal=w1,w2,..")
  if form == "marginal" and sum(p) > 1.0 + MARGINAL_SUM_ONE:
    raise ConfigError(f"--tree={s}: marginal w sums to {sum(p):.6g} > 1, but each w_k is the "
                      "chance that rank k is the accepted child; conditional p go without "
                      "'marginal='")
  if form == "marginal" and abs(sum(p) - 1.0) <= MARGINAL_SUM_ONE:
    raise ConfigError(f"--tree={s}: marginal w sums to 1, as Sequoia's saved vector does with "
                      "its last entry, P(no child accepted): drop that entry (or, if rank "
                      f"{len(p) - 1} is always accepted when reached, give the conditional p)")
  return sequoia(n, d, p, marginal=form == "marginal")


def parse(spec: str, gamma: int, p: Sequence[float] | None = None):
  """`--tree=SPEC` (module docstring) -> a Tree or DynamicTree.

  `gamma` is the chain's length for `chain`; `p` the positional acceptance
  (conditional) for `sequoia:N,D` without its own (default SEQUOIA_P).
  """
  s = str(spec).strip()
  head, _, body = s.partition(":")
  if s == "chain":
    return chain(gamma)
  if s.startswith("["):
    return _json_tree(s, s, "the spec")
  if s.endswith(".json") or os.path.isfile(s):
    try:
      with open(s) as f:
        text = f.read()
    except OSError as e:
      raise ConfigError(f"--tree={s}: cannot read the file ({e.strerror})") from None
    return _json_tree(s, text, s)
  if head == "chain" and body:
    return chain(_ints(s, body, 1)[0])
  if head == "kary":
    return kary(*_ints(s, body, 2))
  if head == "sequoia":
    return _sequoia_spec(s, body, p)
  if head == "dynamic":
    base, plus, graft = body.partition("+")
    if not plus:
      return DynamicTree(*_ints(s, base, 3))
    kind, _, length = graft.partition(":")
    if kind.strip() != "ngram" or not length.strip():
      raise ConfigError(f"--tree={s}: after '+' expected ngram:L (a prompt-lookup chain of up "
                        "to L tokens), e.g. dynamic:10,6,60+ngram:8")
    (n_chain,) = _ints(s, length, 1)
    if n_chain < 1:
      raise ConfigError(f"--tree={s}: the grafted prompt-lookup chain takes 1 to 64 tokens, "
                        f"got {n_chain}")
    return DynamicTree(*_ints(s, base, 3), n_chain)
  if head == "auto":
    raise ConfigError(f"--tree={s} is a run mode, not a tree: decode/plan.py resolves it")
  raise ConfigError(f"--tree={s}: unknown spec; use chain, chain:G, a JSON list of rank paths, "
                    "FILE.json, kary:K,D, sequoia:N,D[:p1,..|:marginal=w1,..], "
                    "dynamic:K,D,N[+ngram:L] or auto")
