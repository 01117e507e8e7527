"""The walkers (drafters/walkers.py) and the feeder protocol (drafters/network.py).

A new network drafter is one small class with a feed: the one below (the
target itself on a cache of its own, under 40 lines) gets chains, static
and dynamic trees from the walkers, greedy-exact against target-only. The
walkers' own laws are checked on a fake feeder with fixed logits: the
stochastic siblings' joint law (i.i.d. from q, drawn with replacement) and
EAGLE-2's selection under exact score ties (the shallower kept first, so a
kept node's parent is kept and it sits at its own level's fed slot). Each
has its deliberate bug committed below.
"""

import dataclasses
from typing import ClassVar

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from scipy import stats as scipy_stats

from specjax.decode import generation
from specjax.decode import speculative
from specjax.drafters import dynamic
from specjax.drafters import network
from specjax.drafters import walkers
from specjax.model import config
from specjax.model import kv_cache as kvc
from specjax.model import llama
from specjax.model import steps
from specjax.model import tree as trees
from specjax.model.sampling import SamplingParams

import lawcheck


# ---------------------------------------------------------------- a drafter in < 40 lines

@dataclasses.dataclass(frozen=True)
class TwinDrafter(network.NetworkDrafter):
  """The target itself, drafting on a KV cache of its own."""
  kind: ClassVar[str] = "twin"
  catches_up: ClassVar[bool] = True  # a chain's d_gamma is never fed

  def draft_config(self, target, draft):
    return target

  def draft_params(self, tparams, draft):
    return tparams

  def init(self, sc, target, dparams, prompts, capacity, first):
    return target.prefill(prompts, target.new_cache(len(prompts), capacity))[1]

  def begin(self, dparams, dstate, tcache, tail, n, live, sc, width):
    forward = lambda tokens, c: llama.forward(dparams, tokens, c, sc.draft)[1]
    cache, behind = network.catch_up(forward, dstate, tail, n, live)
    return network.CacheFeed(cache=cache, base=cache.lengths), behind

  def feed(self, dparams, fst, tokens, lo, anc, parent, sc):
    logits, cache = llama.forward(dparams, tokens, kvc.rollback(fst.cache, fst.base + lo),
                                  sc.draft, tree_mask=anc)
    return logits, fst.replace(cache=cache)

  def end(self, dparams, fst, dstate, tcache, n, sc):
    return kvc.rollback(fst.cache, fst.base), tcache

  def commit(self, dstate, c):
    return c.roll(dstate)


CFG = config.get_preset("tiny").replace(name="tiny-walk", n_layers=2)
PROMPTS = [[5, 17, 42, 9, 100, 5, 17], [7, 7, 7]]
SHAPES = {"chain": None, "static": trees.from_paths([[0], [1], [0, 0], [1, 0], [0, 0, 0]]),
          "dynamic": trees.DynamicTree(2, 3, 5)}


@pytest.fixture(scope="module")
def twin_target(init_params):
  return steps.Runner(CFG, init_params(CFG, 3))


@pytest.mark.parametrize("shape", list(SHAPES))
def test_a_new_drafter_drafts_every_shape_exactly(twin_target, shape):
  """Greedy: target-only tokens, and the twin (the target itself) accepts
  (nearly) every chain draft and a static tree's deepest path (a dynamic
  tree of 5 nodes keeps its 3-deep top path only where its scores allow)."""
  tree = SHAPES[shape]
  want = generation.generate(twin_target, PROMPTS, 12).tokens
  res = speculative.generate(twin_target, None, PROMPTS, 12, 3, drafter=TwinDrafter(),
                             tree=tree)
  assert res.tokens == want
  assert np.mean(res.records.n_acc) >= (1.5 if shape == "dynamic" else 0.8 * 3)


# ---------------------------------------------------------------- a fake feeder

@dataclasses.dataclass(frozen=True)
class FakeConfig:
  """What the walkers read of a SpecConfig."""
  tree: object
  sp: SamplingParams = SamplingParams(1.0)
  siblings: str = "stochastic"
  needs_q: bool = True
  gamma: int = 1
  p_min: float = 0.0


class FixedFeeder:
  """Every fed node's children are drawn from the same logits [V]."""

  def __init__(self, logits):
    self.logits = jnp.asarray(logits, jnp.float32)

  def feed(self, dparams, fst, tokens, lo, anc, parent, sc):
    return jnp.broadcast_to(self.logits, tokens.shape + self.logits.shape), fst


Q = np.array([0.35, 0.25, 0.15, 0.1, 0.1, 0.05])


def sibling_pvalue(rows: int = 4000, seed: int = 0) -> float:
  """Chi-square p-value of the root's two stochastic siblings' joint law
  against q x q (i.i.d., drawn with replacement: SpecInfer's rule assumes it)."""
  sc = FakeConfig(trees.from_paths([[0], [1]]))
  root = jnp.zeros((rows,), jnp.int32)
  d, _ = jax.jit(lambda key: walkers.static_tree(FixedFeeder(np.log(Q)), None, (), root, key,
                                                 sc))(jax.random.PRNGKey(seed))
  pairs = np.asarray(d.tokens)
  counts = np.zeros((len(Q), len(Q)))
  np.add.at(counts, (pairs[:, 0], pairs[:, 1]), 1)
  want = rows * np.outer(Q, Q)
  return float(scipy_stats.chisquare(counts.ravel(), want.ravel()).pvalue)


def test_stochastic_siblings_are_iid_draws_from_q():
  assert sibling_pvalue() > 1e-3


def tie_selection(n_keep: int = 2):
  """A context-free feeder whose top token's log-probability is exactly 0.0
  in float32: every level's best candidate ties at score 0."""
  tree = trees.DynamicTree(2, 3, n_keep)
  logits = np.zeros(8, np.float32)
  logits[3] = 60.0
  assert float(jax.nn.log_softmax(jnp.asarray(logits))[3]) == 0.0
  feeder = FixedFeeder(logits)
  feed = lambda s, tokens, lo, anc, parent: feeder.feed(None, s, tokens, lo, anc, parent, None)
  d, _ = dynamic.select(feed, (), jnp.zeros((1,), jnp.int32), tree)
  return tree, d


def tie_mismatches() -> list[str]:
  """On exact ties the shallower candidate is kept: the tree is the top
  chain 3 -> 3, each node at its own level's fed slot."""
  tree, d = tie_selection()
  got = (np.asarray(d.tokens)[0].tolist(), np.asarray(d.parents)[0].tolist(),
         np.asarray(d.fed)[0].tolist())
  want = ([3, 3], [-1, 0], [0, dynamic.level_span(1, tree.k)[0],
                            dynamic.level_span(2, tree.k)[0]])
  return [] if got == want else [f"(tokens, parents, fed) {got}, want {want}"]


def test_exact_ties_keep_the_shallower_node():
  assert tie_mismatches() == []


# ---------------------------------------------------------------- deliberate bugs

MUTATIONS = {
    "stochastic siblings drawn without replacement": (
        walkers, "static_tree", "jax.random.categorical(k, jnp.log(q)[:, :, None], axis=-1,",
        "(lambda *a, **kw: jax.lax.top_k(jnp.log(q) + jax.random.gumbel(k, q.shape), "
        "tree.width)[1])(k, jnp.log(q)[:, :, None], axis=-1,",
        lambda: sibling_pvalue() < 1e-6),
    "score ties kept deeper-first": (
        dynamic, "select", "jnp.lexsort((dep, -score), axis=-1)",
        "jnp.lexsort((-dep, -score), axis=-1)", lambda: bool(tie_mismatches())),
}


@pytest.mark.parametrize("bug", list(MUTATIONS))
def test_each_deliberate_walker_bug_fails(monkeypatch, bug):
  owner, name, old, new, caught = MUTATIONS[bug]
  jax.clear_caches()
  monkeypatch.setattr(owner, name, lawcheck.mutant(getattr(owner, name), old, new))
  try:
    assert caught(), f"{bug}: not caught"
  finally:
    monkeypatch.undo()
    jax.clear_caches()
