"""Tree acceptance (decode/tree_acceptance.py): exact multi-draft sampling is
exact, greedy keeps the deepest matching path, a tree dominates its chain, and
the simulated rules follow their laws.

The exactness tests use a synthetic autoregressive pair over V = 6 tokens: the
target's and the draft's logits for a context are pseudo-random functions of
its tokens (a fold_in chain over the first L of them), so that two nodes with
the same context (duplicate stochastic siblings) get the same p, as a model
gives them. Every trial drafts TREE from the draft (i.i.d. children from q,
or q's top-k), judges it, appends the emitted tokens and repeats, until it
holds a window of W tokens; thousands of trials run as one batch in one jitted
function. Two laws are computed by enumeration, never by sampling:
  output law      the target's own law of the window (t0, t1, t2): the
                  first token, and the pairs (t0, t1), (t1, t2), which hold
                  the bonus at a depth-1 and a depth-2 leaf;
  step law        the law of the first step's last accepted node (block
                  index; its depth is the accepted count) by recursion over
                  the tree, and the expected children tried and accepted at
                  each rank.
Each is a chi-square goodness-of-fit test (tests/lawcheck.py's), Bonferroni
over the tests of a configuration. MUTATIONS patch one deliberate bug at a
time into tree_acceptance; each must fail the test it names.
"""

import functools
import itertools
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from lawcheck import ALPHA, chi2_pvalue, mutant

from specjax.decode import acceptance
from specjax.decode import tree_acceptance as ta
from specjax.errors import ConfigError
from specjax.metrics import tree_theory
from specjax.model import sampling
from specjax.model.sampling import SamplingParams

V = 6
# Width 3 at the root, depth 3, leaves at depths 1, 2 and 3:
#   root -> n0 (-> n3 (-> n6), n4), n1 (-> n5), n2
TREE = np.array([-1, -1, -1, 0, 0, 1, 3], np.int32)
DEPTH, KIDS = 3, 3
PATHS = ((0,), (1,), (2,), (0, 0), (0, 1), (1, 0), (0, 0, 0))  # TREE as rank paths
CHAIN = np.array([-1, 0, 1], np.int32)          # TREE's rank-0 path: n0, n3, n6
CHAIN_BLOCKS = np.array([0, 1, 4, 7])           # their block indices (root first)
W = 3            # the tested window t0 t1 t2
L = max(W - 1, DEPTH)  # the context length the synthetic models see
ROWS = 20000
SAMPLINGS = {"T1": SamplingParams(1.0), "top_p0.8": SamplingParams(1.0, top_p=0.8)}
SCALE, NOISE = 1.0, 1.0  # target logits ~ N(0, SCALE^2); the draft's add N(0, NOISE^2)
SEED = 15  # a context table where every node of TREE is the last accepted >= 1% of steps

# ---------------------------------------------------------------- the synthetic pair


@jax.jit
def context_logits(ctx, n):
  """(target, draft) logits [B, V] of contexts ctx [B, >= L] of lengths n [B]:
  pseudo-random functions of the first min(n, L) tokens."""
  def one(c, m):
    k = jax.random.PRNGKey(SEED)
    for i in range(L):
      k = jnp.where(i < m, jax.random.fold_in(k, c[i]), k)
    kt, kd = jax.random.split(k)
    t = SCALE * jax.random.normal(kt, (V,))
    return t, t + NOISE * jax.random.normal(kd, (V,))
  return jax.vmap(one)(ctx, n)


def _put(ctx, at, tok):
  """ctx [B, C] with ctx[b, at[b]] = tok[b] (dropped past the end)."""
  return ctx.at[jnp.arange(len(ctx)), at].set(tok, mode="drop")


def draft_and_judge(key, ctx, n, sp, siblings):
  """One speculative step of every row: draft TREE after ctx[:n], judge it.
  Returns (drafts [B, N], verdict)."""
  k_draft, k_acc = jax.random.split(key)
  ctxs, lens = [ctx], [n]                       # per block
  drafts = []

  def dists(c, m):
    t, d = context_logits(c, m)
    return sampling.probs(t, sp), sampling.probs(d, sp), d

  p0, q0, dl0 = dists(ctx, n)
  ps, qs, dls = [p0], [q0], [dl0]
  for i, par in enumerate(TREE):
    blk = par + 1
    rank = int(np.sum(TREE[:i] == par))
    if siblings == "stochastic":
      x = sampling.sample(jax.random.fold_in(k_draft, i), qs[blk])
    else:  # the draft's rank-th most likely token (from its logits: no ties)
      x = jax.lax.top_k(dls[blk], rank + 1)[1][:, rank].astype(jnp.int32)
    drafts.append(x)
    c = _put(ctxs[blk], lens[blk], x)
    ctxs.append(c)
    lens.append(lens[blk] + 1)
    p, q, dl = dists(c, lens[-1])
    ps.append(p), qs.append(q), dls.append(dl)
  drafts = jnp.stack(drafts, 1)
  verdict = ta.judge_tree(k_acc, TREE, drafts, jnp.stack(ps, 1), jnp.stack(qs, 1),
                          siblings=siblings)
  return drafts, verdict


@functools.partial(jax.jit, static_argnames=("sp", "siblings", "rows"))
def trials(key, sp, siblings, rows):
  """(window [R, W], first step's verdict) of `rows` independent trials."""
  cap = W + DEPTH + 1

  def step(s, state):
    ctx, n, first = state
    drafts, v = draft_and_judge(jax.random.fold_in(key, s), ctx, n, sp, siblings)
    first = jax.tree_util.tree_map(lambda a, b: jnp.where(s == 0, b, a), first, v)
    for d in range(DEPTH):
      tok = jnp.take_along_axis(drafts, jnp.maximum(v.path[:, d:d + 1] - 1, 0), 1)[:, 0]
      ctx = _put(ctx, jnp.where(d < v.n_accepted, n + d, cap), tok)
    ctx = _put(ctx, n + v.n_accepted, v.next_token)
    return ctx, n + v.n_accepted + 1, first

  zeros = lambda k: jnp.zeros((rows, k), jnp.int32)
  first = ta.TreeVerdict(zeros(DEPTH), zeros(1)[:, 0], zeros(1)[:, 0], zeros(KIDS), zeros(KIDS))
  # every step emits >= 1 token: W steps fill the window
  ctx, _, first = jax.lax.fori_loop(0, W, step, (zeros(cap), zeros(1)[:, 0], first))
  return ctx[:, :W], first

# ---------------------------------------------------------------- the exact laws


@functools.cache
def context_table(sp: SamplingParams):
  """{context tuple: (p, q, draft logits)} for every context of length <= L (float64)."""
  ctxs = [c for m in range(L + 1) for c in itertools.product(range(V), repeat=m)]
  arr = np.zeros((len(ctxs), L), np.int32)
  for i, c in enumerate(ctxs):
    arr[i, :len(c)] = c
  t, d = context_logits(jnp.asarray(arr), jnp.asarray([len(c) for c in ctxs]))
  p, q = sampling.probs(t, sp), sampling.probs(d, sp)
  return {c: (np.asarray(p[i], np.float64), np.asarray(q[i], np.float64), np.asarray(d[i]))
          for i, c in enumerate(ctxs)}


def window_laws(sp):
  """The target's law of t0 [V] and of the pairs (t0, t1), (t1, t2) [V, V]."""
  tab = context_table(sp)
  p0 = tab[()][0]
  p01 = p0[:, None] * np.stack([tab[(a,)][0] for a in range(V)])
  p012 = p01[:, :, None] * np.array([[tab[(a, b)][0] for b in range(V)] for a in range(V)])
  return p0, p01, p012.sum(0)


def step_law(sp, siblings):
  """The first step's exact law: P(last accepted block = j) [1+N], and the
  expected children tried and accepted at each rank [K], by recursion over
  TREE (the walk's probabilities, not its samples)."""
  tab = context_table(sp)
  kids = {j: [i + 1 for i in range(len(TREE)) if TREE[i] + 1 == j] for j in range(len(TREE) + 1)}
  final, tries, accepts = np.zeros(len(TREE) + 1), np.zeros(KIDS), np.zeros(KIDS)

  def visit(block, ctx, weight):
    r, q, dl = (x.copy() for x in tab[ctx])
    reach = 1.0
    for rank, child in enumerate(kids[block]):
      tries[rank] += weight * reach
      if siblings == "stochastic":     # x ~ q, accepted with min(1, r/q)
        acc = np.minimum(r, q)
        for x in np.flatnonzero(acc > 0):
          visit(child, ctx + (x,), weight * reach * acc[x])
        reject, nxt = 1.0 - acc.sum(), np.maximum(r - q, 0.0)
      else:                            # x = the draft's rank-th choice, accepted with r(x)
        x = int(np.argsort(-dl)[rank])
        acc = np.zeros(V)
        acc[x] = r[x]
        visit(child, ctx + (x,), weight * reach * r[x])
        reject, nxt = 1.0 - r[x], r.copy()
        nxt[x] = 0.0
      accepts[rank] += weight * reach * acc.sum()
      reach *= reject
      if nxt.sum() > 0:
        r = nxt / nxt.sum()
    final[block] += weight * reach

  visit(0, (), 1.0)
  np.testing.assert_allclose(final.sum(), 1.0, atol=1e-6)
  return final, tries, accepts


def exactness_pvalues(sp_name, siblings, seed=0) -> dict[str, float]:
  sp = SAMPLINGS[sp_name]
  window, v = jax.device_get(trials(jax.random.PRNGKey(seed), sp, siblings, ROWS))
  p0, p01, p12 = window_laws(sp)
  out = {"t0": chi2_pvalue(np.bincount(window[:, 0], minlength=V), p0),
         "t0,t1": chi2_pvalue(np.bincount(window[:, 0] * V + window[:, 1], minlength=V * V), p01),
         "t1,t2": chi2_pvalue(np.bincount(window[:, 1] * V + window[:, 2], minlength=V * V), p12)}
  final, tries, accepts = step_law(sp, siblings)
  last = np.where(v.n_accepted > 0, v.path[np.arange(ROWS), np.maximum(v.n_accepted - 1, 0)], 0)
  out["last accepted node"] = chi2_pvalue(np.bincount(last, minlength=len(final)), final)
  depth = np.array([0, 1, 1, 1, 2, 2, 2, 3])
  out["accepted count"] = chi2_pvalue(np.bincount(v.n_accepted, minlength=DEPTH + 1),
                                      np.bincount(depth, weights=final, minlength=DEPTH + 1))
  # The per-rank counts: their means against the exact expectations (z-tests).
  for name, got, want in (("tries", v.tries, tries), ("accepts", v.accepts, accepts)):
    for k in range(KIDS):
      sd = max(got[:, k].std(), 1e-3)
      z = abs(got[:, k].mean() - want[k]) / (sd / np.sqrt(ROWS))
      out[f"{name} rank {k}"] = math.erfc(z / math.sqrt(2))
  np.testing.assert_array_equal(v.accepts.sum(1), v.n_accepted)
  return out


def check_exact(sp_name, siblings):
  ps = exactness_pvalues(sp_name, siblings)
  assert min(ps.values()) * len(ps) > ALPHA, {k: v for k, v in ps.items() if v * len(ps) <= ALPHA}
  return ps


# both sibling rules at T = 1; top-p with stochastic siblings, whose residual
# updates are where a filter could go wrong (top-k siblings judge with the
# same warped p and q): the three settings the mutations run
CONFIGS = [("T1", "stochastic"), ("T1", "topk"), ("top_p0.8", "stochastic")]
assert {m for _, m in CONFIGS} == set(ta.SIBLINGS)


@pytest.mark.parametrize("sp_name,siblings", CONFIGS)
def test_exact_sampling_on_a_tree_is_exact(sp_name, siblings):
  check_exact(sp_name, siblings)


def test_the_laws_see_the_tree():
  """Every node is the last accepted one often enough, and rejections of every
  rank happen: the window sees residuals after one and two rejections, and
  the bonus at leaves of depth 1, 2 and 3."""
  for sp in SAMPLINGS.values():
    for siblings in ta.SIBLINGS:
      final, tries, _ = step_law(sp, siblings)
      assert final.min() > 0.01 and tries[2] > 0.1, (sp, siblings, final, tries)
  p_root, q_root, _ = context_table(SAMPLINGS["top_p0.8"])[()]
  assert (p_root == 0).sum() >= 2 and (q_root == 0).sum() >= 2  # top-p cuts at the root



def judge(key, parents, drafts, p, q=None, **kw):
  """judge_tree in one jit (parents and the settings closed over, static)."""
  return jax.jit(lambda k, d, p, q: ta.judge_tree(k, parents, d, p, q, **kw))(key, drafts, p, q)

# ---------------------------------------------------------------- greedy


def onehot_p(argmaxes):
  return jax.nn.one_hot(jnp.asarray([argmaxes]), V)


# (drafts of n0..n6, target argmax at blocks 0..7) -> (path, next token, tries, accepts)
GREEDY_CASES = [
    # nothing matches at the root: the argmax at the root
    ([1, 1, 1, 0, 0, 0, 0], [2, 0, 0, 0, 0, 0, 0, 0], [-1, -1, -1], 2, [1, 1, 1], [0, 0, 0]),
    # n0 matches, n3 does not, n4 (rank 1) does, and is a leaf: its argmax is the bonus
    ([2, 5, 4, 4, 1, 0, 0], [2, 1, 0, 0, 0, 3, 0, 0], [1, 5, -1], 3, [2, 1, 0], [1, 1, 0]),
    # the full rank-0 path to the depth-3 leaf
    ([2, 5, 4, 1, 3, 0, 4], [2, 1, 0, 0, 4, 0, 0, 5], [1, 4, 7], 5, [3, 0, 0], [3, 0, 0]),
    # duplicate siblings: n0 = n1 = the argmax; only n1's child matches: the deeper path
    ([2, 2, 4, 4, 4, 3, 0], [2, 1, 3, 0, 0, 0, 5, 0], [2, 6, -1], 5, [2, 1, 0], [1, 1, 0]),
    # two matching paths of depth 2 (via n0 -> n4 and n1 -> n5): the first in BFS order
    ([2, 2, 4, 4, 1, 3, 0], [2, 1, 3, 0, 0, 0, 5, 0], [1, 5, -1], 0, [2, 1, 0], [1, 1, 0]),
]


def check_greedy():
  for drafts, argmaxes, path, nxt, tries, accepts in GREEDY_CASES:
    v = judge(jax.random.PRNGKey(0), TREE, jnp.asarray([drafts]), onehot_p(argmaxes),
                      greedy=True)
    got = (v.path[0].tolist(), int(v.next_token[0]), v.tries[0].tolist(), v.accepts[0].tolist())
    assert got == (path, nxt, tries, accepts), (drafts, argmaxes, got)
    assert int(v.n_accepted[0]) == sum(x >= 0 for x in path)


def test_greedy_keeps_the_deepest_matching_path():
  check_greedy()


def test_nodes_not_drafted_are_never_accepted():
  """The full rank-0 path, with n3 not drafted: n0 is the last node, and its
  next token is the argmax at n0 (the bonus of a node whose children are
  all missing); with ranks given, an empty slot is skipped."""
  drafts, argmaxes = [2, 5, 4, 1, 3, 0, 4], [2, 1, 0, 0, 4, 0, 0, 5]
  live = jnp.asarray([[True, True, True, False, True, True, True]])
  for greedy in (True, False):
    v = judge(jax.random.PRNGKey(0), TREE, jnp.asarray([drafts]), onehot_p(argmaxes),
                      onehot_p(argmaxes), greedy=greedy, drafted=live)
    assert v.path[0].tolist() == [1, -1, -1] and int(v.next_token[0]) == 1, (greedy, v)
  # root children at ranks 0, 2 (slot 1 empty); n2 matches at rank 2
  v = judge(jax.random.PRNGKey(0), np.array([-1, -1]), jnp.asarray([[3, 2]]),
                    onehot_p([2, 0, 4]), onehot_p([2, 0, 4]), siblings="topk",
                    ranks=jnp.asarray([[0, 2]]), max_depth=1, max_children=3)
  assert v.path[0].tolist() == [2] and v.tries[0].tolist() == [1, 0, 1], v


def test_tree_shape_and_bad_trees():
  assert ta.tree_shape(TREE) == (DEPTH, KIDS)
  assert tree_theory.paths_from_parents(TREE, [0, 1, 2, 0, 1, 0, 0]) == PATHS
  assert ta.tree_shape(np.stack([TREE, np.arange(-1, 6)])) == (7, 3)
  table = ta.children_table(jnp.asarray(TREE)[None], KIDS)
  assert table[0].tolist() == [[1, 2, 3], [4, 5, -1], [6, -1, -1], [-1, -1, -1],
                               [7, -1, -1], [-1, -1, -1], [-1, -1, -1], [-1, -1, -1]]
  for bad in ([0, -1], [-1, 2, 0], [-2]):
    with pytest.raises(ConfigError, match="parent"):
      ta.tree_shape(np.array(bad))
  p = jnp.full((1, 1 + len(TREE), V), 1.0 / V)
  with pytest.raises(ConfigError, match="exceeds"):
    judge(jax.random.PRNGKey(0), TREE, jnp.zeros((1, 7), jnp.int32), p, p,
                  max_depth=2, max_children=3)
  with pytest.raises(ConfigError, match="siblings"):
    judge(jax.random.PRNGKey(0), TREE, jnp.zeros((1, 7), jnp.int32), p, p,
                  siblings="beam")
  with pytest.raises(ConfigError, match="q"):
    judge(jax.random.PRNGKey(0), TREE, jnp.zeros((1, 7), jnp.int32), p)

# ---------------------------------------------------------------- a tree against its chain


@functools.partial(jax.jit, static_argnums=(1, 2))
def random_blocks(key, b, greedy=False):
  """Random p, q [b, 1+N, V] and drafts [b, N] from q (any inputs will do:
  the comparisons below hold draw by draw)."""
  k1, k2, k3 = jax.random.split(key, 3)
  p = jax.nn.softmax(2.0 * jax.random.normal(k1, (b, 1 + len(TREE), V)))
  q = jax.nn.softmax(2.0 * jax.random.normal(k2, (b, 1 + len(TREE), V)))
  drafts = sampling.sample(k3, q[:, TREE + 1])
  if greedy:  # drafts that often match
    p = jax.nn.one_hot(jnp.where(jax.random.uniform(k1, (b, 1 + len(TREE))) < 0.6,
                                 jnp.argmax(q, -1), jnp.argmax(p, -1)), V)
    drafts = jnp.argmax(q[:, TREE + 1], -1).astype(jnp.int32)
  return p, q, drafts


SIBLINGS_TABLE = ta.accept_table(acceptance.parse_rule("siblings:0.6,0.4"), DEPTH, KIDS)
RULES = {"stochastic": {}, "topk": {"siblings": "topk"}, "greedy": {"greedy": True},
         "siblings:0.6,0.4": {"simulated": True, "accept_p": SIBLINGS_TABLE}}


def check_dominance():
  b = 4000
  for name, kw in RULES.items():
    p, q, drafts = random_blocks(jax.random.PRNGKey(1), b, name == "greedy")

    @jax.jit
    def both(key, p, q, drafts, kw=kw):
      tree = ta.judge_tree(key, TREE, drafts, p, q, **kw)
      # the same bounds: the chain sees the tree's uniforms at rank 0
      chain = ta.judge_tree(key, CHAIN, drafts[:, CHAIN_BLOCKS[1:] - 1], p[:, CHAIN_BLOCKS],
                            q[:, CHAIN_BLOCKS], max_depth=DEPTH, max_children=KIDS, **kw)
      return tree, chain

    tree, chain = both(jax.random.PRNGKey(2), p, q, drafts)
    worse = np.asarray(tree.n_accepted < chain.n_accepted)
    assert not worse.any(), (name, int(worse.sum()))
    gain = float(np.mean(tree.n_accepted) - np.mean(chain.n_accepted))
    assert gain > 0.05, (name, gain)


def test_a_tree_accepts_at_least_what_its_chain_accepts():
  check_dominance()


def check_chain_is_judge():
  """On a chain, judge_tree is acceptance.judge draw for draw (same key),
  rows that drafted fewer tokens (judge's n_drafted) included."""
  b, g = 3000, 3
  p, q, _ = random_blocks(jax.random.PRNGKey(3), b)
  p, q = p[:, :g + 1], q[:, :g + 1]
  drafts = sampling.sample(jax.random.PRNGKey(4), q[:, :g])
  n_drafted = jnp.where(jnp.arange(b) % 5 == 0, jnp.arange(b) % (g + 1), g)
  drafted = jnp.arange(g)[None, :] < n_drafted[:, None]
  key = jax.random.PRNGKey(5)
  probs = acceptance.position_probs(acceptance.parse_rule("bernoulli:0.6"), g)
  cases = {"stochastic": (False, SamplingParams(1.0), False, {}),
           "topk": (False, SamplingParams(1.0), True, {"siblings": "topk"}),
           "simulated": (True, SamplingParams(1.0), False,
                         {"simulated": True, "accept_p": probs[:, None]}),
           "greedy": (False, SamplingParams(0.0), False, {"greedy": True})}
  for name, (sim, sp, det, kw) in cases.items():
    @jax.jit
    def both(key, pp, q, sim=sim, sp=sp, det=det, kw=kw):
      chain = acceptance.judge(key, sim, jnp.asarray(probs), sp, drafts, q[:, :g], pp,
                               n_drafted, deterministic=det)
      return chain, ta.judge_tree(key, CHAIN, drafts, pp, q, drafted=drafted, **kw)

    (n, nxt), v = both(key, sampling.probs(jnp.log(p), sp), q)
    assert np.array_equal(n, v.n_accepted), name
    assert np.mean(np.asarray(nxt) == np.asarray(v.next_token)) > 0.999, name
  # top-k siblings need no q
  p, q, drafts = random_blocks(key, 100)
  v = judge(key, TREE, drafts, p, siblings="topk")
  w = judge(key, TREE, drafts, p, q, siblings="topk")
  assert np.array_equal(v.path, w.path) and np.array_equal(v.next_token, w.next_token)


def test_on_a_chain_it_is_the_chain_judge():
  check_chain_is_judge()

# ---------------------------------------------------------------- simulated rules


def check_siblings_on_chain():
  """siblings:P equals bernoulli:P on a chain: the chain's per-position
  probabilities, the tree table, and the law (the capped geometric)."""
  bern = acceptance.parse_rule("bernoulli:0.7")
  sib = acceptance.parse_rule("siblings:0.7,0.2")
  np.testing.assert_array_equal(acceptance.position_probs(sib, 4),
                                acceptance.position_probs(bern, 4))
  assert acceptance.expected_accepted(sib, 4) == acceptance.expected_accepted(bern, 4)
  np.testing.assert_array_equal(ta.accept_table(sib, 4, 1), ta.accept_table(bern, 4, 1))
  b, g = 20000, 4
  chain = np.arange(-1, g - 1)
  p = jnp.full((b, g + 1, V), 1.0 / V)
  v = judge(jax.random.PRNGKey(6), chain, jnp.zeros((b, g), jnp.int32), p,
                    simulated=True, accept_p=ta.accept_table(sib, g, 1))
  pmf = np.array([0.7 ** k * (0.3 if k < g else 1.0) for k in range(g + 1)])
  pv = chi2_pvalue(np.bincount(v.n_accepted, minlength=g + 1), pmf)
  assert pv > ALPHA, pv


def test_siblings_on_a_chain_is_bernoulli():
  check_siblings_on_chain()


def tree_rule_law(table: np.ndarray) -> np.ndarray:
  """P(last accepted block = j) of a simulated table on TREE, by enumeration."""
  final = np.zeros(len(TREE) + 1)

  def visit(block, depth, weight):
    reach = 1.0
    for rank, child in enumerate(i + 1 for i in range(len(TREE)) if TREE[i] + 1 == block):
      visit(child, depth + 1, weight * reach * table[depth, rank])
      reach *= 1.0 - table[depth, rank]
    final[block] += weight * reach

  visit(0, 0, 1.0)
  return final


def check_simulated_tree_laws():
  """The law of the last accepted node on TREE under simulated rules, against
  the enumeration of the documented tables (siblings:P repeats its last value),
  and the law of the accepted count against metrics/tree_theory's."""
  tables = {spec: ta.accept_table(acceptance.parse_rule(spec), DEPTH, KIDS)
            for spec in ("siblings:0.5", "siblings:0.6,0.3", "siblings:0.4,0", "fraction:0.6")}
  np.testing.assert_allclose(tables["siblings:0.5"], np.full((DEPTH, KIDS), 0.5))
  np.testing.assert_allclose(tables["siblings:0.6,0.3"][1], [0.6, 0.3, 0.3])
  np.testing.assert_allclose(tables["fraction:0.6"][:, 2], [1, 1, 0])  # ceil(0.6 * 3) = 2
  b = 20000
  p = jnp.full((b, 1 + len(TREE), V), 1.0 / V)
  ps = {}
  for spec, table in tables.items():
    v = judge(jax.random.PRNGKey(8), TREE, jnp.zeros((b, len(TREE)), jnp.int32), p,
                      simulated=True, accept_p=table)
    last = np.where(v.n_accepted > 0, v.path[np.arange(b), np.maximum(v.n_accepted - 1, 0)], 0)
    ps[spec] = chi2_pvalue(np.bincount(last, minlength=len(TREE) + 1), tree_rule_law(table))
    if spec.startswith("siblings"):  # the theory's law of the count, given the full-width vector
      pmf = tree_theory.accept_pmf(PATHS, table[0])
      ps[f"{spec} count"] = chi2_pvalue(np.bincount(v.n_accepted, minlength=DEPTH + 1), pmf)
  assert min(ps.values()) * len(ps) > ALPHA, ps


def test_simulated_rules_on_a_tree():
  check_simulated_tree_laws()


def check_tables_and_parsing():
  for spec in ("bernoulli:0.3", "fraction:0.5", "always", "mean_length:2", "siblings:0.9,0.1"):
    rule = acceptance.parse_rule(spec)
    np.testing.assert_array_equal(ta.accept_table(rule, 4, 1)[:, 0],
                                  acceptance.position_probs(rule, 4))
  assert str(acceptance.parse_rule("siblings:0.8,0.25")) == "siblings:0.8,0.25"
  assert acceptance.parse_rule("siblings:0.8,0.25").probs == (0.8, 0.25)
  with pytest.raises(ConfigError, match="chains"):
    ta.accept_table(acceptance.parse_rule("mean_length:2"), 3, 2)
  for bad in ("siblings", "siblings:", "siblings:0.5,x", "siblings:1.5", "siblings:0.5,-0.1"):
    with pytest.raises(ConfigError, match="siblings") as err:
      acceptance.parse_rule(bad)
    assert "\n" not in str(err.value)


def test_accept_tables_and_the_siblings_rule():
  check_tables_and_parsing()

# ---------------------------------------------------------------- mutations


def _no_residual_update(orig):
  del orig
  return lambda r, law: r


def _walk_mutant(old, new):
  return lambda orig: mutant(orig, old, new)


MUTATIONS = {
    "no residual update between siblings": (
        ta, "residual", _no_residual_update, lambda: check_exact("T1", "stochastic")),
    "the stochastic update (p - q) applied to top-k siblings": (
        ta, "_walk", _walk_mutant("residual(r, law)", "residual(r, q_node)"),
        lambda: check_exact("T1", "topk")),
    "the bonus at a leaf drawn from the last residual": (
        ta, "_walk", _walk_mutant("jnp.where(leaf[:, None], p[rows, node], r)", "r"),
        lambda: check_exact("top_p0.8", "stochastic")),
    "siblings tried in reverse rank order": (
        ta, "_walk", _walk_mutant("child = kids[:, k]", "child = kids[:, k_max - 1 - k]"),
        check_dominance),
    "siblings tried in reverse rank order (the step law)": (  # invisible with top-k siblings
        ta, "_walk", _walk_mutant("child = kids[:, k]", "child = kids[:, k_max - 1 - k]"),
        lambda: check_exact("T1", "stochastic")),
    "greedy keeps the first matching path, not the deepest": (
        ta, "_deepest", _walk_mutant("depth * (n + 1) - jnp.arange(n)", "n - jnp.arange(n)"),
        check_greedy),
    "the next token drawn with the acceptance key": (
        ta, "judge_tree", _walk_mutant("sampling.sample(k_tok, law)", "sampling.sample(k_u, law)"),
        check_chain_is_judge),
    "siblings: ranks past the list get 0": (
        ta, "accept_table", _walk_mutant("probs[min(r, len(probs) - 1)]",
                                         "(probs[r] if r < len(probs) else 0.0)"),
        check_simulated_tree_laws),
    "siblings: a chain uses the last listed value": (
        acceptance, "_parse_siblings", _walk_mutant('AcceptRule("siblings", probs[0], probs)',
                                                    'AcceptRule("siblings", probs[-1], probs)'),
        check_siblings_on_chain),
    "siblings: probabilities above 1 accepted": (
        acceptance, "_parse_siblings", _walk_mutant("not 0.0 <= x <= 1.0", "not 0.0 <= x"),
        check_tables_and_parsing),
}


@pytest.mark.parametrize("bug", list(MUTATIONS))
def test_each_deliberate_bug_fails_its_test(monkeypatch, bug):
  module, name, make, check = MUTATIONS[bug]
  jax.clear_caches()
  monkeypatch.setattr(module, name, make(getattr(module, name)))
  try:
    with pytest.raises((AssertionError, pytest.fail.Exception)) as err:
      check()
  finally:
    monkeypatch.undo()
    jax.clear_caches()
  print(f"MUTATION | {bug} | {str(err.value)[:300]}")
