"""prefills.MemoRunner, the sweep's prompts prefilled once: a batch from the
memo equals the batch's own prefill below each row's length, each prompt
is prefilled once per capacity and hidden-layer choice, and runs from it
(which donate their cache) give a fresh run's tokens, twice. Committed
deliberate bugs must each fail: the rows stacked in the wrong order, the
memo's own buffers handed out at batch 1, the key blind to the hidden layers."""

import jax
import numpy as np
import pytest

from specjax.bench.sweep import prefills
from specjax.decode import generation, speculative
from specjax.model import steps
from specjax.model.config import get_preset

PROMPTS = [[3, 9, 4, 1, 7], [5, 2, 8, 8, 1, 6, 2, 9, 4], list(range(10, 27))]
CAP = 48


@pytest.fixture(scope="module")
def models(init_params):
  cfg, dcfg = get_preset("tiny"), get_preset("tiny-draft")
  return steps.Runner(cfg, init_params(cfg, 0)), steps.Runner(dcfg, init_params(dcfg, 1))


def check_batch_equals_its_prefill(target, batch, hidden=False):
  memo = prefills.MemoRunner.wrap(target, PROMPTS)
  kw = dict(return_hidden=True, hidden_layers=(0, 1)) if hidden else {}
  got = memo.prefill(batch, memo.new_cache(len(batch), CAP), **kw)
  want = target.prefill(batch, target.new_cache(len(batch), CAP), **kw)
  np.testing.assert_allclose(got[0], want[0], atol=1e-5, rtol=1e-5)
  lens = np.asarray(want[1].lengths)
  np.testing.assert_array_equal(got[1].lengths, lens)
  for a, b in zip(got[1].k + got[1].v, want[1].k + want[1].v):
    for r, n in enumerate(lens):
      np.testing.assert_allclose(np.asarray(a)[r, :, :n], np.asarray(b)[r, :, :n], atol=1e-5)
  if hidden:
    assert got[2].shape == want[2].shape
    for r, n in enumerate(lens):
      np.testing.assert_allclose(got[2][r, :n], want[2][r, :n], atol=1e-5)


def check_runs_equal_fresh_runs(target, draft):
  memo_t, memo_d = prefills.wrap(target, PROMPTS), prefills.wrap(draft, PROMPTS)
  for rows in ([PROMPTS[1]],):  # batch 1: the stack that must copy (batches: the test above)
    want = generation.generate(target, rows, 6, capacity=CAP).tokens
    want_s = speculative.generate(target, draft, rows, 6, 2, capacity=CAP).tokens
    for _ in range(2):  # each run donates its cache: the memo's rows must survive
      assert generation.generate(memo_t, rows, 6, capacity=CAP).tokens == want
      assert speculative.generate(memo_t, memo_d, rows, 6, 2, capacity=CAP).tokens == want_s


@pytest.mark.parametrize("hidden", [False, True], ids=["cache", "hidden"])
def test_a_batch_from_the_memo_is_its_own_prefill(models, hidden):
  check_batch_equals_its_prefill(models[0], [PROMPTS[2], PROMPTS[0], PROMPTS[1], PROMPTS[0]],
                                 hidden)


def test_each_prompt_is_prefilled_once(models, monkeypatch):
  calls = []
  real = steps.prefill_step
  monkeypatch.setattr(steps, "prefill_step", lambda *a, **k: calls.append(1) or real(*a, **k))
  memo = prefills.MemoRunner.wrap(models[0], PROMPTS)
  for batch in ([PROMPTS[0]], PROMPTS[:2], [PROMPTS[1], PROMPTS[2], PROMPTS[0], PROMPTS[1]]):
    memo.prefill(batch, memo.new_cache(len(batch), CAP))
  assert len(calls) == 3
  memo.prefill(PROMPTS, memo.new_cache(3, CAP), return_hidden=True)
  assert len(calls) == 6  # the hidden states are their own prefill
  memo.prefill(PROMPTS[:1], memo.new_cache(1, CAP + 16))
  assert len(calls) == 7 and len(memo.memo) == 1  # another capacity replaces the rows
  memo.prefill([[1, 2, 3]], memo.new_cache(1, CAP))  # not the sweep's: prefilled as is
  assert len(calls) == 8 and len(memo.memo) == 1


def test_runs_from_the_memo_equal_fresh_runs(models):
  check_runs_equal_fresh_runs(*models)


BUGS = {
    "the rows stacked in the wrong order":
        ("stack", lambda rows: jax.tree.map(lambda *x: jax.numpy.concatenate(x, 0), *rows[::-1])
         if len(rows) > 1 else jax.tree.map(jax.numpy.copy, rows[0]), "batch"),
    "the memo's own buffers handed out at batch 1":
        ("stack", lambda rows: rows[0] if len(rows) == 1 else
         jax.tree.map(lambda *x: jax.numpy.concatenate(x, 0), *rows), "runs"),
    "the key blind to the hidden layers":
        ("memo_key", lambda row, capacity, layers: (row, capacity), "hidden"),
}


@pytest.mark.parametrize("bug", list(BUGS))
def test_each_deliberate_bug_fails(models, monkeypatch, bug):
  name, mutant, check = BUGS[bug]
  monkeypatch.setattr(prefills, name, mutant)
  batch = [PROMPTS[2], PROMPTS[0], PROMPTS[1]]
  with pytest.raises(Exception):
    if check == "batch":
      check_batch_equals_its_prefill(models[0], batch)
    elif check == "runs":
      check_runs_equal_fresh_runs(*models)
    else:
      memo = prefills.MemoRunner.wrap(models[0], PROMPTS)
      memo.prefill(batch, memo.new_cache(3, CAP))
      got = memo.prefill(batch, memo.new_cache(3, CAP), return_hidden=True, hidden_layers=(0,))
      assert len(got) == 3
