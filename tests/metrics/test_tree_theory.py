"""Tests for specjax.metrics.tree_theory against references built here
independently: every acceptance outcome enumerated (positional acceptance as
one coin per node), Monte Carlo of the same coins, every tree of up to 6
nodes enumerated, and Leviathan's Equation (1) for chains.

Each property is a `check_*` function; MUTATIONS holds deliberate bugs
(monkeypatched in) and `test_each_deliberate_bug_fails_its_check` shows the
check it names fails under it.
"""

import collections
import itertools

import numpy as np
import pytest

from specjax.errors import ConfigError, SpecjaxError
from specjax.metrics import theory
from specjax.metrics import tree_theory as tt

P_VECTORS = [(0.6, 0.2, 0.1), (0.8,), (0.3, 0.9, 0.5), (0.5, 0.5, 0.5, 0.5), (1.0, 0.4), (0.0, 0.7)]


def chain(g):
  return [(0,) * k for k in range(1, g + 1)]


def kary(k, d):
  return [q for j in range(1, d + 1) for q in itertools.product(range(k), repeat=j)]


SMALL = [chain(3), kary(2, 2), [(0,), (1,), (2,), (0, 0), (0, 1), (1, 0), (0, 0, 0)],
         [(0,), (0, 0), (0, 1), (0, 2), (0, 0, 0), (0, 0, 1), (0, 1, 0), (0, 0, 0, 0)],
         kary(3, 2)]


# --- independent references ------------------------------------------------------


def children(paths):
  """{node path: its children's paths in rank order}, the root = ()."""
  kids = {(): []}
  for q in sorted(paths, key=lambda q: (len(q), q)):
    kids.setdefault(q, [])
    kids[q[:-1]].append(q)
  return kids


def walk(kids, coin):
  """Accepted depth when node x's coin is coin[x]: from the root, the first
  child (rank order) whose coin is up is accepted; none up ends the step."""
  node, depth = (), 0
  while True:
    up = [c for c in kids[node] if coin[c]]
    if not up:
      return depth
    node, depth = up[0], depth + 1


def enumerated_pmf(paths, p):
  """The law of the accepted depth, every coin outcome summed (2^N terms)."""
  p = list(p)
  prob = lambda q: p[q[-1]] if q[-1] < len(p) else 0.0
  paths = [tuple(q) for q in paths]
  kids = children(paths)
  pmf = np.zeros(max(len(q) for q in paths) + 1)
  for ups in itertools.product([False, True], repeat=len(paths)):
    weight = np.prod([prob(q) if u else 1.0 - prob(q) for q, u in zip(paths, ups)])
    pmf[walk(kids, dict(zip(paths, ups)))] += weight
  return pmf


def monte_carlo_depths(paths, p, draws, seed):
  """Accepted depths of `draws` simulated steps, vectorized over draws."""
  paths = sorted({tuple(q) for q in paths}, key=lambda q: (len(q), q))
  index = {q: i for i, q in enumerate(paths)}
  kids = children(paths)
  width = max(len(v) for v in kids.values())
  table = np.full((len(paths) + 1, width), -1)  # node row (root = last) -> child nodes
  for q, cs in kids.items():
    table[index.get(q, len(paths)), :len(cs)] = [index[c] for c in cs]
  probs = np.array([p[q[-1]] if q[-1] < len(p) else 0.0 for q in paths])
  rng = np.random.default_rng(seed)
  up = rng.random((draws, len(paths))) < probs            # [draws, N]
  cur = np.full(draws, len(paths))
  depth = np.zeros(draws, int)
  alive = np.ones(draws, bool)
  for _ in range(max(len(q) for q in paths)):
    cand = table[cur]                                     # [draws, W]
    hit = (cand >= 0) & np.take_along_axis(up, np.maximum(cand, 0), 1)
    any_hit = alive & hit.any(1)
    cur = np.where(any_hit, cand[np.arange(draws), hit.argmax(1)], cur)
    depth += any_hit
    alive = any_hit
  return depth


def all_trees(n, d):
  """Every tree of exactly n nodes, depth <= d, as rank paths (plane trees)."""
  def forests(m, d, prefix):
    if m == 0:
      yield []
      return
    if d == 0:
      return
    # the first (rank r) child's subtree takes s nodes, the later ranks the rest
    def ranked(m, r):
      if m == 0:
        yield []
        return
      for s in range(1, m + 1):
        for sub in forests(s - 1, d - 1, prefix + (r,)):
          for rest in ranked(m - s, r + 1):
            yield [prefix + (r,)] + sub + rest
    yield from ranked(m, 0)
  return [tuple(f) for f in forests(n, d, ())]


# --- checks --------------------------------------------------------------------------


def check_tokens_match_enumeration(paths, p):
  pmf = enumerated_pmf(paths, p)
  np.testing.assert_allclose(tt.accept_pmf(paths, p), pmf, rtol=0, atol=1e-12)
  assert tt.tokens_per_step(paths, p) == pytest.approx(1 + pmf @ np.arange(pmf.size), abs=1e-12)


def check_tokens_match_monte_carlo(paths, p, draws=100_000, seed=0):
  depth = monte_carlo_depths(paths, p, draws, seed)
  mean, se = 1 + depth.mean(), depth.std() / np.sqrt(draws)
  assert abs(tt.tokens_per_step(paths, p) - mean) < 5 * se + 1e-9, (tt.tokens_per_step(paths, p), mean)
  law = tt.accept_pmf(paths, p)
  freq = np.bincount(depth, minlength=law.size) / draws
  assert np.all(np.abs(freq - law) < 5 * np.sqrt(law * (1 - law) / draws) + 1e-9), (freq, law)


def check_chain_is_leviathan(p):
  for g in range(1, 10):
    assert tt.tokens_per_step(chain(g), p) == pytest.approx(
        theory.expected_tokens_per_step(p[0], g), rel=1e-13)
    np.testing.assert_allclose(tt.accept_pmf(chain(g), p), theory.geometric_accept_pmf(p[0], g),
                               atol=1e-14)


def check_dp_is_best_over_all_trees(p, max_n=6, max_d=3):
  for n in range(1, max_n + 1):
    for d in range(1, max_d + 1):
      best = max(tt.tokens_per_step(t, p) for t in all_trees(n, d))
      paths, value = tt.best_tree(p, n, d)
      assert value == pytest.approx(best, abs=1e-12), (n, d)
      assert tt.best_values(p, max_n, d)[n] == pytest.approx(best, abs=1e-12)


def check_dp_tree_has_its_value(p, n, d):
  paths, value = tt.best_tree(p, n, d)
  assert len(paths) == n and max(len(q) for q in paths) <= d
  assert tt.canonical_paths(paths) == paths
  assert tt.tokens_per_step(paths, p) == pytest.approx(value, abs=1e-12)


def check_dominance(p, seed=0):
  """A tree containing the chain's path accepts at least as many tokens."""
  rng = np.random.default_rng(seed)
  for g in (1, 2, 4):
    base = tt.tokens_per_step(chain(g), p)
    for _ in range(20):
      extra = set(chain(g))
      for _ in range(int(rng.integers(1, 12))):  # grow: a next-rank child of a random node
        node = list(extra | {()})[int(rng.integers(len(extra) + 1))]
        r = 0
        while node + (r,) in extra:
          r += 1
        extra.add(node + (r,))
      assert tt.tokens_per_step(sorted(extra), p) >= base - 1e-12, (g, sorted(extra))


def check_tree_speedup_by_hand():
  """kary(2,2) drafts level 1 from the root (width 1), level 2 from its two
  children (width 2); verify 7 tokens."""
  t_draft = {1: 0.010, 2: 0.013, 4: 0.020}
  tokens = tt.tokens_per_step(kary(2, 2), (0.6, 0.2))
  got = tt.tree_speedup(tokens, tt.draft_widths(kary(2, 2)), t_draft, 0.1, 0.14, 0.002)
  assert got == pytest.approx(tokens * 0.1 / (0.010 + 0.013 + 0.14 + 0.002), rel=1e-13)


def check_chooser_follows_the_verify_cost():
  cands = tt.candidates((0.6, 0.2, 0.1), sizes=(8, 32), max_depth=6, chains=(1, 4))
  flat = {1: 0.1, 65: 0.1}               # small batch: the verify is flat in N
  steep = {1: 0.1, 65: 6.5}              # large batch: the verify is linear in N
  assert tt.choose(cands, (0.6, 0.2, 0.1), flat, 0.001) == "sequoia:32,6"
  assert tt.choose(cands, (0.6, 0.2, 0.1), steep, 0.001) == "chain:1"


def check_rank_counts_estimate_p(p=(0.6, 0.3, 0.5), steps=20_000):
  paths = kary(3, 3)
  index = sorted(paths, key=lambda q: (len(q), q))
  rng = np.random.default_rng(1)
  up = rng.random((steps, len(index))) < np.array([p[q[-1]] for q in index])
  kids = children(paths)
  seen = collections.Counter()
  for row in up:
    coin = dict(zip(index, row))
    node, accepted = (), []
    while True:
      hit = [c for c in kids[node] if coin[c]]
      if not hit:
        break
      node = hit[0]
      accepted.append(node[-1])
    seen[tuple(accepted)] += 1
  acc, tried = np.zeros(3), np.zeros(3)
  for accepted, times in seen.items():  # one call per distinct outcome
    a, t = tt.rank_counts(paths, accepted)
    acc, tried = acc + times * a, tried + times * t
  est = tt.estimate_p(acc, tried)
  assert np.all(np.abs(est - p) < 0.02), est


def marginal_value(paths, w):
  """Expected tokens per step from Sequoia's marginal w (w_k: the rank-k
  child is the accepted one), summed directly over the paths."""
  w = list(w) + [0.0] * 64
  return 1.0 + sum(float(np.prod([w[r] for r in q])) for q in paths)


def check_marginal_form(w):
  """conditional_from_marginal inverts rank_weights, and the DP at the
  converted p finds the best tree by Sequoia's own (marginal) value, every
  tree of up to 5 nodes and depth <= 3 enumerated."""
  p = tt.conditional_from_marginal(w)
  np.testing.assert_allclose(tt.rank_weights(p, len(w)), w, rtol=0, atol=1e-15)
  for n in range(1, 6):
    for d in range(1, 4):
      best = max(marginal_value(t, w) for t in all_trees(n, d))
      assert tt.best_tree(p, n, d)[1] == pytest.approx(best, abs=1e-12), (w, n, d)


def check_live_paths(p, n, d, want):
  """live_paths keeps `want` of the DP's n nodes, a valid tree of the same
  value, every node but a rank's placeholder of positive probability."""
  full, value = tt.best_tree(p, n, d)
  live = tt.live_paths(full, p)
  assert len(live) == want, (p, n, d, len(live))
  try:
    valid = tt.canonical_paths(live) == live
  except ConfigError:
    valid = False
  assert valid, live
  assert tt.tokens_per_step(live, p) == pytest.approx(value, abs=1e-12)
  probs = dict(zip(live, tt.path_probs(live, p)))
  assert all(w > 0 or q[:-1] + (q[-1] + 1,) in probs for q, w in probs.items()), probs


# --- tests ---------------------------------------------------------------------------


@pytest.mark.parametrize("p", P_VECTORS)
@pytest.mark.parametrize("i", range(len(SMALL)))
def test_tokens_per_step_equals_enumeration(i, p):
  check_tokens_match_enumeration(SMALL[i], p)


@pytest.mark.parametrize("paths, p", [
    (kary(3, 4), (0.6, 0.2, 0.1)),
    (tt.best_tree((0.7, 0.3, 0.2), 64, 8)[0], (0.7, 0.3, 0.2)),
    (tt.best_tree((0.3, 0.9, 0.5), 40, 5)[0], (0.3, 0.9, 0.5)),
], ids=["kary3x4", "sequoia64", "sequoia40"])
def test_tokens_per_step_equals_monte_carlo(paths, p):
  check_tokens_match_monte_carlo(paths, p)


@pytest.mark.parametrize("p", [(0.0,), (0.35, 0.9), (0.8, 0.1), (1.0,)])
def test_chain_is_leviathan_eq1(p):
  check_chain_is_leviathan(p)


def test_all_trees_enumerates_the_catalan_numbers():
  # plane trees of n + 1 vertices: Catalan(n); depth <= 1: one (a star)
  assert [len(all_trees(n, n)) for n in range(1, 7)] == [1, 2, 5, 14, 42, 132]
  assert all(len(all_trees(n, 1)) == 1 for n in range(1, 7))


@pytest.mark.parametrize("p", P_VECTORS)
def test_dp_equals_brute_force_best(p):
  check_dp_is_best_over_all_trees(p)


@pytest.mark.parametrize("p", P_VECTORS)
@pytest.mark.parametrize("n, d", [(7, 3), (16, 4), (33, 5), (64, 8)])
def test_dp_tree_has_the_value_it_claims(p, n, d):
  check_dp_tree_has_its_value(p, n, d)


@pytest.mark.parametrize("p", P_VECTORS)
def test_dominance_over_the_chain(p):
  check_dominance(p)


def test_dp_beats_the_chain_and_grows_with_n():
  p = (0.6, 0.2, 0.1)
  values = tt.best_values(p, 64, 64)
  assert np.all(np.diff(values) >= -1e-12)
  for n in (4, 8, 16, 32, 64):
    assert values[n] >= tt.tokens_per_step(chain(n), p) - 1e-12


def test_speedup_of_a_chain_is_the_measured_cost_speedup():
  for g in (1, 3, 8):
    tokens = tt.tokens_per_step(chain(g), (0.7,))
    got = tt.tree_speedup(tokens, tt.draft_widths(chain(g)), lambda w: 0.01 * w, 0.1, 0.13, 0.004)
    want = theory.measured_cost_speedup(tokens, g, 0.01, 0.1, 0.13, 0.004)
    assert got == pytest.approx(want, rel=1e-13)
  check_tree_speedup_by_hand()


def test_draft_cost_forms_agree():
  widths = tt.draft_widths(kary(2, 3))
  assert widths == (1, 2, 4)
  costs = [tt.tree_speedup(2.0, widths, c, 0.1, 0.2) for c in
           (lambda w: 0.01 * w, {1: 0.01, 2: 0.02, 4: 0.04}, [0, 0.01, 0.02, 0.03, 0.04])]
  assert costs == pytest.approx([costs[0]] * 3)
  assert tt.tree_speedup(2.0, widths, 0.01, 0.1, 0.2) == pytest.approx(2.0 * 0.1 / 0.23)
  with pytest.raises(SpecjaxError, match="width"):
    tt.tree_speedup(2.0, widths, {1: 0.01}, 0.1, 0.2)


def test_chooser():
  check_chooser_follows_the_verify_cost()
  p, curve = (0.6, 0.2, 0.1), {1: 0.1, 65: 0.12}
  cands = tt.candidates(p, sizes=(8,), max_depth=4, chains=(2,))
  steady = tt.predicted_speedups(cands, p, curve, 0.002)
  tail1 = tt.predicted_speedups(cands, p, curve, 0.002, n_tokens=300, rows=1)
  tail32 = tt.predicted_speedups(cands, p, curve, 0.002, n_tokens=300, rows=32)
  for k in cands:
    assert tail1[k] == pytest.approx(steady[k], rel=0.02) and tail32[k] < tail1[k]


def test_rank_counts_by_hand():
  paths = [(0,), (1,), (2,), (0, 0), (0, 1), (1, 0)]
  cases = {(): ([0, 0, 0], [1, 1, 1]), (0,): ([1, 0, 0], [2, 1, 0]),
           (1, 0): ([1, 1, 0], [2, 1, 0]), (2,): ([0, 0, 1], [1, 1, 1]),
           (0, 1): ([1, 1, 0], [2, 1, 0])}
  for accepted, (acc, tried) in cases.items():
    a, t = tt.rank_counts(paths, accepted)
    assert (list(a), list(t)) == (acc, tried), accepted
  with pytest.raises(SpecjaxError, match="not in the tree"):
    tt.rank_counts(paths, (2, 0))


def test_estimate_p():
  np.testing.assert_allclose(tt.estimate_p([0, 0, 0, 0, 0], [0] * 5), [0.7, 0.3, 0.2, 0.1, 0.1])
  assert tt.estimate_p([3], [4], prior=(0.5,), prior_weight=2) == pytest.approx((3 + 1) / 6)
  check_rank_counts_estimate_p()
  with pytest.raises(SpecjaxError):
    tt.estimate_p([2], [1])


@pytest.mark.parametrize("bad, msg", [
    ([], "at least one node"), ([(0,), (0,)], "duplicate"), ([(0, 0)], "no parent"),
    ([(1,)], "no earlier sibling"), ([(0,), ()], "malformed"), ("[[0]]", "list of paths")])
def test_bad_paths_are_one_line(bad, msg):
  with pytest.raises(ConfigError, match=msg) as e:
    tt.tokens_per_step(bad, (0.5,))
  assert "\n" not in str(e.value)


def test_bad_inputs():
  with pytest.raises(SpecjaxError):
    tt.tokens_per_step(chain(2), (1.2,))
  with pytest.raises(ConfigError):
    tt.best_tree((0.5,), 4, 0)


SEQUOIA_HEAD = (0.6341829299926758, 0.10794602334499359, 0.056971512734889984,
                0.022488756105303764, 0.019490255042910576)  # Sequoia's saved vector's first ranks


@pytest.mark.parametrize("w", [SEQUOIA_HEAD, (0.5, 0.3, 0.2), (0.4, 0.0, 0.3), (0.0, 0.7)])
def test_marginal_form_converts_exactly(w):
  check_marginal_form(w)


def test_marginal_form_refuses_what_is_not_a_law():
  assert tt.conditional_from_marginal((0.5, 0.5, 0.0)).tolist() == [0.5, 1.0, 0.0]
  bads = (((0.7, 0.5), "sums to at most 1"), ((0.5, -0.1), r"\[0, 1\]"), ((), r"\[0, 1\]"))
  for bad, msg in bads:
    with pytest.raises(ConfigError, match=msg):
      tt.conditional_from_marginal(bad)


@pytest.mark.parametrize("p, n, d, want", [
    ((0.6, 0.2, 0.1), 16, 2, 12), ((0.6, 0.2, 0.1), 16, 3, 16), ((0.6, 0.2, 0.1), 40, 3, 39),
    ((0.6, 0.2, 0.1), 64, 3, 39), ((0.6, 0.2, 0.1), 4, 1, 3), ((0.8,), 7, 3, 3),
    ((1.0, 0.4), 6, 2, 2), ((0.6, 0.0, 0.3), 8, 2, 7)])
def test_live_paths_drop_what_p_never_accepts(p, n, d, want):
  check_live_paths(p, n, d, want)


def test_candidates_are_live():
  cands = tt.candidates((0.6, 0.2, 0.1), sizes=(16,), max_depth=2, chains=())
  assert len(cands["sequoia:16,2"]) == 12


# --- deliberate bugs -------------------------------------------------------------------


def _weights_without_the_misses(orig):
  def w(p, width):  # p_k alone: as if every earlier sibling had been rejected
    q = np.zeros(width)
    q[:min(len(p), width)] = np.asarray(p, float)[:width]
    return q
  return w


def _law_shifted_by_one(orig):
  return lambda paths, p: np.roll(orig(paths, p), 1)


def _dp_ignores_depth(orig):
  return lambda p, n, max_depth: orig(p, n, n)


def _dp_ranks_reversed(orig):
  def best(p, n, max_depth):  # the root's subtrees handed to the ranks in reverse
    paths, value = orig(p, n, max_depth)
    top = 1 + max(q[0] for q in paths)
    return tt.canonical_paths([(top - 1 - q[0],) + q[1:] for q in paths]), value
  return best


def _some_child_always_accepted(orig):
  def probs(paths, p):  # each level's weights renormalized over the siblings present
    paths = tt.canonical_paths(paths)
    w = tt.rank_weights(p, 1 + max(max(q) for q in paths))
    kids = children(paths)
    out = []
    for q in paths:
      prob = 1.0
      for k in range(1, len(q) + 1):
        sib = [c[-1] for c in kids[q[:k - 1]]]
        prob *= w[q[k - 1]] / max(w[sib].sum(), 1e-300)
      out.append(prob)
    return np.array(out)
  return probs


def _draft_widths_of_the_level_itself(orig):
  def widths(paths):  # level d priced at the depth-d nodes, not their parents
    depths = [len(q) for q in tt.canonical_paths(paths)]
    return tuple(int(c) for c in np.bincount(depths)[1:])
  return widths


def _speedups_with_a_flat_verify(orig):
  def pred(trees, p, curve, t_draft_level, t_accept=0.0, n_tokens=None, rows=1):
    t1 = theory.verify_time_from_curve(curve, 1)
    return orig(trees, p, {1: t1, 10**6: t1}, t_draft_level, t_accept, n_tokens, rows)
  return pred


def _tried_counts_every_child(orig):
  def counts(paths, accepted):  # all siblings counted as tried at every level
    acc, tried = orig(paths, accepted)
    kids = children(tt.canonical_paths(paths))
    node, tried = (), np.zeros_like(tried)
    for r in list(accepted) + [None]:
      tried[:len(kids[node])] += 1
      if r is None:
        break
      node = node + (r,)
    return acc, tried
  return counts



def _live_without_placeholders(orig):
  def live(paths, p):  # only the nodes of positive probability
    paths = tt.canonical_paths(paths)
    return tuple(q for q, w in zip(paths, tt.path_probs(paths, p)) if w > 0)
  return live

P = (0.3, 0.9, 0.5)
MUTATIONS = {
    "tokens per step with p_k, not p_k prod (1 - p_j)": (
        "rank_weights", _weights_without_the_misses, lambda: check_tokens_match_enumeration(SMALL[2], P)),
    "the law of the accepted length shifted by one": (
        "accept_pmf", _law_shifted_by_one, lambda: check_tokens_match_monte_carlo(SMALL[3], P, 20_000)),
    "the DP ignores the depth bound": (
        "best_tree", _dp_ignores_depth, lambda: check_dp_is_best_over_all_trees((0.6, 0.2, 0.1))),
    "the DP's tree built with its ranks reversed": (
        "best_tree", _dp_ranks_reversed, lambda: check_dp_tree_has_its_value((0.6, 0.2, 0.1), 16, 4)),
    "some child always accepted (weights renormalized per level)": (
        "path_probs", _some_child_always_accepted, lambda: check_dominance((0.6, 0.2, 0.1))),
    "the draft priced per node level, not per parent level": (
        "draft_widths", _draft_widths_of_the_level_itself, check_tree_speedup_by_hand),
    "the verify cost of N + 1 tokens ignored by the chooser": (
        "predicted_speedups", _speedups_with_a_flat_verify, check_chooser_follows_the_verify_cost),
    "every sibling counted as tried": (
        "rank_counts", _tried_counts_every_child, check_rank_counts_estimate_p),
    "Sequoia's marginal w taken as the conditional p": (
        "conditional_from_marginal", lambda orig: lambda w: np.asarray(w, float),
        lambda: check_marginal_form(SEQUOIA_HEAD)),
    "the DP's dead nodes kept": (
        "live_paths", lambda orig: lambda paths, p: tt.canonical_paths(paths),
        lambda: check_live_paths((0.6, 0.2, 0.1), 16, 2, 12)),
    "a p_k = 0 rank's placeholder dropped (a rank gap)": (
        "live_paths", _live_without_placeholders,
        lambda: check_live_paths((0.6, 0.0, 0.3), 8, 2, 7)),
}


@pytest.mark.parametrize("bug", list(MUTATIONS))
def test_each_deliberate_bug_fails_its_check(monkeypatch, bug):
  name, make, check = MUTATIONS[bug]
  check()  # passes as shipped
  monkeypatch.setattr(tt, name, make(getattr(tt, name)))
  with pytest.raises(AssertionError):
    check()
