"""--tree=auto (decode/autotree.py): the choice follows the costs (a flat
verify wants the biggest tree, a steep one a chain), the positional
acceptance vector by rank estimated from the loop's own records, greedy auto
output equals target-only while the tree switches, and nothing compiles
after the warm-up. MUTATIONS are deliberate bugs, each failing a check."""

import dataclasses

import jax
import numpy as np
import pytest

from specjax.decode import adaptive
from specjax.decode import autotree
from specjax.decode import generation
from specjax.decode import plan
from specjax.decode import speculative
from specjax.drafters import base as drafters_base
from specjax.drafters import registry
from specjax.metrics import tree_theory
from specjax.model import config
from specjax.model import llama as model
from specjax.model import steps
from specjax.model import tree as trees

from lawcheck import perturbed

P = (0.7, 0.3, 0.2, 0.1)
CANDS = plan.candidate_trees((8, 16, 32, 64), 8, P)
PROMPTS = [[5, 9, 3, 7, 1], [2, 8], [11, 4, 6, 250, 33, 17, 90, 3, 3], [42]]
N_PREDICT = 24
SMALL = {"chain:1": trees.chain(1), "chain:2": trees.chain(2), "kary:2,2": trees.kary(2, 2),
         "medusa-6": trees.from_paths([[0], [1], [2], [0, 0], [1, 0], [0, 0, 0]], "medusa-6")}


@dataclasses.dataclass
class FixedCounting(autotree.TreeChooser):
  """adaptive.Fixed's forced schedule on a TreeChooser: it still counts p by rank."""
  names: tuple = ()
  _chunk: int = 0
  choose = adaptive.Fixed.choose


def auto_tree(target, draft, prompts, n_predict, cost, cands, fixed=None, drafter="model",
              rule="real", counting=False, **kw) -> adaptive.AdaptiveResult:
  """--tree=auto among `cands` (the tree chosen by the costs, or forced by
  `fixed`; `counting`: forced and counted), the costs checked against the batch."""
  p = plan.resolve(target.cfg, draft and draft.cfg, drafter=drafter, rule=rule,
                   auto_trees=cands)
  autotree.check_batch(cost, len(prompts))
  chooser = (FixedCounting(cost, p, names=tuple(fixed)) if counting else
             adaptive.Fixed(fixed) if fixed else autotree.TreeChooser(cost, p))
  return adaptive.generate(target, draft, prompts, n_predict, p, chooser, **kw)


def _costs(slope: float, b: int = 4) -> autotree.TreeCosts:
  """T_target(B, n) = 10 + slope (n - 1) ms; a draft level 1 + 0.01 w."""
  ns = sorted({1} | {t.block_size for t in CANDS.values()})
  return autotree.TreeCosts(b, {n: 10 + slope * (n - 1) for n in ns},
                            {1: 1.01, 64: 1.64})


def check_choice_follows_the_costs():
  flat, steep = _costs(0.0), _costs(8.0)
  # flat verify: every node is free, the biggest tree has the most tokens per step
  assert autotree.choose(flat, P, CANDS, drafter="layerskip:1") == "sequoia:64,8"
  # steep verify (compute-bound): one draft is all a step can afford
  assert autotree.choose(steep, P, CANDS, drafter="layerskip:1") == "chain:1"
  # a hand-checked prediction: chain:2 at a flat verify, no catch-up charged
  pred = autotree.predicted_speedups(flat, P, CANDS, drafter="layerskip:1")
  assert pred["chain:2"] == pytest.approx((1 + 0.7 + 0.49) * 10 / (2 * 1.01 + 10))
  tps = tree_theory.tokens_per_step(CANDS["sequoia:16,8"].paths(), P)
  draft = sum(1 + 0.01 * w for w in CANDS["sequoia:16,8"].draft_widths())
  assert pred["sequoia:16,8"] == pytest.approx(tps * 10 / (draft + 10))
  # the best size falls as the verify steepens
  sizes = [CANDS[autotree.choose(_costs(s), P, CANDS, drafter="layerskip:1")].n
           for s in (0.0, 0.05, 0.5, 8.0)]
  assert sizes == sorted(sizes, reverse=True) and sizes[0] > sizes[-1]
  # a calibrated loop step replaces the sum of parts
  slow = dataclasses.replace(flat, t_step={"sequoia:64,8": 1e3})
  assert autotree.choose(slow, P, CANDS, drafter="layerskip:1") != "sequoia:64,8"


def test_choice_follows_the_costs():
  check_choice_follows_the_costs()


def test_costs_round_trip_and_candidates():
  c = dataclasses.replace(_costs(1.0), t_accept={"chain:1": 0.5}, t_step={"chain:2": 3.0})
  assert autotree.TreeCosts.from_dict(c.to_dict()) == c
  # no duplicate topology; chains first; the best trees at p of each size
  paths = [t.paths() for t in CANDS.values()]
  assert len(set(paths)) == len(paths)
  assert list(CANDS)[:4] == ["chain:1", "chain:2", "chain:4", "chain:8"]
  assert CANDS["sequoia:32,8"].paths() == tree_theory.best_tree(P, 32, 8)[0]


@pytest.fixture(scope="module")
def runners():
  cfg = config.get_preset("tiny")
  target = steps.Runner(cfg, model.init_params(cfg, seed=3))
  draft = perturbed(target, 0.3, 4)
  base = generation.generate(target, PROMPTS, N_PREDICT)
  ns = sorted({1} | {t.block_size for t in SMALL.values()})
  cost = autotree.TreeCosts(len(PROMPTS), {n: 1.0 for n in ns}, {1: 0.1})
  p = plan.resolve(target.cfg, draft.cfg, auto_trees=SMALL)
  compile_s = adaptive.warm_up(target, draft, PROMPTS, N_PREDICT, p)
  return target, draft, base.tokens, cost, compile_s


def check_rank_estimate(runners):
  """A simulated siblings:P rule on kary:2,2: the per-rank counts from the
  records estimate P (no prior)."""
  target, draft, _, cost, _ = runners
  r = auto_tree(target, draft, PROMPTS * 4, 40, dataclasses.replace(cost, batch=16),
                SMALL, rule="siblings:0.8,0.4", fixed=["kary:2,2"], counting=True)
  rank_accepted, rank_tried = (r.chooser.rank_accepted.tolist(),
                               r.chooser.rank_tried.tolist())
  p = tree_theory.estimate_p(rank_accepted, rank_tried, P, 0.0)[:2]
  want, tried = np.array([0.8, 0.4]), np.array(rank_tried[:2])
  assert tried.min() > 50 and rank_tried[2] == 0
  assert np.all(np.abs(p - want) < 4 * np.sqrt(want * (1 - want) / tried)), (p, tried)
  # rank 0 is tried at level 1 in every step, at level 2 after an accept
  assert rank_tried[0] == len(r.records.n_acc) + np.sum(r.records.n_acc >= 1)


def test_rank_estimate_from_the_records(runners):
  check_rank_estimate(runners)


def check_greedy_auto(runners):
  target, draft, base, cost, _ = runners
  r = auto_tree(target, draft, PROMPTS, N_PREDICT, cost, SMALL,
                fixed=["medusa-6", "chain:1", "kary:2,2", "chain:2"])
  assert len(set(r.chosen)) == 4  # it switched trees, four times
  assert r.tokens == base
  assert r.compile_s == 0.0
  # chosen by the costs (the verify flat: trees win)
  r = auto_tree(target, draft, PROMPTS, N_PREDICT, cost, SMALL)
  assert r.tokens == base and r.compile_s == 0.0
  assert not SMALL[r.chosen[0]].is_chain
  ps = r.estimates
  assert len(ps) >= 3 and ps[0] == pytest.approx([0.7, 0.3, 0.2][:len(ps[0])])


def test_greedy_auto_equals_target_only_and_compiles_nothing_after_warm_up(runners):
  assert runners[4] > 0
  check_greedy_auto(runners)


def test_refusals(runners):
  target, draft, _, cost, _ = runners
  with pytest.raises(autotree.ConfigError, match="batch 4"):
    auto_tree(target, draft, PROMPTS[:2], 4, cost, SMALL)
  with pytest.raises(autotree.ConfigError, match="T_target"):
    auto_tree(target, draft, PROMPTS, 4, cost, {"kary:3,2": trees.kary(3, 2)})


def test_a_drafter_without_trees_is_refused_before_the_run(runners):
  target, _, _, cost, _ = runners
  ngram = registry.parse("ngram")
  no_trees = type("NoTrees", (type(ngram),), {"propose_tree": drafters_base.Drafter.propose_tree})
  with pytest.raises(autotree.ConfigError, match="cannot draft a token tree"):
    auto_tree(target, None, PROMPTS, 4, cost, SMALL, drafter=no_trees())


# ---------------------------------------------------------------- the deliberate bugs


def _verify_ignored(orig):
  def step_s(self, name, tree, catchup):  # the verify priced as a decode step
    return orig(dataclasses.replace(self, t_target={n: self.t_target[1] for n in self.t_target}),
                name, tree, catchup)
  return step_s


def _leaf_as_node(orig):
  def rank_tables(tree, width):  # leaf read as a node index, not a block index
    acc, tried = orig(tree, width)
    return np.roll(acc, -1, 0), np.roll(tried, -1, 0)
  return rank_tables


def _leaf_is_n_acc(orig):
  def record_row(j, d, kept, live):
    row = orig(j, d, kept, live)
    return {**row, "leaf": j.n_acc}
  return record_row


MUTATIONS = {
    "the verify's cost ignored": (autotree.TreeCosts, "step_s", _verify_ignored,
                                  lambda r: check_choice_follows_the_costs()),
    "leaf read as a node index": (autotree, "rank_tables", _leaf_as_node, check_rank_estimate),
    "leaf recorded as n_acc": (speculative, "_record_row", _leaf_is_n_acc, check_rank_estimate),
}


@pytest.mark.parametrize("bug", list(MUTATIONS))
def test_each_deliberate_bug_fails(runners, monkeypatch, bug):
  module, name, make, check = MUTATIONS[bug]
  monkeypatch.setattr(module, name, make(getattr(module, name)))
  jax.clear_caches()  # a program traced before the bug would hide it
  try:
    with pytest.raises(AssertionError):
      check(runners)
  finally:
    monkeypatch.undo()
    jax.clear_caches()
