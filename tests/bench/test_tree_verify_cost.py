"""The tree verify in PyTorch (backends/torch_spec.py, tree=) equals specjax's
XLA tree verify (steps.tree_verify) logit for logit on a tiny model, on a
ragged batch; the T(B, N) probes of both engines run (bench/tree_verify_cost.py).
MUTATIONS are deliberate bugs, each failing the check."""

import numpy as np
import pytest

from specjax.bench.studies import tree_verify_cost as tvc
from specjax.bench.backends import torch_spec as ts
from specjax.model import config
from specjax.model import steps
from specjax.model import tree as trees

PROMPTS = [[5, 17, 42, 9, 100], [7, 7, 7], [200, 1, 64, 3, 9, 81, 27, 2], [11]]
MEDUSA = trees.from_paths([[0], [1], [2], [0, 0], [0, 1], [1, 0], [0, 0, 0], [0, 1, 0]])


@pytest.fixture(scope="module")
def pair(transformers, init_params):
  del transformers
  cfg = config.get_preset("tiny")
  params = init_params(cfg, 1)
  return ts.TorchLlama(cfg, params, compile=False, threads=1), steps.Runner(cfg, params)


def check_torch_equals_xla(pair, tree=MEDUSA):
  torch_m, runner = pair
  torch = torch_m.torch
  rng = np.random.RandomState(0)
  block = rng.randint(0, runner.cfg.vocab_size, (len(PROMPTS), tree.block_size))
  cap = 32
  _, cache = runner.prefill(PROMPTS, runner.new_cache(len(PROMPTS), cap))
  want, _ = runner.tree_verify(block, tree.mask(), cache)
  tc = torch_m.new_cache(len(PROMPTS), cap)
  torch_m.prefill(PROMPTS, tc)
  got = torch_m.logits(torch.from_numpy(block), tc, tree=tvc.torch_tree(tree, torch)).numpy()
  np.testing.assert_allclose(got, np.asarray(want), atol=2e-4, rtol=2e-4)


def test_torch_tree_verify_equals_xla(pair):
  check_torch_equals_xla(pair)
  check_torch_equals_xla(pair, trees.chain(4))  # a chain's mask: today's verify
  check_torch_equals_xla(pair, trees.kary(2, 3))


def test_tree_verify_probes_run(pair):
  torch_m, runner = pair
  tl = [trees.chain(3), trees.kary(2, 2)]
  xla = tvc.surface(lambda b: tvc.XlaTreeProbe(runner, b, 32, 8, k=2), [1, 2], tl, reps=1)
  tor = tvc.surface(lambda b: tvc.TorchTreeProbe(torch_m, b, 32, 8, k=2), [1, 2], tl, reps=1)
  for rows in (xla, tor):
    assert [(r["batch"], r["nodes"]) for r in rows] == [(1, 3), (1, 6), (2, 3), (2, 6)]
    assert all(r["seconds"] > 0 for r in rows)


def _rope_at_slot(orig):
  def torch_tree(t, torch):  # depths = the block index (a chain's positions)
    mask, depths = orig(t, torch)
    return mask, torch.arange(t.block_size)
  return torch_tree


def _siblings_visible(orig):
  def torch_tree(t, torch):  # a causal mask over the block
    mask, depths = orig(t, torch)
    return torch.tril(torch.ones_like(mask)), depths
  return torch_tree


MUTATIONS = {"RoPE at the slot": _rope_at_slot, "siblings visible": _siblings_visible}


@pytest.mark.parametrize("bug", list(MUTATIONS))
def test_each_deliberate_bug_fails(pair, monkeypatch, bug):
  monkeypatch.setattr(tvc, "torch_tree", MUTATIONS[bug](tvc.torch_tree))
  with pytest.raises(AssertionError):
    check_torch_equals_xla(pair)
