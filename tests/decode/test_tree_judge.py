"""The tree step's judge as the engine calls it (tree_step.verdict): the
acceptance law it really applies, checked against the exact step law of
SpecInfer's multi-draft rule computed here independently, and the sibling
bound a grafted prompt-lookup chain needs. Each has its deliberate bug
committed below (both stay lossless and pass the end-to-end tests: one
halves the tokens per step at T = 1, the other never tries the graft)."""

import dataclasses
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from scipy import stats as scipy_stats

from specjax.decode import tree_step
from specjax.drafters.base import DraftedTree
from specjax.model import tree as trees
from specjax.model.sampling import SamplingParams

import lawcheck

TREE = trees.from_paths([[0], [1], [0, 0], [0, 1], [1, 0]])  # width 2, depth 2
P = np.array([0.45, 0.2, 0.1, 0.1, 0.1, 0.05])   # the target's law at every node
Q = np.array([0.05, 0.1, 0.35, 0.05, 0.3, 0.15])  # the draft's, far from it
ROWS = 20000


@dataclasses.dataclass(frozen=True)
class Judging:
  """What the judge reads of a SpecConfig."""
  tree: object
  sp: SamplingParams = SamplingParams(1.0)
  siblings: str = "stochastic"
  simulated: bool = False
  drafter: object = dataclasses.field(
      default_factory=lambda: types.SimpleNamespace(deterministic=False))


def exact_depth_law(tree: trees.Tree, p, q) -> np.ndarray:
  """P(accepted depth = d) of one step with stochastic siblings (i.i.d. from
  q) at context-free laws p, q: at a node, sibling i is accepted with
  beta_i = sum_x min(q(x), r_i(x)), r_0 = p and r_{i+1} = norm(max(0, r_i - q))
  (SpecInfer's multi-draft rule: the residual after a sibling drawn from q
  does not depend on its token); an accepted child starts afresh at p."""
  kids = {u: [i for i, a in enumerate(tree.parents) if a == u] for u in [-1, *range(tree.n)]}

  def law(u) -> np.ndarray:
    out, r, left = np.zeros(tree.max_depth + 1), p.copy(), 1.0
    for c in kids[u]:
      beta = np.minimum(q, r).sum()
      below = law(c)
      out[1:] += left * beta * below[:-1]
      left *= 1 - beta
      res = np.maximum(r - q, 0)
      r = res / res.sum() if res.sum() > 0 else r
    out[0] += left
    return out

  return law(-1)


def judged_depths(sc, seed: int = 0) -> np.ndarray:
  """Accepted depth of ROWS steps: nodes drawn i.i.d. from Q, judged by the engine."""
  rng = np.random.default_rng(seed)
  tokens = rng.choice(len(Q), size=(ROWS, TREE.n), p=Q)
  p = jnp.broadcast_to(jnp.asarray(P, jnp.float32), (ROWS, TREE.block_size, len(P)))
  q = jnp.broadcast_to(jnp.asarray(Q, jnp.float32), (ROWS, TREE.block_size, len(Q)))
  d = DraftedTree(tokens=jnp.asarray(tokens, jnp.int32), q=q, caught_up=jnp.zeros((ROWS,), bool))
  v = tree_step.verdict(jax.random.PRNGKey(seed), jnp.ones((TREE.max_depth, TREE.width)), p, d,
                        sc)
  return np.asarray(v.n_accepted)


def depth_law_pvalue() -> float:
  got = np.bincount(judged_depths(Judging(TREE)), minlength=TREE.max_depth + 1)
  want = ROWS * exact_depth_law(TREE, P, Q)
  return float(scipy_stats.chisquare(got, want).pvalue)


def test_stochastic_siblings_are_judged_by_the_exact_step_law():
  law = exact_depth_law(TREE, P, Q)
  assert law.sum() == pytest.approx(1.0) and law[2] > 0.05  # deep paths are reached
  assert depth_law_pvalue() > 1e-3


GRAFTED = trees.DynamicTree(1, 1, 1, ngram=1)  # the head's one child and a grafted one


def graft_accepted() -> int:
  """A root whose head child (7) the target never takes and whose grafted
  child (3, rank 1) it always takes, judged at T = 1: the graft's extra
  child must be within the judge's sibling bound (DynamicTree.width)."""
  rows, v = 64, 8
  d = DraftedTree(tokens=jnp.tile(jnp.asarray([[7, 3]], jnp.int32), (rows, 1)),
                  q=jnp.zeros((rows, 3, 0)), caught_up=jnp.zeros((rows,), bool),
                  parents=jnp.full((rows, 2), -1, jnp.int32),
                  drafted=jnp.ones((rows, 2), bool))
  p = jnp.zeros((rows, 3, v)).at[:, :, 3].set(1.0)
  sc, table = Judging(GRAFTED, siblings="topk"), jnp.ones((1, GRAFTED.width))
  judge = jax.jit(lambda d, p: tree_step.verdict(jax.random.PRNGKey(1), table, p, d, sc))
  return int(np.sum(np.asarray(judge(d, p).n_accepted)))  # traced parents, as in the engine


def test_a_grafted_child_is_tried():
  assert graft_accepted() == 64


def _width_without_the_graft():
  return property(lambda self: self.k)


MUTATIONS = {
    "stochastic siblings judged by the top-k rule": (
        lambda mp: mp.setattr(tree_step, "verdict", lawcheck.mutant(
            tree_step.verdict, 'siblings="topk" if top_k else sc.siblings', 'siblings="topk"')),
        lambda: depth_law_pvalue() < 1e-6),
    "DynamicTree.width forgets the grafted child": (
        lambda mp: mp.setattr(trees.DynamicTree, "width", _width_without_the_graft()),
        lambda: graft_accepted() == 0),
}


@pytest.mark.parametrize("bug", list(MUTATIONS))
def test_each_deliberate_judge_bug_fails(monkeypatch, bug):
  patch, caught = MUTATIONS[bug]
  jax.clear_caches()
  patch(monkeypatch)
  try:
    assert caught(), f"{bug}: not caught"
  finally:
    monkeypatch.undo()
    jax.clear_caches()
