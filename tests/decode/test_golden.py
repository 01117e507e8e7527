"""The golden set (tests/golden): runs recorded before the engine's
refactor into feeders, walkers, one step and one adaptive loop reproduce
exactly, tokens and records alike. CI runs one case per drafter and shape
on the stdlib pair; `python tests/golden/golden.py --check` runs all of
them (both pairs, every drafter, chain / static / dynamic / grafted / auto
gamma / auto tree, greedy and sampled)."""

import json

import pytest

from golden import golden

WANT = json.loads(golden.GOLDEN.read_text())


@pytest.fixture(scope="module")
def models():
  return golden.Models()


@pytest.mark.parametrize("case", golden.ci_cases(), ids=lambda c: c.key.rsplit("|", 2)[0])
def test_the_golden_runs_reproduce(models, case):
  assert golden.run(models, case) == WANT[case.key]


def test_a_changed_run_would_be_seen(models):
  """The check can fail: another seed gives other sampled tokens."""
  case = golden.ci_cases()[0]
  other = golden.run(models, golden.Case(**{**case.__dict__, "seed": case.seed + 1}))
  assert other["tokens"] != WANT[case.key]["tokens"]
