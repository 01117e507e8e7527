"""Token trees in the speculative loop (--tree): greedy tree speculation
equals greedy target-only output for the LLaMA drafters, a chain-shaped tree
is the chain step for step, a tree holding the chain's path accepts at least
as much, the caches after a run equal a full forward over the output, and
sampled tree speculation follows the target's law (chi-square, as in
test_lossless.py). MUTATIONS are deliberate bugs, each failing a check."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from specjax.decode import generation
from specjax.decode import speculative
from specjax.decode import tree_step
from specjax.drafters import base as drafters_base
from specjax.model import config
from specjax.model import kv_cache as kvc
from specjax.model import llama as model
from specjax.model import steps
from specjax.model import tree as trees
from specjax.model.sampling import SamplingParams

from lawcheck import PROMPTS, V, adjusted, chi2_pvalue, exact_laws, perturbed, sharpen, pair  # noqa: F401

N_PREDICT = 20
RAGGED = [[5, 9, 3, 7, 1], [2, 8], [11, 4, 6, 250, 33, 17, 90, 3, 3], [42]]
MEDUSA = trees.from_paths([[0], [1], [2], [0, 0], [0, 1], [1, 0], [0, 0, 0], [0, 1, 0]])
DYNAMIC = trees.DynamicTree(3, 4, 6)  # EAGLE-2 style: per row, 30 candidates, 6 kept
# 3 of 6 candidates: the draft's feed layout (root, 2 + 2 frontier nodes) and the
# verify block (mostly the best path) part from depth 2 on
NARROW = trees.DynamicTree(2, 3, 3)
TREES = {"kary:2,2": trees.kary(2, 2), "medusa-8": MEDUSA, "dynamic:3,4,6": DYNAMIC}


@pytest.fixture(scope="module")
def runners():
  cfg = config.get_preset("tiny")
  target = steps.Runner(cfg, model.init_params(cfg, seed=3))
  draft = perturbed(target, 0.3, 4)  # agrees often: deep paths are accepted
  base = generation.generate(target, RAGGED, N_PREDICT)
  return target, draft, base.tokens


@pytest.fixture(scope="module")
def sharp(runners):
  """A confident target drafting for itself: a dynamic tree keeps the deep
  best path rather than the first level's runners-up (the feed layout and
  the verify block then part from depth 2 on)."""
  target = sharpen(runners[0], 30.0)
  return target, target, generation.generate(target, RAGGED, N_PREDICT).tokens


def run(runners, tree, drafter="model", loop="device", **kw):
  target, draft, _ = runners
  return speculative.generate(target, draft if drafter == "model" else None, RAGGED, N_PREDICT,
                              gamma=3, tree=tree, drafter=drafter, loop=loop, **kw)


def greedy_mismatches(runners, tree, drafter="model", loop="device") -> list[int]:
  """Rows whose greedy tree-speculative tokens differ from target-only's."""
  got = run(runners, tree, drafter, loop).tokens
  return [b for b, (g, w) in enumerate(zip(got, runners[2])) if g != w]


# Every tree with the draft model; each layer-skip form (the first layer's
# shared cache, a listed layer's own cache) with one static and the dynamic
# tree (each pair a compile of the whole loop: the full cross costs 4 more).
GREEDY = [(name, "model") for name in TREES] + [
    ("kary:2,2", "layerskip:1"), ("dynamic:3,4,6", "layerskip:1"),
    ("medusa-8", "layerskip:1-1"), ("dynamic:3,4,6", "layerskip:1-1")]


@pytest.mark.parametrize("name,drafter", GREEDY)
def test_greedy_tree_speculation_equals_target_only(runners, name, drafter):
  assert greedy_mismatches(runners, TREES[name], drafter) == []


def test_host_loop_equals_device_loop(runners):
  dev, host = run(runners, MEDUSA), run(runners, MEDUSA, loop="host")
  assert dev.tokens == host.tokens == runners[2]
  np.testing.assert_array_equal(dev.records.n_acc, host.records.n_acc)


def test_chain_shaped_tree_is_the_chain(runners):
  target, draft, want = runners
  chain = speculative.generate(target, draft, RAGGED, N_PREDICT, gamma=3)
  tree = run(runners, trees.chain(3))
  assert chain.tokens == tree.tokens == want
  np.testing.assert_array_equal(chain.records.n_acc, tree.records.n_acc)
  assert chain.stats.n_steps == tree.stats.n_steps


def test_dynamic_tree_of_one_child_is_the_chain(runners):
  """dynamic:1,D,D keeps the draft's greedy chain: the chain step for step."""
  target, draft, want = runners
  chain = speculative.generate(target, draft, RAGGED, N_PREDICT, gamma=3)
  tree = run(runners, trees.DynamicTree(1, 3, 3))
  assert chain.tokens == tree.tokens == want
  np.testing.assert_array_equal(chain.records.n_acc, tree.records.n_acc)


def first_step_accepts(target, draft, prompts, **kw) -> np.ndarray:
  res = speculative.generate(target, draft, prompts, 6, gamma=3, **kw)
  return res.records.at_step(0)


def test_tree_holding_the_chain_accepts_at_least_as_much(runners):
  """The rank-0 path of a top-k tree is the greedy chain's draft: from the
  same state, the tree accepts at least the chain's tokens, row by row."""
  target, draft, _ = runners
  prompts = [list(np.random.RandomState(i).randint(0, 256, 6)) for i in range(12)]
  chain = first_step_accepts(target, draft, prompts)
  tree = first_step_accepts(target, draft, prompts, tree=trees.kary(3, 3))
  assert (tree >= chain).all(), (tree, chain)
  assert (tree > chain).any(), "no row where the siblings helped: the check is empty"


_forward = jax.jit(model.forward, static_argnums=3)  # one compile, not one per op


def cache_mismatches(runners, tree, drafter="model") -> list[str]:
  """The target's (and a draft model's) cache after a run against a full
  forward over prompt + output minus its last token."""
  target, draft, _ = runners
  res = run(runners, tree, drafter, keep_state=True)
  bad = []
  caches = [("target", target, res.state.tcache)]
  if drafter == "model":
    caches.append(("draft", draft, res.state.dcache))
  seqs = [p + out[:-1] for p, out in zip(RAGGED, res.tokens)]
  toks = np.zeros((len(seqs), max(map(len, seqs))), np.int32)  # causal: padding unseen
  for b, seq in enumerate(seqs):
    toks[b, :len(seq)] = seq
  for name, m, cache in caches:
    full = _forward(m.params, jnp.asarray(toks), m.new_cache(len(seqs), toks.shape[1]),
                    m.cfg)[1]
    got_k, want_k = [np.asarray(k) for k in cache.k], [np.asarray(k) for k in full.k]
    for b, seq in enumerate(seqs):
      n = int(cache.lengths[b])
      if n != len(seq) and (name == "target" or n != len(seq) - 1):  # a draft may lag by one
        bad.append(f"{name} row {b}: length {n}, want {len(seq)}")
        continue
      for layer in range(m.cfg.n_layers):  # on the host: no op compiled per row length
        err = float(np.max(np.abs(got_k[layer][b, :, :n] - want_k[layer][b, :, :n])))
        if not err <= 1e-4:
          bad.append(f"{name} row {b} layer {layer}: {err:.2g}")
  return bad


@pytest.mark.parametrize("tree", [MEDUSA, DYNAMIC], ids=lambda t: t.spec)
def test_caches_after_a_run_equal_a_full_forward(runners, tree):
  assert cache_mismatches(runners, tree) == []


def test_a_dynamic_drafts_cache_is_committed_from_its_own_layout(sharp):
  assert run(sharp, NARROW).stats.tokens_per_step > 2.5  # deep paths are accepted
  assert cache_mismatches(sharp, NARROW) == []


# ------------------------------------------------------------ exactness

TREE_SAMPLINGS = {"T1": SamplingParams(1.0), "top_p0.8": SamplingParams(1.0, top_p=0.8)}
ROWS = 1500
EXACT_TREE = trees.from_paths([[0], [1], [0, 0], [0, 1], [1, 0]])  # width 2, depth 2


def output_pvalues(pair_, sp, siblings, tree=EXACT_TREE, seed=0) -> dict[str, float]:
  """Pair laws of the first depth + 3 tokens against the target's own."""
  target, draft = pair_
  w = tree.max_depth + 3
  prompts = [p for p in PROMPTS for _ in range(ROWS)]
  res = speculative.generate(target, draft, prompts, w, gamma=1, sp=sp, seed=seed, tree=tree,
                             siblings=siblings)
  tokens, which = np.array(res.tokens), np.repeat(np.arange(len(PROMPTS)), ROWS)
  out = {}
  for i, prompt in enumerate(PROMPTS):
    laws = exact_laws(target, draft, prompt, sp, w - 3)
    t = tokens[which == i]
    for j, law in enumerate(laws.pairs):
      counts = np.bincount(t[:, j] * V + t[:, j + 1], minlength=V * V)
      out[f"prompt {i} pair t{j},t{j + 1}"] = chi2_pvalue(counts, law)
  return out


# Each sibling rule at T = 1; top-p with stochastic siblings, whose
# without-replacement residuals are where a filter could go wrong (top-k
# siblings and the dynamic tree judge with the same warped p and q).
SAMPLED = [("T1", "topk"), ("T1", "stochastic"), ("T1", "dynamic"), ("top_p0.8", "stochastic")]


@pytest.mark.parametrize("name,siblings", SAMPLED)
def test_sampled_tree_speculation_follows_the_target(pair, name, siblings):
  if siblings == "dynamic":  # top-k siblings chosen per row
    ps = output_pvalues(pair, TREE_SAMPLINGS[name], "topk", trees.DynamicTree(2, 2, 4))
  else:
    ps = output_pvalues(pair, TREE_SAMPLINGS[name], siblings)
  assert adjusted(ps) > 1e-4, {k: v for k, v in ps.items() if v * len(ps) <= 1e-4}


# ------------------------------------------------------------ deliberate bugs


def _siblings_visible(orig):
  def verify_phase(tparams, tcache, tail, drafted, sc):  # a causal mask over the block
    import dataclasses
    t = sc.tree.block_size
    chainish = dataclasses.replace(sc, tree=_Masked(sc.tree, np.tril(np.ones((t, t), bool))))
    return orig(tparams, tcache, tail, drafted, chainish)
  return verify_phase


class _Masked:
  """A tree whose mask() is replaced (everything else delegated)."""
  def __init__(self, tree, mask):
    self._tree, self._mask = tree, mask

  def mask(self):
    return self._mask

  def __getattr__(self, name):
    return getattr(self._tree, name)


def _commit_wrong_path(orig):
  def commit_path(cache, path, n_accepted):  # the path's last node moved one sibling over
    return orig(cache, jnp.where(path > 0, path + 1, path), n_accepted)
  return commit_path


def _draft_commit_skipped(orig):
  del orig
  def roll(self, dcache):  # the draft keeps its scratch where it lies: a chain's rollback
    return drafters_base.Committed.roll(self, dcache)
  return roll


def _draft_commit_by_the_verify_path(orig):
  def roll(self, dcache):  # a dynamic draft's slots taken for the block's
    return orig(self.replace(draft_path=self.path), dcache)
  return roll


MUTATIONS = {
    "siblings see each other in the verify": (
        tree_step, "verify_phase", _siblings_visible,
        lambda r, p: greedy_mismatches(r, MEDUSA)),
    "the commit moves the wrong path": (
        kvc, "commit_path", _commit_wrong_path, lambda r, p: cache_mismatches(r, MEDUSA)),
    "the draft cache's path not moved into place": (
        drafters_base.TreeCommitted, "roll", _draft_commit_skipped,
        lambda r, p: cache_mismatches(r, MEDUSA)),
    "a dynamic draft commits the verify block's slots": (
        drafters_base.TreeCommitted, "roll", _draft_commit_by_the_verify_path,
        lambda r, p: cache_mismatches((sharpen(r[0], 30.0),) * 2 + (None,), NARROW)),
}


@pytest.mark.parametrize("bug", list(MUTATIONS))
def test_each_deliberate_bug_fails(runners, pair, monkeypatch, bug):
  module, name, make, check = MUTATIONS[bug]
  jax.clear_caches()
  monkeypatch.setattr(module, name, make(getattr(module, name)))
  try:
    bad = check(runners, pair)
  finally:
    monkeypatch.undo()
    jax.clear_caches()
  print(f"MUTATION | {bug} | {bad[:3]}")
  assert bad, f"{bug}: not caught"
