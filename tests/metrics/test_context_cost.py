"""The context model of a step's cost and the predicted turning batch
(metrics/context_cost.py) on synthetic costs whose answers are known, with
committed deliberate bugs that must each fail."""

import dataclasses

import numpy as np
import pytest

from specjax.errors import SpecjaxError
from specjax.metrics import context_cost as cc
from specjax.metrics import theory

SLOT = 1000.0  # bytes of one slot over the target's layers
TARGET = cc.StepModel(ns=(1, 5), w0=(0.040, 0.060), w1=(0.004, 0.012), kappa=2e-9)
DRAFT = cc.StepModel(ns=(1,), w0=(0.030,), w1=(0.006,), kappa=2e-9)
T_READS, D_READS = cc.Reads(SLOT), cc.Reads(SLOT, window=260)


def synthetic(model, reads, ns, span=lambda n: n):
  return [cc.Point(b, n, float(reads.bytes(b, c, span(n))),
                   float(model.seconds(b, n, reads.bytes(b, c, span(n)))))
          for b in (1, 4, 8) for n in ns for c in (512, 2048, 4096)]


def test_the_fit_recovers_the_weights_and_kv_terms():
  m = cc.fit(synthetic(TARGET, T_READS, (1, 5)))
  assert m.ns == (1, 5)
  np.testing.assert_allclose(m.w0, TARGET.w0, rtol=1e-6)
  np.testing.assert_allclose(m.w1, TARGET.w1, rtol=1e-6)
  assert m.kappa == pytest.approx(TARGET.kappa, rel=1e-6)
  # a draft at one window: its own weights term beside the target's kappa
  d = cc.fit(synthetic(DRAFT, D_READS, (1,), span=lambda n: 4), kappa=m.kappa)
  np.testing.assert_allclose([d.w0[0], d.w1[0]], [0.030, 0.006], rtol=1e-6)
  assert np.max(np.abs(cc.relative_errors(d, synthetic(DRAFT, D_READS, (1,),
                                                       span=lambda n: 4)))) < 1e-9
  # an N between the measured ones interpolates; outside them it is refused
  assert m.weights_term(2, 3) == pytest.approx(0.050 + 2 * 0.008)
  with pytest.raises(SpecjaxError):
    m.weights_term(1, 6)


def test_the_fit_refuses_what_it_cannot_separate():
  one_context = [p for p in synthetic(TARGET, T_READS, (1,)) if p.kv_bytes == p.batch * SLOT * 513]
  with pytest.raises(SpecjaxError, match="cannot be told"):
    cc.fit(one_context)
  with pytest.raises(SpecjaxError, match="two batches"):
    cc.fit([p for p in synthetic(TARGET, T_READS, (1,)) if p.batch == 1])


def test_reads_cut_at_the_window():
  assert D_READS.bytes(2, 100, 4) == 2 * SLOT * 104
  assert D_READS.bytes(2, 8192, 4) == 2 * SLOT * 264
  assert T_READS.bytes(2, 8192, 1) == 2 * SLOT * 8193


def test_speedups_are_the_batch_formula_at_the_models_costs():
  """Each batch's prediction against theory.batch_speedup at costs worked
  out here: T(B, 1) and T(B, gamma + 1) over the context and the step's
  tokens, the draft over its window and the gamma it feeds."""
  alpha, gamma, c, batches = 0.8, 4, 4096, [1, 2, 8]
  got = cc.speedups(TARGET, DRAFT, T_READS, D_READS, alpha, gamma, c, batches, n_tokens=64)
  pmf = theory.geometric_accept_pmf(alpha, gamma)
  for b, s in zip(batches, got):
    t1 = 0.040 + 0.004 * b + 2e-9 * b * SLOT * (c + 1)
    tv = 0.060 + 0.012 * b + 2e-9 * b * SLOT * (c + 5)
    td = 0.030 + 0.006 * b + 2e-9 * b * SLOT * (260 + 4)
    assert s == pytest.approx(theory.batch_speedup(pmf, 64, b, gamma, t1, tv, td), rel=1e-9)


@pytest.mark.parametrize("values,want", [([3, 2, 1, 2, 3], 4), ([1, 2, 3], 1),
                                         ([3, 2, 1], None), ([2, 2, 3], 2), ([3, 1, 1, 2], 4)])
def test_turning_batch_by_hand(values, want):
  batches = [1, 2, 4, 8, 16][:len(values)]
  assert cc.turning_batch(batches, values) == (None if want is None else want)


def test_the_turn_moves_earlier_as_the_context_grows():
  """With the KV read dominating, the speedup rises with the batch at long
  context and falls throughout at short context."""
  kv_heavy = cc.StepModel(ns=(1, 5), w0=(0.040, 0.045), w1=(0.002, 0.004), kappa=2e-8)
  draft = cc.StepModel(ns=(1,), w0=(0.036,), w1=(0.002,), kappa=2e-8)
  batches = [1, 2, 4, 8, 16]
  turn = {c: cc.turning_batch(batches, cc.speedups(kv_heavy, draft, T_READS, D_READS, 0.8, 4,
                                                   c, batches))
          for c in (256, 8192)}
  assert turn[256] is None
  assert turn[8192] == 1


def _ignore_window(f):
  return lambda self, batch, context, span=0: f(dataclasses.replace(self, window=None), batch,
                                                context, span)


def _per_token_rows(f):
  def design(points, ns):
    cols = []
    for n in ns:
      on = np.asarray([p.n == n for p in points], float)
      cols += [on, on * np.asarray([p.batch * p.n for p in points], float)]
    return np.stack(cols, 1)
  return design


def _one_late(f):
  def turning(batches, values):
    got = f(batches, values)
    return None if got is None else batches[min(list(batches).index(got) + 1, len(batches) - 1)]
  return turning


BUGS = {  # name: (attribute of cc or of cc.Reads, its mutant, the test that must fail)
    "the draft's window ignored": ((cc.Reads, "bytes"), _ignore_window,
                                   test_speedups_are_the_batch_formula_at_the_models_costs),
    "w1 per token, not per row": ((cc, "design"), _per_token_rows,
                                  test_the_fit_recovers_the_weights_and_kv_terms),
    "the turn one batch late": ((cc, "turning_batch"), _one_late,
                                lambda: [test_turning_batch_by_hand(v, w) for v, w in
                                         [([3, 2, 1, 2, 3], 4), ([1, 2, 3], 1)]]),
}


@pytest.mark.parametrize("bug", list(BUGS))
def test_each_deliberate_bug_fails(monkeypatch, bug):
  (owner, name), make, check = BUGS[bug]
  monkeypatch.setattr(owner, name, make(getattr(owner, name)))
  with pytest.raises(AssertionError):
    check()
