"""Per-row lengths with a network drafter draft only as deep as the longest
length (rows_step.RowsStep.draft): greedy, the tokens and every step's
accepted counts and lengths equal the run that drafts gamma_max for every
row (the draft model and an EAGLE head), and equal target-only; at T = 1
the output follows the target's law (tests/lawcheck.py) while the depth
varies by step. Committed deliberate bugs must each fail: the draft cache
kept as if every draft had been fed, and the depth one short."""

import jax.numpy as jnp
import numpy as np
import pytest

from specjax.decode import chain_step
from specjax.decode import generation
from specjax.decode import rows_step
from specjax.decode import speculative
from specjax.drafters import eagle
from specjax.model import config
from specjax.model import llama as model
from specjax.model import steps
from specjax.model.sampling import SamplingParams

import lawcheck
from lawcheck import ALPHA, adjusted, pair  # noqa: F401
from lawcheck import perturbed, sharpen

PROMPTS = [[5, 17, 42, 9, 100], [7, 7, 7, 7, 7, 7], [200, 1, 64, 3, 9, 81, 27, 2], [3, 4]]
N_PREDICT = 24
GREEDY = "auto:rows,max=3,budget=8"  # 4 drafts for 4 rows: depth 1 to 3
LAW_PROMPTS = lawcheck.PROMPTS[:2]
LAW_ROWS = 800
SAMPLED = f"auto:rows,max=3,budget={2 * LAW_ROWS * 3 // 2}"  # half a draft a row


@pytest.fixture(scope="module")
def tiny():
  """The tiny preset, sharpened, and a noisy copy as its draft model."""
  cfg = config.get_preset("tiny")
  target = sharpen(steps.Runner(cfg, model.init_params(cfg, 1)), 8.0)
  return target, perturbed(target, 0.3, 3)


@pytest.fixture(scope="module")
def head(tiny, tmp_path_factory):
  """An EAGLE head on the target (tests/decode/test_rows.py's): its block is
  the target's first layer, fc adds the embedding and the feature."""
  target = tiny[0]
  hcfg, eye = eagle.head_config(target.cfg), jnp.eye(target.cfg.dim)
  hp = {"fc": {"kernel": jnp.concatenate([eye, eye], 0), "bias": jnp.zeros(target.cfg.dim)},
        "block": target.params["layers_0"]}
  return "eagle:" + str(eagle.save_head(tmp_path_factory.mktemp("depth") / "h", hcfg, hp,
                                        target.cfg, "tiny"))


def run(pair, drafter: str, gamma=GREEDY):
  draft = pair[1] if drafter == "model" else None
  return speculative.generate(pair[0], draft, PROMPTS, N_PREDICT, gamma, drafter=drafter)


def full_depth(pair, drafter: str, monkeypatch):
  """The same run drafting gamma_max for every row (allotted after)."""
  with monkeypatch.context() as m:
    m.setattr(rows_step, "allotted_first", lambda sc: False)
    return run(pair, drafter)


def mismatches(got, want) -> list[str]:
  bad = [] if got.tokens == want.tokens else ["tokens"]
  for f in ("n_acc", "n_drafted", "proposed", "row", "step"):
    if getattr(got.records, f).tolist() != getattr(want.records, f).tolist():
      bad.append(f)
  return bad


@pytest.fixture(scope="module")
def runs(tiny, head):
  mp = pytest.MonkeyPatch()
  out = {d: (run(tiny, d), full_depth(tiny, d, mp)) for d in ("model", head)}
  mp.undo()
  return out


@pytest.mark.parametrize("which", ["model", "head"])
def test_drafting_to_the_longest_length_changes_nothing_but_its_cost(tiny, head, runs, which):
  got, want = runs["model" if which == "model" else head]
  assert not mismatches(got, want)
  rec = got.records
  deepest = [rec.n_drafted[rec.step == s].max() for s in np.unique(rec.step)]
  assert min(deepest) < 3 <= max(deepest), deepest  # shallower steps, and deep ones
  assert 0 < got.stats.n_accept < got.stats.n_drafted
  assert got.tokens == generation.generate(tiny[0], PROMPTS, N_PREDICT).tokens


def test_sampling_at_t1_follows_the_target(pair):
  target, draft = pair
  prompts = [p for p in LAW_PROMPTS for _ in range(LAW_ROWS)]
  res = speculative.generate(target, draft, prompts, 5, SAMPLED, sp=SamplingParams(1.0), seed=5)
  ps = lawcheck.row_pair_pvalues(target, res.tokens, LAW_PROMPTS, LAW_ROWS)
  assert adjusted(ps) > ALPHA, ps
  rec = res.records
  deepest = {int(rec.n_drafted[rec.step == s].max()) for s in np.unique(rec.step)}
  assert len(deepest) > 1, deepest  # the depth varied by step


def _all_fed(key, accept_probs, p, drafted, tail, n, live, sc):
  j = chain_step.accept_phase(key, accept_probs, p, drafted, tail, n, live, sc)
  return rows_step.RowsJudged(**rows_step.fields_of(j), given=drafted.n_drafted,
                              proposed=drafted.proposed, alpha=drafted.alpha,
                              weight=drafted.weight,
                              free=rows_step.free_test(drafted, j.emitted, drafted.n_drafted, sc))


REAL_PROPOSE = {}


def _one_short(self, dparams, dstate, tcache, tail, n, live, key, sc, depth=None):
  real = REAL_PROPOSE["propose"]
  return real(self, dparams, dstate, tcache, tail, n, live, key, sc,
              depth=None if depth is None else depth - 1)


@pytest.mark.parametrize("bug", ["the draft cache kept as if every draft was fed",
                                 "the depth one short"])
def test_each_deliberate_bug_fails(tiny, runs, monkeypatch, bug):
  from specjax.drafters import network  # pylint: disable=import-outside-toplevel
  import jax  # pylint: disable=import-outside-toplevel
  jax.clear_caches()
  if bug.startswith("the draft cache"):
    monkeypatch.setattr(rows_step.RowsStep, "judge", staticmethod(_all_fed))
  else:
    REAL_PROPOSE["propose"] = network.NetworkDrafter.propose
    monkeypatch.setattr(network.NetworkDrafter, "propose", _one_short)
  got = run(tiny, "model")
  jax.clear_caches()
  assert mismatches(got, runs["model"][1])
