"""The auto-gamma chooser and an auto run's statistics (no model, except the
check that the catch-up rule agrees with the engine): hand-checked
predictions, the calibrated step time in the tail-aware choice, the catch-up
charged only to drafters that catch up, alpha from each step's own gamma.
Each fix is pinned by a check that its deliberate bug (the code before it)
fails: MUTATIONS below."""

import dataclasses

import numpy as np
import pytest

from specjax.decode import autogamma
from specjax.decode import speculative
from specjax.metrics import stats
from specjax.metrics import theory
from specjax.model import config
from specjax.model import steps

CHOOSER_SET = (1, 2, 4)
A = 0.8
TOKENS = {1: 1.8, 2: 1 + 0.8 + 0.64, 4: 1 + 0.8 + 0.64 + 0.512 + 0.4096}  # E[1 + k] at A


# Synthetic costs (ms) where the best gamma falls as B grows: T_target(B, n) =
# 10 + (B / 2) (n - 1) (the verify turns compute-bound), T_draft(B, 1) = 1 at
# B <= 8 and 2 at 32, no accept cost.
def _synthetic(b: int) -> autogamma.BatchCosts:
  return autogamma.BatchCosts(b, {n: 10 + b / 2 * (n - 1) for n in (1, 2, 3, 5)},
                              1.0 if b <= 8 else 2.0)


# Loop step times measured in the loop (calibrate) at B = 1: gamma 4 is slow
# there, whatever its parts sum to.
SLOW4 = dataclasses.replace(_synthetic(1), t_step={1: 12.0, 2: 13.0, 4: 100.0})


def test_chooser_on_hand_checked_costs():
  a = A
  # B = 1: flat verify 10, 11, 12, 14; catch-up share alpha^gamma
  hand1 = {1: TOKENS[1] * 10 / ((1 + 0.8) * 1 + 10.5),
           2: TOKENS[2] * 10 / ((2 + 0.64) * 1 + 11),
           4: TOKENS[4] * 10 / ((4 + 0.4096) * 1 + 12)}
  # B = 8: T(n) = 10 + 4 (n - 1); catch-up share 1 - (1 - alpha^gamma)^8
  hand8 = {g: TOKENS[g] * 10 / ((g + 1 - (1 - a ** g) ** 8) * 1 + 10 + 4 * g) for g in (1, 2, 4)}
  # B = 32: T(n) = 10 + 16 (n - 1), T_draft 2
  hand32 = {g: TOKENS[g] * 10 / ((g + 1 - (1 - a ** g) ** 32) * 2 + 10 + 16 * g)
            for g in (1, 2, 4)}
  for b, hand, best in ((1, hand1, 4), (8, hand8, 2), (32, hand32, 1)):
    pred = autogamma.predicted_speedups(_synthetic(b), a, CHOOSER_SET)
    assert pred == pytest.approx(hand, rel=1e-12), b
    assert max(hand, key=hand.get) == best
    assert autogamma.choose(_synthetic(b), a, CHOOSER_SET) == best, b
  # the best gamma falls as B grows; a low alpha wants the shortest draft
  assert [autogamma.choose(_synthetic(b), a, CHOOSER_SET) for b in (1, 8, 32)] == [4, 2, 1]
  assert autogamma.choose(_synthetic(1), 0.1, CHOOSER_SET) == 1
  # with the tail effect (a finite run) the prediction is theory.batch_speedup
  tail = autogamma.predicted_speedups(_synthetic(8), a, CHOOSER_SET, n_tokens=31)
  assert tail[2] == pytest.approx(theory.batch_speedup(
      theory.geometric_accept_pmf(a, 2), 31, 8, 2, 10, 18, 1, 0, 1 - (1 - a ** 2) ** 8))
  # loop step times measured in the loop replace the sum of parts
  assert autogamma.choose(SLOW4, a, CHOOSER_SET) == 2
  assert autogamma.predicted_speedups(SLOW4, a, CHOOSER_SET)[1] == pytest.approx(
      TOKENS[1] * 10 / 12.0)
  # near the end of a run: one token left takes one step whatever gamma, so
  # the cheapest step wins where the steady state wants the longest draft
  assert autogamma.choose(_synthetic(1), a, CHOOSER_SET, n_tokens=1) == 1
  # fewer live rows than the costs' batch: the tail and catch-up of those rows
  one = autogamma.predicted_speedups(_synthetic(8), a, CHOOSER_SET, n_tokens=31, rows=1)
  assert one[2] == pytest.approx(theory.batch_speedup(
      theory.geometric_accept_pmf(a, 2), 31, 1, 2, 10, 18, 1, 0, a ** 2))
  assert autogamma.estimate_alpha(8, 2, 0.7, 8) == pytest.approx((8 + 5.6) / 18)


# ---------------------------------------------------------------- gap 1: calibration


def check_calibrated_tail_choice():
  """GammaChooser (the adaptive loop) always chooses tail-aware (n_tokens given): the
  calibrated step times must reach that choice too."""
  assert autogamma.choose(SLOW4, A, CHOOSER_SET) == 2
  assert autogamma.choose(SLOW4, A, CHOOSER_SET, n_tokens=31) == 2  # the sum of parts says 4
  assert autogamma.choose(_synthetic(1), A, CHOOSER_SET, n_tokens=31) == 4
  assert autogamma.predicted_speedups(SLOW4, A, CHOOSER_SET, n_tokens=31)[4] == pytest.approx(
      31 * 10 / (theory.expected_batch_steps(theory.geometric_accept_pmf(A, 4), 31, 1) * 100))
  # steady state and tail price a step alike: tail / steady is E[1 + k]'s
  # tail factor n / (E[max steps] E[1 + k]), whatever the step costs
  for c in (_synthetic(1), SLOW4, _synthetic(8), dataclasses.replace(
      _synthetic(8), t_step={1: 30.0, 2: 11.0, 4: 50.0})):
    steady = autogamma.predicted_speedups(c, A, CHOOSER_SET)
    tail = autogamma.predicted_speedups(c, A, CHOOSER_SET, n_tokens=31)
    for g in CHOOSER_SET:
      pmf = theory.geometric_accept_pmf(A, g)
      factor = 31 / (theory.expected_batch_steps(pmf, 31, c.batch) * TOKENS[g])
      assert tail[g] / steady[g] == pytest.approx(factor, rel=1e-9), (c.batch, c.t_step, g)
  # a long run at one row tends to the steady state
  long = autogamma.predicted_speedups(SLOW4, A, CHOOSER_SET, n_tokens=400)
  assert long == pytest.approx(autogamma.predicted_speedups(SLOW4, A, CHOOSER_SET), rel=0.01)


def test_calibrated_step_times_reach_the_tail_aware_choice():
  check_calibrated_tail_choice()


# ---------------------------------------------------------------- gap 3: catch-up


def check_catchup_charged_only_to_drafters_that_catch_up():
  """A drafter without catch-up: the predicted step is g T_draft + T(g+1) +
  T_accept, no catch-up term, steady state and tail."""
  assert [autogamma.catches_up(d) for d in ("model", "layerskip:0,2", "ngram", "ngram:2-3",
                                            "layerskip:2", "eagle")] == [True] * 2 + [False] * 4
  c = dataclasses.replace(_synthetic(8), t_accept={1: 0.5, 2: 0.5, 4: 0.5})
  for drafter in ("ngram", "layerskip:2"):
    pred = autogamma.predicted_speedups(c, A, CHOOSER_SET, drafter=drafter)
    assert pred == pytest.approx(
        {g: TOKENS[g] * 10 / (g * 1 + 10 + 4 * g + 0.5) for g in CHOOSER_SET}, rel=1e-12)
    tail = autogamma.predicted_speedups(c, A, CHOOSER_SET, n_tokens=31, drafter=drafter)
    assert tail[4] == pytest.approx(theory.batch_speedup(
        theory.geometric_accept_pmf(A, 4), 31, 8, 4, 10, 26, 1, 0.5, 0.0))
  # the draft model and a layer list with a cache of its own are charged
  for drafter in ("model", "layerskip:0,2"):
    pred = autogamma.predicted_speedups(c, A, CHOOSER_SET, drafter=drafter)
    assert pred[4] == pytest.approx(TOKENS[4] * 10 / ((4 + 1 - (1 - A ** 4) ** 8) + 26.5))


def test_catchup_is_charged_only_to_drafters_that_catch_up():
  check_catchup_charged_only_to_drafters_that_catch_up()


def test_catches_up_agrees_with_the_engine(init_params):
  """Every draft accepted (the `always` rule): a drafter that catches_up
  feeds d_gamma after every step but the last, one that does not never does
  (Drafted.caught_up, counted in n_catchup)."""
  cfg = config.get_preset("tiny").replace(name="tiny3", n_layers=3)
  target = steps.Runner(cfg, init_params(cfg, 1))
  for drafter in ("layerskip:2", "layerskip:0,2"):
    st = speculative.generate(target, None, [[5, 17, 42]], 9, 2, rule="always",
                              drafter=drafter).stats
    assert st.n_accept == st.n_drafted == 2 * st.n_steps, drafter
    assert st.n_catchup == ((st.n_steps - 1) if autogamma.catches_up(drafter) else 0), drafter


# ---------------------------------------------------------------- gap 2: an auto run's alpha


def _records(n_acc, gammas):
  """One row's records: every step drafted its gamma; `gammas` None: no per-step gamma."""
  k = np.asarray(n_acc, np.int64)
  g = None if gammas is None else np.asarray(gammas, np.int64)
  return stats.Records(n_acc=k, n_drafted=k * 0 + (g if g is not None else 8), kept=k + 1,
                       caught_up=k * 0, step=np.arange(k.size), row=k * 0, gamma=g)


def check_auto_alpha_from_each_steps_gamma():
  # every draft accepted at gamma 1: alpha 1, not the 0.5 that gamma 8 reads it as
  st = stats.SpecStats.compute(_records([1] * 40, [1] * 40), gamma=8, n_predict=81)
  assert st.alpha == 1.0 and st.tokens_per_step == 2.0 and st.mean_accepted == 1.0
  # the capped geometric law at 0.7 over steps of gamma 1, 2, 4 and 8
  rng = np.random.default_rng(0)
  g = rng.choice([1, 2, 4, 8], size=20000, p=[0.4, 0.3, 0.2, 0.1])
  k = np.minimum(rng.geometric(0.3, size=g.size) - 1, g)  # failures before the first miss
  st = stats.SpecStats.compute(_records(k, g), gamma=8, n_predict=int((k + 1).sum()) + 1)
  assert st.alpha == pytest.approx(0.7, abs=0.01)
  assert st.n_accept == k.sum() and st.accept_hist == np.bincount(k, minlength=9).tolist()
  # one gamma: the same estimate as a fixed-gamma run
  k4 = np.minimum(rng.geometric(0.4, size=500) - 1, 4)
  want = stats.SpecStats.compute(_records(k4, None), gamma=4, n_predict=0).alpha
  assert theory.alpha_from_accepted_steps(int(k4.sum()), [4] * k4.size) == pytest.approx(
      want, abs=1e-12)
  assert stats.SpecStats.compute(_records(k4, [4] * k4.size), gamma=4,
                                 n_predict=0).alpha == pytest.approx(want, abs=1e-12)


def test_auto_run_alpha_counts_each_steps_own_gamma():
  check_auto_alpha_from_each_steps_gamma()
  # the old reading (every step at the largest gamma) is biased low
  old = stats.SpecStats.compute(_records([1] * 40, None), gamma=8, n_predict=81)
  assert old.alpha < 0.55
  # pooled runs keep their steps' gammas; a mix of kinds is refused
  a, b = _records([1, 0], [1, 2]), _records([2], [4])
  assert stats.Records.concat([a, b]).gamma.tolist() == [1, 2, 4]
  assert stats.Records.concat([_records([1], None)] * 2).gamma is None
  with pytest.raises(ValueError, match="gamma"):
    stats.Records.concat([a, _records([1], None)])
  with pytest.raises(ValueError, match="gamma"):
    stats.SpecStats.compute(b, gamma=2, n_predict=3)
  assert theory.alpha_from_accepted_steps(0, [1, 2]) == 0.0
  assert theory.alpha_from_accepted_steps(3, [1, 2]) == 1.0
  assert theory.alpha_from_accepted_steps(0, []) == 0.0


# ---------------------------------------------------------------- the deliberate bugs


def _tail_ignores_t_step(orig):
  """The code before the fix: the tail-aware branch summed the parts."""
  def predicted_speedups(c, alpha, gammas, n_tokens=None, rows=None, drafter="model"):
    if n_tokens is None:
      return orig(c, alpha, gammas, n_tokens, rows, drafter)
    return orig(dataclasses.replace(c, t_step={}), alpha, gammas, n_tokens, rows, drafter)
  return predicted_speedups


def _alpha_at_largest_gamma(orig):
  """The code before the fix: every step read as the largest gamma of the run."""
  del orig
  return lambda n_accept, gammas: float(theory.alpha_from_mean_accepted(
      n_accept / len(gammas), int(max(gammas))))


MUTATIONS = {
    "tail-aware choice ignores the calibrated step": (
        autogamma, "predicted_speedups", _tail_ignores_t_step, check_calibrated_tail_choice),
    "catch-up charged to every drafter": (
        autogamma, "catches_up", lambda orig: lambda d: True,
        check_catchup_charged_only_to_drafters_that_catch_up),
    "an auto run's alpha at its largest gamma": (
        theory, "alpha_from_accepted_steps", _alpha_at_largest_gamma,
        check_auto_alpha_from_each_steps_gamma),
}


@pytest.mark.parametrize("bug", list(MUTATIONS))
def test_each_deliberate_bug_fails_its_check(monkeypatch, bug):
  module, name, make, check = MUTATIONS[bug]
  monkeypatch.setattr(module, name, make(getattr(module, name)))
  with pytest.raises(AssertionError):
    check()
