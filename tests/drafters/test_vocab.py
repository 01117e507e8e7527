"""A reduced draft vocabulary (drafters/vocab.py): the set and its file, the
draft's q (the full head's softmax renormalised over the set, zero outside),
greedy equality with target-only, the sampled law at T = 1 for chains and
both sibling kinds of trees (the set leaves out ids where the target has
mass: the residual must cover them), and the committed deliberate bugs."""

import json
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from specjax.decode import generation
from specjax.decode import plan
from specjax.decode import speculative
from specjax.drafters import draft_model
from specjax.drafters import registry
from specjax.drafters import vocab
from specjax.drafters import walkers
from specjax.errors import CheckpointError, ConfigError
from specjax.model import llama as model
from specjax.model import tree as trees
from specjax.model.sampling import SamplingParams

import lawcheck
from lawcheck import pair  # noqa: F401  (the V = 6 target and its noisy draft)

SET = [1, 2, 4]        # leaves out 0, 3 and 5, where the target has mass
SPECIAL = [1, 2]
EXACT_TREE = trees.from_paths([[0], [1], [0, 0], [0, 1], [1, 0]])


@pytest.fixture(scope="module")
def vocab_dir(tmp_path_factory):
  d = tmp_path_factory.mktemp("vocab")
  counts = np.asarray([0, 5, 5, 0, 9, 0])
  vocab.save(d, vocab.top_ids(counts, 3, SPECIAL), lawcheck.V, SPECIAL,
             ranked=vocab.ranking(counts, SPECIAL))
  return d


# ---------------------------------------------------------------- the set and its file


def test_the_set_is_the_specials_and_the_most_frequent_ids():
  counts = np.asarray([3, 0, 9, 9, 1, 7, 0])
  assert vocab.top_ids(counts, 4, [6]).tolist() == [2, 3, 5, 6]  # ties: the lower id
  assert vocab.ranking(counts, [6]).tolist()[:4] == [6, 2, 3, 5]
  assert vocab.coverage(np.asarray([2, 3]), [[2, 2, 4], [3]]) == 0.75
  with pytest.raises(ConfigError, match="special"):
    vocab.top_ids(counts, 1, [0, 6])


def test_the_file_round_trips_and_bad_files_are_refused(tmp_path, vocab_dir):
  assert vocab.load(vocab_dir, lawcheck.V).tolist() == SET
  assert vocab.load(vocab_dir, lawcheck.V, size=2).tolist() == [1, 2]  # the top of the ranking
  assert vocab.load(tmp_path, lawcheck.V) is None
  with pytest.raises(CheckpointError, match="vocabulary of 6 ids"):
    vocab.load(vocab_dir, 7)
  meta = json.loads((vocab_dir / vocab.VOCAB_FILE).read_text())
  for ids, match in [([4, 2, 1], "sorted"), ([1, 4], "special"), ([1, 2, 6], "sorted")]:
    (tmp_path / vocab.VOCAB_FILE).write_text(json.dumps(dict(meta, ids=ids)))
    with pytest.raises(CheckpointError, match=match):
      vocab.load(tmp_path, lawcheck.V)
  with pytest.raises(ConfigError, match="special"):
    vocab.save(tmp_path / "x", np.asarray([1, 4]), lawcheck.V, SPECIAL)


def test_specs_round_trip_and_bad_ones_are_one_line(vocab_dir):
  for spec in ["model:vocab=full", f"model:vocab={vocab_dir}", "layerskip:2:vocab=4096",
               "eagle:stdlib-eagle:vocab=full", "eagle:vocab=full"]:
    d = registry.parse(spec)
    assert d.spec == spec and registry.parse(d.spec) == d
  for spec, match in [("ngram:vocab=full", "no LM head"), ("model:vocab=", "needs a value"),
                      ("model:vocab=/no/such/dir", "no such file"), ("model:vocab=0", "at least")]:
    with pytest.raises(ConfigError, match=match):
      registry.parse(spec)


# ---------------------------------------------------------------- the draft's q


def first_q(target, draft, drafter):
  """The model drafter's q of its first draft after prefilling prompt 0."""
  sc = plan.SpecConfig(target.cfg, draft.cfg, 2, SamplingParams(1.0), drafter=drafter)
  dparams = sc.drafter.draft_params(target.params, draft)
  prompt = lawcheck.PROMPTS[0]
  dcache = sc.drafter.init(sc, target, dparams, [prompt], 8, [3])
  n = jnp.asarray([len(prompt) + 1], jnp.int32)
  tail = jnp.asarray([[prompt[-1], 3]], jnp.int32)
  d = jax.jit(lambda p, c: sc.drafter.propose(p, c, None, tail, n, jnp.ones((1,), bool),
                                              jax.random.PRNGKey(0), sc)[0])(dparams, dcache)
  return np.asarray(d.q[0, 0]), np.asarray(d.tokens[0])


def test_q_is_the_full_softmax_renormalised_over_the_set(pair, vocab_dir):
  target, draft = pair
  full, _ = first_q(target, draft, draft_model.MODEL)
  got, tokens = first_q(target, draft, registry.parse(f"model:vocab={vocab_dir}"))
  want = np.zeros_like(full)
  want[SET] = full[SET] / full[SET].sum()
  np.testing.assert_allclose(got, want, atol=1e-6)
  assert set(tokens.tolist()) <= set(SET)


def test_a_reduced_head_is_the_full_heads_rows(pair):
  """vocab.logits over head_table's rows equals the full head at the set's
  ids, for a tied embedding and an lm_head (an id map off by one does not)."""
  target, _ = pair
  ids = jnp.asarray(SET)
  h = jax.random.normal(jax.random.PRNGKey(1), (2, 3, target.cfg.dim))
  want = model.head_logits(target.params, h, target.cfg)[..., ids]
  got = vocab.logits(vocab.head_table(target.params, ids), h)
  np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
  tied = {"embed": {"embedding": target.params["lm_head"]["kernel"].T}}
  np.testing.assert_allclose(vocab.logits(vocab.head_table(tied, ids), h), want, rtol=1e-5,
                             atol=1e-5)


# ---------------------------------------------------------------- exactness


@pytest.mark.parametrize("spec", ["model", "layerskip:1"])
def test_greedy_with_a_reduced_set_equals_target_only(pair, vocab_dir, spec):
  target, draft = pair
  want = generation.generate(target, lawcheck.PROMPTS, 12).tokens
  for tree in (None, EXACT_TREE):
    got = speculative.generate(target, draft, lawcheck.PROMPTS, 12, 3, tree=tree,
                               drafter=f"{spec}:vocab={vocab_dir}")
    assert got.tokens == want, (spec, tree)


def output_pvalues(target, draft, drafter, tree=None, siblings="topk", gamma=2):
  """The output's pair laws at T = 1 over gamma + 3 (or depth + 3) tokens."""
  w = (tree.max_depth if tree is not None else gamma) + 3
  return lawcheck.output_pvalues(target, draft, SamplingParams(1.0), w, gamma=gamma, tree=tree,
                                 siblings=siblings, drafter=drafter)


adjusted = lawcheck.adjusted


@pytest.mark.parametrize("tree,siblings", [(None, "topk"), (EXACT_TREE, "topk"),
                                           (EXACT_TREE, "stochastic")])
def test_sampled_reduced_drafts_follow_the_target(pair, vocab_dir, tree, siblings):
  ps = output_pvalues(*pair, f"model:vocab={vocab_dir}", tree, siblings)
  assert adjusted(ps) > lawcheck.ALPHA, {k: v for k, v in ps.items()
                                         if v * len(ps) <= lawcheck.ALPHA}


# ---------------------------------------------------------------- deliberate bugs


def _q_over_the_full_vocabulary(draw):
  """The q handed to the judge is the full vocabulary's share of the set (the
  set's probabilities not renormalised to 1: here 0.6 of them), while the
  tokens are drawn from the set's own law."""
  def bugged(logits, key, sc):
    tok, q, top = draw(logits, key, sc)
    return tok, q * 0.6, top
  return bugged


BUGS = {
    "q renormalised over the full vocabulary": ("chi2", walkers, "_draw",
                                                _q_over_the_full_vocabulary),
    "the id map off by one": ("q", vocab, "head_table",
                              lambda f: lambda p, ids: f(p, jnp.minimum(jnp.asarray(ids) + 1,
                                                                        lawcheck.V - 1))),
    "a special token left out and drafted anyway": (
        "q", vocab, "expand",
        lambda f: lambda r, ids, w: f(r, ids, w).at[..., 0].set(jnp.max(r, -1) + 1.0)),
    "the specials left out of the set": ("file", vocab, "top_ids",
                                         lambda f: lambda c, n, s: f(c, n, [])),
}


@pytest.mark.parametrize("bug", list(BUGS))
def test_each_deliberate_bug_fails(pair, vocab_dir, monkeypatch, bug):
  check, module, name, make = BUGS[bug]
  monkeypatch.setattr(module, name, make(getattr(module, name)))
  jax.clear_caches()  # the engine's programs were compiled without the bug
  try:
    with pytest.raises(AssertionError):
      if check == "chi2":
        test_sampled_reduced_drafts_follow_the_target(pair, vocab_dir, None, "topk")
      elif check == "q":
        test_q_is_the_full_softmax_renormalised_over_the_set(pair, vocab_dir)
      else:
        test_the_set_is_the_specials_and_the_most_frequent_ids()
  finally:
    jax.clear_caches()


def test_the_cost_probe_times_the_head_the_drafter_runs(pair, vocab_dir):
  """probes.draft_probe of model:vocab=... multiplies by the set's rows (the
  sweep's and auto's cost models then see the cheaper step), not by V."""
  from specjax.decode import probes  # pylint: disable=import-outside-toplevel
  target, draft = pair
  widths = {}
  for spec in ("model", f"model:vocab={vocab_dir}"):
    probe = probes.draft_probe(registry.parse(spec), target, draft, 2, 8, 4)
    hlo = probes.repeat_forward.lower(probe.m.params, jnp.zeros((1, 1), jnp.int32),
                                      probe.holder[0], jax.random.PRNGKey(0), cfg=probe.m.cfg,
                                      k=1, sp=SamplingParams()).as_text()
    widths[spec] = {int(w) for w in re.findall(r"dot_general.*-> tensor<1x1x(\d+)xf32>", hlo)}
  # the head's product is the only dot of width V (6) or V_d (3) in this model
  assert lawcheck.V in widths["model"] and len(SET) not in widths["model"], widths
  reduced = widths[f"model:vocab={vocab_dir}"]
  assert len(SET) in reduced and lawcheck.V not in reduced, widths
