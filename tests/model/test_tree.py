"""Tests for specjax.model.tree: the --tree specs, the topology's arrays
against brute force over the rank paths, and today's chain verify.

Each property is a `check_*` function; MUTATIONS holds deliberate bugs
(monkeypatched in) and `test_each_deliberate_bug_fails_its_check` shows the
check it names fails under it.
"""

import itertools
import json
import random

import numpy as np
import pytest

from specjax.decode import plan
from specjax.errors import CacheOverflowError, ConfigError
from specjax.metrics import tree_theory
from specjax.model import tree as treemod

MEDUSA_LIKE = [[0], [1], [0, 0], [0, 1], [1, 0], [0, 0, 0]]


def random_paths(rng: random.Random, n: int, width: int = 3) -> list[tuple[int, ...]]:
  """A random valid tree of n nodes: each new node is the next rank below a
  random existing node (or the root)."""
  kids = {(): 0}
  out = []
  while len(out) < n:
    parent = rng.choice(list(kids))
    if kids[parent] >= width:
      continue
    node = parent + (kids[parent],)
    kids[parent] += 1
    kids[node] = 0
    out.append(node)
  return out


TREES = [treemod.chain(1), treemod.chain(5), treemod.kary(2, 3), treemod.kary(3, 2),
         treemod.from_paths(MEDUSA_LIKE)] + [
             treemod.from_paths(random_paths(random.Random(s), n)) for s, n in
             [(0, 7), (1, 12), (2, 20), (3, 33)]]


# --- checks (each one a property; MUTATIONS break them) -------------------------


def check_mask_is_ancestry(t: treemod.Tree) -> None:
  """M[a, b] iff block b's path is a prefix of block a's (root: the empty path)."""
  paths = [()] + list(t.paths())
  want = np.array([[a[:len(b)] == b for b in paths] for a in paths])
  np.testing.assert_array_equal(t.mask(), want)
  assert t.mask().dtype == np.bool_ and t.mask().shape == (t.n + 1, t.n + 1)


def check_depths_and_parents(t: treemod.Tree) -> None:
  paths = [()] + list(t.paths())
  np.testing.assert_array_equal(t.block_depths(), [len(q) for q in paths])
  index = {q: j for j, q in enumerate(paths)}
  np.testing.assert_array_equal(t.block_parents(), [-1] + [index[q[:-1]] for q in paths[1:]])
  for i in range(t.n):
    assert t.ancestors(i) == tuple(index[paths[i + 1][:k]] - 1 for k in range(1, t.depths[i]))


def check_child_table(t: treemod.Tree) -> None:
  paths = [()] + list(t.paths())
  index = {q: j for j, q in enumerate(paths)}
  for j, q in enumerate(paths):
    kids = [index[q + (r,)] for r in range(t.width) if q + (r,) in index]
    assert list(t.child_table()[j]) == kids + [-1] * (t.width - len(kids))


def check_bfs_order_independent_of_input(paths) -> None:
  ref = treemod.from_paths(paths)
  for seed in range(5):
    shuffled = list(paths)
    random.Random(seed).shuffle(shuffled)
    t = treemod.from_paths(shuffled)
    assert t == ref
    assert list(t.depths) == sorted(t.depths)                 # depth non-decreasing
    assert all(a < i for i, a in enumerate(t.parents))        # parents first
    keys = [(t.depths[i], t.parents[i], t.ranks[i]) for i in range(t.n)]
    assert keys == sorted(keys)                               # by parent, then rank


def check_capacity_bound(t) -> None:
  treemod.check_capacity(t, capacity=40 + t.n + 1, length=40)          # exactly fits
  treemod.check_capacity(t, capacity=40 + t.n + 1, length=[3, 40, 12])
  with pytest.raises(CacheOverflowError) as e:
    treemod.check_capacity(t, capacity=40 + t.n, length=40)
  assert "\n" not in str(e.value)


def check_chain_is_todays_verify(gamma: int) -> None:
  """Today's verify: tokens [tail, d_1..d_gamma] at positions length + j, and
  (layers.attend_*) a query at position P sees the slots <= P."""
  t = treemod.chain(gamma)
  length = 11
  positions = length + np.arange(gamma + 1)
  np.testing.assert_array_equal(length + t.block_depths(), positions)
  np.testing.assert_array_equal(t.mask(), positions[None, :] <= positions[:, None])


# --- tests ------------------------------------------------------------------------


@pytest.mark.parametrize("t", TREES, ids=lambda t: f"n{t.n}d{t.max_depth}w{t.width}")
def test_arrays_match_brute_force_over_paths(t):
  check_mask_is_ancestry(t)
  check_depths_and_parents(t)
  check_child_table(t)
  check_capacity_bound(t)


@pytest.mark.parametrize("gamma", [1, 2, 4, 8])
def test_chain_is_todays_verify(gamma):
  check_chain_is_todays_verify(gamma)
  t = treemod.chain(gamma)
  assert t.is_chain and t.n == gamma and t.max_depth == gamma and t.draft_widths() == (1,) * gamma


@pytest.mark.parametrize("paths", [MEDUSA_LIKE, random_paths(random.Random(5), 25)])
def test_from_paths_bfs_order_independent_of_input_order(paths):
  check_bfs_order_independent_of_input(paths)


@pytest.mark.parametrize("k, d", [(1, 4), (2, 3), (3, 3), (4, 2)])
def test_kary_counts(k, d):
  t = treemod.kary(k, d)
  assert t.n == sum(k**j for j in range(1, d + 1))
  assert t.level_widths() == tuple(k**j for j in range(1, d + 1))
  assert t.draft_widths() == tuple(k**j for j in range(d))
  assert t.width == k and t.max_depth == d
  assert sum(1 for row in t.child_table() if row[0] < 0) == k**d  # the leaves
  assert t == treemod.from_paths(list(itertools.product(range(k), repeat=1)) + [
      q for j in range(2, d + 1) for q in itertools.product(range(k), repeat=j)])


def test_tree_is_hashable_and_name_free_equality():
  a = treemod.parse("kary:2,2", gamma=4)
  b = treemod.from_paths([[1, 1], [0], [1], [0, 1], [1, 0], [0, 0]])
  assert a == b and hash(a) == hash(b) and a.spec == "kary:2,2" and b.spec == b.to_json()
  assert treemod.parse(b.spec, gamma=4) == b
  assert treemod.Tree([-1, 0], [1, 2], [0, 0]) == treemod.chain(2)


def test_parse_each_form(tmp_path):
  assert treemod.parse("chain", gamma=4) == treemod.chain(4)
  assert treemod.parse(" chain:3 ", gamma=4) == treemod.chain(3)
  lit = treemod.parse(json.dumps(MEDUSA_LIKE), gamma=4)
  assert lit.paths() == ((0,), (1,), (0, 0), (0, 1), (1, 0), (0, 0, 0))
  f = tmp_path / "tree.json"
  f.write_text(json.dumps(list(reversed(MEDUSA_LIKE))))
  assert treemod.parse(str(f), gamma=4) == lit
  assert treemod.parse("kary:2,3", gamma=4) == treemod.kary(2, 3)
  seq = treemod.parse("sequoia:8,3", gamma=4)
  assert seq.n == 8 and seq.max_depth <= 3
  assert seq.paths() == tree_theory.best_tree(treemod.SEQUOIA_P, 8, 3)[0]
  assert treemod.parse(seq.spec, gamma=1) == seq                       # its own name parses
  own_p = treemod.parse("sequoia:8,4:0.9,0.05", gamma=4)
  assert own_p.paths() == tree_theory.best_tree((0.9, 0.05), 8, 4)[0]
  assert treemod.parse("sequoia:8,4", gamma=4, p=(0.9, 0.05)) == own_p
  dyn = treemod.parse("dynamic:4,6,60", gamma=4)
  assert (dyn.k, dyn.depth, dyn.n_nodes, dyn.n, dyn.max_depth, dyn.block_size) == (4, 6, 60, 60, 6, 61)
  assert dyn.n_candidates == 4 + 5 * 16 and dyn.spec == "dynamic:4,6,60"
  # `auto` is a run mode (decode/plan.py), not a tree: its sizes parse there
  assert plan.parse_auto_sizes("auto") == (4, 8, 16, 32, 64) and plan.AUTO_DEPTH == 8
  assert plan.parse_auto_sizes("auto:16,4,16") == (4, 16)
  assert plan.parse_auto_sizes("kary:2,2") is None


# Sequoia's own acceptance vector (Infini-AI-Lab/Sequoia, acceptance-rate-vector.pt at 0ff3ff7:
# 34 float32 entries, an unused 0, w_0..w_31, then P(no child accepted) = 0.07346326857805252).
SEQUOIA_W = (
    0.6341829299926758, 0.10794602334499359, 0.056971512734889984, 0.022488756105303764,
    0.019490255042910576, 0.014992503449320793, 0.004497751127928495, 0.002998500829562545,
    0.01199400331825018, 0.004497751127928495, 0.007496251724660397, 0.004497751127928495,
    0.00599700165912509, 0.002998500829562545, 0.0014992504147812724, 0.002998500829562545,
    0.0014992504147812724, 0.002998500829562545, 0.0, 0.002998500829562545,
    0.002998500829562545, 0.002998500829562545, 0.0, 0.0014992504147812724, 0.0,
    0.0014992504147812724, 0.0, 0.0, 0.0, 0.0014992504147812724, 0.0014992504147812724,
    0.0014992504147812724)
W_TEXT = ",".join(repr(x) for x in SEQUOIA_W)
# Sequoia's tree_search.py run on that vector (float32): T[m][l] of m nodes with the root
# and l levels with the root, i.e. sequoia:m-1,l-1. (128, 10) is its demo-config.json.
SEQUOIA_OWN_DP = {(127, 9): 4.192107200622559, (120, 10): 4.171658039093018}


def check_sequoia_marginal(n, d):
  """Sequoia's vector through marginal= gives Sequoia's own figure; the same
  numbers read as conditional p give fewer tokens per step."""
  tree = treemod.parse(f"sequoia:{n},{d}:marginal={W_TEXT}", gamma=1)
  p = tree_theory.conditional_from_marginal(SEQUOIA_W)
  assert tree_theory.tokens_per_step(tree.paths(), p) == pytest.approx(
      SEQUOIA_OWN_DP[n, d], rel=1e-6)
  assert treemod.parse(tree.spec, gamma=1) == tree                     # its own name parses
  as_p = treemod.parse(f"sequoia:{n},{d}:{W_TEXT}", gamma=1)
  assert tree_theory.tokens_per_step(as_p.paths(), SEQUOIA_W) < SEQUOIA_OWN_DP[n, d] - 0.9


@pytest.mark.parametrize("n, d", sorted(SEQUOIA_OWN_DP))
def test_sequoia_vector_through_the_marginal_form(n, d):
  check_sequoia_marginal(n, d)


def check_sequoia_drops_dead_nodes(monkeypatch):
  """sequoia:16,2 at the default p: 3 + 9 nodes can be accepted, so 12 kept
  and one warning says so; sequoia:16,3 keeps its 16 and only informs."""
  said = []
  monkeypatch.setattr(treemod.logging, "warning", lambda fmt, *a: said.append(fmt % a))
  assert treemod.parse("sequoia:16,2", gamma=1).n == 12
  assert len(said) == 1 and "4 of the DP's 16 nodes dropped" in said[0], said
  assert treemod.parse("sequoia:16,3", gamma=1).n == 16 and len(said) == 1


def test_sequoia_drops_the_nodes_p_never_accepts(monkeypatch):
  check_sequoia_drops_dead_nodes(monkeypatch)


def test_sequoia_keeping_dead_nodes_is_caught(monkeypatch):
  """The deliberate bug: the DP's 16 nodes kept whole."""
  monkeypatch.setattr(tree_theory, "live_paths",
                      lambda paths, p: tree_theory.canonical_paths(paths))
  with pytest.raises(AssertionError):
    check_sequoia_drops_dead_nodes(monkeypatch)


BAD_SPECS = {
    "[[0],[0,0,0]]": "no parent [0, 0]",
    "[[0],[0]]": "duplicate path [0]",
    "[[0],[2]]": "no earlier sibling [1]",
    "[[0],[-1]]": "malformed path",
    "[[0],[]]": "malformed path",
    "[0,1]": "malformed path",
    "[[0],[true]]": "malformed path",
    "[[0],[0.5]]": "malformed path",
    "[]": "at least one node",
    "[[0],": "not a JSON list",
    "{\"a\": 1}": "unknown spec",
    "kary:2": "2 comma-separated integers",
    "kary:a,b": "2 comma-separated integers",
    "kary:0,3": "K >= 1",
    "kary:4,6": "over 1024 nodes",
    "chain:0": "gamma >= 1",
    "sequoia:8,0": "depth >= 1",
    "sequoia:8,3:0.5,x": "comma-separated numbers",
    "sequoia:8,3:1.5": "in [0, 1]",
    "sequoia:8,3:0,0.6,0.1,0.3": "drop both and write sequoia:N,D:marginal=",
    "sequoia:8,3:marginal=0,0.6,0.1,0.3": "starts with 0",
    "sequoia:8,3:marginal=0.6,0.1,0.3": "sums to 1, as Sequoia's saved vector",
    "sequoia:8,3:marginal=0.7,0.5": "sums to 1.2 > 1",
    "sequoia:8,3:cond=0.6": "expected p1,p2,.. (conditional)",
    "sequoia:8,3:marginal=": "expected p1,p2,.. (conditional)",
    "dynamic:2,2,100": "more nodes than the 6 candidates",
    "dynamic:2,2": "3 comma-separated integers",
    "auto": "a run mode, not a tree",
    "auto:16,4": "a run mode, not a tree",
    "bushy": "unknown spec",
    "/no/such/tree.json": "cannot read",
}


@pytest.mark.parametrize("spec", list(BAD_SPECS))
def test_bad_spec_is_one_line(spec):
  with pytest.raises(ConfigError) as e:
    treemod.parse(spec, gamma=4)
  assert BAD_SPECS[spec] in str(e.value) and "\n" not in str(e.value)


def test_bad_auto_sizes_are_one_line():
  with pytest.raises(ConfigError, match=">= 1") as e:
    plan.parse_auto_sizes("auto:0,4")
  assert "\n" not in str(e.value)


def test_bad_json_file_is_one_line(tmp_path):
  f = tmp_path / "bad.json"
  f.write_text("[[0], [0, 0,\n")
  with pytest.raises(ConfigError, match="is not a JSON list") as e:
    treemod.parse(str(f), gamma=4)
  assert "\n" not in str(e.value)


def test_arrays_out_of_bfs_order_are_rejected():
  with pytest.raises(ConfigError, match="BFS order"):
    treemod.Tree([-1, 0, -1], [1, 2, 1], [0, 0, 1])
  with pytest.raises(ConfigError, match="do not follow"):
    treemod.Tree([-1, 0], [1, 1], [0, 0])
  with pytest.raises(ConfigError, match="parents must come first"):
    treemod.Tree([1, -1], [2, 1], [0, 0])


# --- deliberate bugs ----------------------------------------------------------------


def _siblings_see_each_other(orig):
  def mask(self):  # a node sees every shallower node (a causal mask by depth)
    d = self.block_depths()
    return (d[None, :] < d[:, None]) | np.eye(self.block_size, dtype=np.bool_)
  return mask


def _rope_at_the_slot(orig):
  return lambda self: np.arange(self.block_size, dtype=np.int32)


def _lexicographic_not_bfs(orig):
  return lambda paths: tuple(sorted(orig(paths)))


def _capacity_without_the_root(orig):
  def check(t, capacity, length):
    orig(dataclass_like(t.n - 1, t), capacity, length)
  return check


class dataclass_like:  # a tree one node smaller, for the capacity bug
  def __init__(self, n, t):
    self.n, self.block_size, self.max_depth, self.spec = n, n + 1, t.max_depth, t.spec


WIDE = treemod.from_paths(MEDUSA_LIKE)
MUTATIONS = {
    "siblings that can see each other": (
        treemod.Tree, "mask", _siblings_see_each_other, lambda: check_mask_is_ancestry(WIDE)),
    "RoPE at the slot instead of length + depth": (
        treemod.Tree, "block_depths", _rope_at_the_slot, lambda: check_depths_and_parents(WIDE)),
    "paths sorted lexicographically, not in BFS order": (
        tree_theory, "canonical_paths", _lexicographic_not_bfs,
        lambda: check_bfs_order_independent_of_input(MEDUSA_LIKE)),
    "capacity that forgets the root's slot": (
        treemod, "check_capacity", _capacity_without_the_root, lambda: check_capacity_bound(WIDE)),
    "Sequoia's marginal vector read as conditional p": (
        tree_theory, "conditional_from_marginal", lambda orig: lambda w: np.asarray(w, float),
        lambda: check_sequoia_marginal(120, 10)),
}


@pytest.mark.parametrize("bug", list(MUTATIONS))
def test_each_deliberate_bug_fails_its_check(monkeypatch, bug):
  owner, name, make, check = MUTATIONS[bug]
  check()  # passes as shipped
  monkeypatch.setattr(owner, name, make(getattr(owner, name)))
  with pytest.raises((AssertionError, pytest.fail.Exception)):
    check()


def test_chain_alone_misses_the_tree_bugs(monkeypatch):
  """Why the mask and RoPE checks run on a tree: on a chain both bugs are invisible."""
  for bug in ("siblings that can see each other", "RoPE at the slot instead of length + depth"):
    owner, name, make, _ = MUTATIONS[bug]
    monkeypatch.setattr(owner, name, make(getattr(owner, name)))
  check_chain_is_todays_verify(4)
