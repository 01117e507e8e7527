"""Tests for specjax.metrics.theory: published numbers first, then properties.

Published numbers come from Leviathan et al. 2023 (Table 1, Theorems 3.8,
3.11, Corollary 3.9) and llama.cpp issue #3649; the expected values are typed
in from those sources or recomputed here with the sources' own closed forms.
"""

import math

import numpy as np
import pytest

from specjax.metrics import llamacpp_thread
from specjax.metrics import theory
from specjax.errors import SpecjaxError

ALPHAS = np.linspace(0.0, 0.99, 34)
GAMMAS = range(0, 13)


def paper_speedup(alpha: float, gamma: int, c: float) -> float:
  """Theorem 3.8 typed in as printed (closed form, alpha < 1 only)."""
  return (1 - alpha ** (gamma + 1)) / ((1 - alpha) * (gamma * c + 1))


def thread_expectation(n: int, p: float) -> float:
  """ggerganov's expect.py from llama.cpp #3649, verbatim loop."""
  e = 0.0
  for i in range(n):
    e += i * p**i * (1 - p)
  return e + n * p**n


# --- Published numbers -------------------------------------------------------


def test_thread_corrected_plugin_is_1_14x():
  # ggerganov's correction: (1-0.44^6)/[(1-0.44)*(0.11*5+1)] = 1.14x.
  speedup = theory.leviathan_speedup(0.44, 5, 0.11)
  assert round(speedup, 2) == 1.14
  assert speedup == pytest.approx(paper_speedup(0.44, 5, 0.11), rel=1e-14)


@pytest.mark.parametrize(
    "alpha, gamma, sd_tg, st_tg, st_pp, printed",
    [
        (0.80, 5, 619.4, 52.5, 121.7, 2.1594861448542773),
        (0.875, 8, 625.0, 52.5, 194.6, 2.7629832057356403),
    ],
)
def test_thread_v100_predictions(alpha, gamma, sd_tg, st_tg, st_pp, printed):
  got = llamacpp_thread.thread_approx_speedup(alpha, gamma, sd_tg, st_tg, st_pp)
  assert got == pytest.approx(printed, rel=1e-13)


def test_thread_cost_coefficient_is_mean_of_speeds():
  assert llamacpp_thread.thread_cost_coefficient(619.4, 52.5, 121.7) == pytest.approx(
      52.5 / 370.55, rel=1e-14)


def test_thread_expect_script_n8_p095():
  # "$ python3 expect.py 8 0.95  ->  E = 6.4 ( 79.94 % )"
  e = theory.expected_accepted(8, 0.95)
  assert round(e, 2) == 6.4
  assert round(100 * (e / 8), 2) == 79.94


def test_thread_70b_7b_expected_speed():
  # 119 tokens at 14.68 t/s and 426 at ~19.86 t/s, n_predict = 503: ~17.02 t/s.
  assert round(llamacpp_thread.mixed_speed(503, [(119, 14.68), (426, 19.86)]), 2) == 17.02
  assert llamacpp_thread.mixed_speed(503, [(119, 14.68), (426, 19.86)]) == pytest.approx(
      503 / (119 / 14.68 + 426 / 19.86), rel=1e-14)
  # The ~19.86 t/s is drafting at 90.20 t/s then verifying at ~25.48 t/s.
  assert llamacpp_thread.serial_speed(90.20, 25.48) == pytest.approx(19.86, abs=0.01)
  full = llamacpp_thread.thread_expected_speed(
      n_predict=503, n_accept=384, n_drafted=426,
      tg_target=14.68, tg_draft=90.20, pp_target=25.48)
  assert round(full, 2) == 17.02


@pytest.mark.parametrize(
    "alpha, gamma, operations, speed",
    [(0.6, 2, 1.53, 1.96), (0.7, 3, 1.58, 2.53), (0.8, 2, 1.23, 2.44),
     (0.8, 5, 1.63, 3.69), (0.9, 2, 1.11, 2.71), (0.9, 10, 1.60, 6.86)],
)
def test_leviathan_table_1(alpha, gamma, operations, speed):
  # Table 1 of Leviathan et al. assumes c = c_hat = 0.
  assert round(theory.leviathan_speedup(alpha, gamma, 0.0), 2) == speed
  assert round(theory.operations_factor(alpha, gamma, 0.0), 2) == operations


def test_operations_factor_matches_theorem_3_11_closed_form():
  for alpha in (0.3, 0.6, 0.95):
    for gamma, c_hat in ((1, 0.0), (4, 0.02), (9, 0.3)):
      closed = (1 - alpha) * (gamma * c_hat + gamma + 1) / (1 - alpha ** (gamma + 1))
      assert theory.operations_factor(alpha, gamma, c_hat) == pytest.approx(closed, rel=1e-13)


# --- Tokens per step and acceptance ------------------------------------------


def test_tokens_per_step_matches_equation_1_away_from_one():
  for gamma in GAMMAS:
    closed = (1 - ALPHAS ** (gamma + 1)) / (1 - ALPHAS)
    np.testing.assert_allclose(theory.expected_tokens_per_step(ALPHAS, gamma), closed, rtol=1e-12)


@pytest.mark.parametrize("gamma", [0, 1, 5, 16, 64])
def test_tokens_per_step_continuous_at_alpha_one(gamma):
  assert theory.expected_tokens_per_step(1.0, gamma) == gamma + 1
  near = theory.expected_tokens_per_step(1 - 1e-12, gamma)
  assert near == pytest.approx(gamma + 1, rel=1e-9)
  assert near <= gamma + 1
  # The naive closed form loses about five digits here; the sum does not.
  assert near == pytest.approx(gamma + 1 - 1e-12 * gamma * (gamma + 1) / 2, abs=1e-13)


def test_tokens_per_step_broadcasts_and_returns_floats():
  out = theory.expected_tokens_per_step(np.array([0.0, 0.5, 1.0]), np.array([[0], [3]]))
  np.testing.assert_allclose(out, [[1, 1, 1], [1, 1.875, 4]])
  assert isinstance(theory.expected_tokens_per_step(0.5, 3), float)
  assert isinstance(theory.leviathan_speedup(0.5, 3, 0.1), float)


def test_expected_accepted_is_thread_loop_and_tokens_minus_one():
  for n in range(0, 11):
    for p in (0.0, 0.2, 0.44, 0.8, 0.95, 1.0):
      want = thread_expectation(n, p)
      assert theory.expected_accepted(n, p) == pytest.approx(want, abs=1e-12)
      assert theory.expected_accepted(n, p) == pytest.approx(
          theory.expected_tokens_per_step(p, n) - 1, abs=1e-12)


def test_geometric_pmf_sums_to_one_and_has_the_thread_table():
  pmf = theory.geometric_accept_pmf(0.95, 8)
  assert pmf.shape == (9,)
  assert pmf.sum() == pytest.approx(1.0, abs=1e-14)
  assert pmf[0] == pytest.approx(0.05)
  assert pmf[3] == pytest.approx(0.05 * 0.95**3)
  assert pmf[8] == pytest.approx(0.95**8)
  grid = theory.geometric_accept_pmf(ALPHAS, 6)
  assert grid.shape == (ALPHAS.size, 7)
  np.testing.assert_allclose(grid.sum(axis=-1), 1.0, atol=1e-14)
  np.testing.assert_allclose(grid @ np.arange(7), theory.expected_accepted(6, ALPHAS), atol=1e-14)


def test_geometric_pmf_matches_sequential_bernoulli_simulation():
  rng = np.random.default_rng(0)
  alpha, gamma, n = 0.7, 5, 200_000
  accepted = np.cumprod(rng.random((n, gamma)) < alpha, axis=1).sum(axis=1)
  hist = np.bincount(accepted, minlength=gamma + 1) / n
  pmf = theory.geometric_accept_pmf(alpha, gamma)
  np.testing.assert_allclose(hist, pmf, atol=4 * np.sqrt(0.25 / n))


def test_expected_accepted_fraction_is_the_threads_count():
  # i_dft < F*N: N=8, F=0.8 accepts 7 (the thread's 87.5 %); N=5 accepts 4.
  assert theory.expected_accepted_fraction(5, 0.8) == 4
  assert theory.expected_accepted_fraction(8, 0.8) == 7
  assert sum(i < 0.8 * 8 for i in range(8)) == 7
  assert theory.expected_accepted_fraction(100, 0.29) == 29
  assert theory.expected_accepted_fraction(8, 1.0) == 8
  assert theory.expected_accepted_fraction(8, 0.0) == 0


def test_alpha_from_mean_accepted_inverts_expected_accepted():
  for gamma in (1, 2, 5, 8, 16):
    alphas = np.linspace(0.0, 1.0, 41)
    means = theory.expected_accepted(gamma, alphas)
    np.testing.assert_allclose(theory.alpha_from_mean_accepted(means, gamma), alphas, atol=1e-9)


def test_alpha_from_mean_accepted_edges():
  assert theory.alpha_from_mean_accepted(0.0, 5) == 0.0
  assert theory.alpha_from_mean_accepted(5.0, 5) == 1.0
  assert theory.alpha_from_mean_accepted(7.0, 5) == 1.0
  # E = 6.4 for N = 8 came from p = 0.95 in the thread.
  assert theory.alpha_from_mean_accepted(theory.expected_accepted(8, 0.95), 8) == pytest.approx(0.95)
  with pytest.raises(SpecjaxError):
    theory.alpha_from_mean_accepted(-0.5, 5)
  with pytest.raises(SpecjaxError):
    theory.alpha_from_mean_accepted(1.0, 0)


# --- Choosing gamma and Corollary 3.9 -----------------------------------------


def test_optimal_gamma_is_the_brute_force_argmax():
  for alpha in (0.3, 0.5, 0.7, 0.8, 0.9, 0.95):
    for c in (0.0, 0.01, 0.05, 0.1, 0.3):
      speeds = [paper_speedup(alpha, g, c) for g in range(1, 33)]
      want = 1 + int(np.argmax(speeds))
      got = theory.optimal_gamma(alpha, c, max_gamma=32)
      assert got == want, (alpha, c)
      assert isinstance(got, int)


def test_optimal_gamma_known_values_and_broadcast():
  # c = 0 and alpha < 1: more drafting never hurts, so the cap wins.
  assert theory.optimal_gamma(0.8, 0.0, max_gamma=10) == 10
  assert theory.optimal_gamma(0.1, 0.2) == 1
  # alpha = 0.8, c = 0.05: gamma 7, 8, 9 give 3.0823, 3.0921, 3.0780.
  assert theory.optimal_gamma(0.8, 0.05) == 8
  # alpha = 0.8, c = 0.2: gamma 3, 4, 5 give 1.8450, 1.8676, 1.8446.
  grid = theory.optimal_gamma(np.array([0.3, 0.8]), np.array([[0.05], [0.2]]))
  assert grid.shape == (2, 2)
  np.testing.assert_array_equal(grid[:, 1], [8, 4])


def test_corollary_3_9():
  for alpha in np.linspace(0.0, 1.0, 21):
    for c in (0.0, 0.05, 0.2, 0.5, 0.9):
      bound = theory.min_speedup_gamma1(alpha, c)
      assert bound == pytest.approx(theory.leviathan_speedup(alpha, 1, c), rel=1e-14)
      best = theory.leviathan_speedup(alpha, theory.optimal_gamma(alpha, c), c)
      assert best >= bound - 1e-12
      assert theory.speedup_possible(alpha, c) == (alpha > c)
      assert (best > 1.0 + 1e-12) == (alpha > c + 1e-12), (alpha, c)
  assert theory.min_speedup_gamma1(0.8, 0.05) == pytest.approx(1.8 / 1.05)


def test_operations_factor_at_least_one():
  g = np.arange(0, 20)[:, None]
  assert np.all(np.asarray(theory.operations_factor(ALPHAS, g, 0.0)) >= 1 - 1e-12)
  assert theory.operations_factor(1.0, 4, 0.1) == pytest.approx((0.4 + 5) / 5)


# --- Measured-cost model -----------------------------------------------------


def test_measured_cost_reduces_to_theorem_3_8():
  t_target, t_draft = 0.020, 0.0025
  for alpha in (0.0, 0.44, 0.8, 1.0):
    for gamma in (1, 5, 8):
      got = theory.measured_cost_speedup_at_alpha(alpha, gamma, t_draft, t_target, t_target)
      want = theory.leviathan_speedup(alpha, gamma, t_draft / t_target)
      assert got == pytest.approx(want, rel=1e-13)


def test_measured_cost_speedup_by_hand():
  # 3.2 tokens per step, 5 drafts at 2 ms, target 20 ms, verify 30 ms, 1 ms overhead.
  got = theory.measured_cost_speedup(3.2, 5, 0.002, 0.020, 0.030, t_overhead=0.001)
  assert got == pytest.approx(3.2 * 0.020 / (5 * 0.002 + 0.030 + 0.001), rel=1e-14)
  assert got == pytest.approx(1.5609756097560976, rel=1e-14)


def test_verify_time_from_curve_interpolates():
  curve = {1: 0.020, 4: 0.026, 8: 0.034}
  assert theory.verify_time_from_curve(curve, 1) == pytest.approx(0.020)
  assert theory.verify_time_from_curve(curve, 6) == pytest.approx(0.030)
  assert theory.verify_time_from_curve(([8, 1, 4], [0.034, 0.020, 0.026]), 2) == pytest.approx(0.022)
  np.testing.assert_allclose(theory.verify_time_from_curve(curve, [2, 5]), [0.022, 0.028])
  with pytest.raises(SpecjaxError):
    theory.verify_time_from_curve(curve, 9)
  with pytest.raises(SpecjaxError):
    theory.verify_time_from_curve({}, 1)


def test_speedup_from_curve_uses_t1_and_t_gamma_plus_one():
  curve = {1: 0.020, 4: 0.026, 8: 0.034}
  alpha, gamma, t_draft = 0.8, 5, 0.002
  tokens = (1 - 0.8**6) / 0.2
  want = tokens * 0.020 / (5 * 0.002 + 0.030 + 0.0005)
  got = theory.speedup_from_curve(alpha, gamma, t_draft, curve, t_overhead=0.0005)
  assert got == pytest.approx(want, rel=1e-13)


def test_speedup_from_llama_bench_v100_curve():
  # The thread's V100 llama-bench: target pp n in t/s, so T(n) = n / speed.
  pp = {1: 30.72, 2: 51.22, 3: 75.92, 4: 101.66, 5: 121.74, 6: 146.37, 7: 163.65, 8: 194.58}
  curve = {n: n / s for n, s in pp.items()}
  t_draft = 1 / 619.43
  got = theory.speedup_from_curve(0.8, 5, t_draft, curve)
  want = ((1 - 0.8**6) / 0.2) * (1 / 30.72) / (5 / 619.43 + 6 / 146.37)
  assert got == pytest.approx(want, rel=1e-13)


# --- Validation ----------------------------------------------------------------


@pytest.mark.parametrize(
    "call",
    [
        lambda: theory.expected_tokens_per_step(1.5, 3),
        lambda: theory.expected_tokens_per_step(0.5, 2.5),
        lambda: theory.expected_tokens_per_step(0.5, -1),
        lambda: theory.leviathan_speedup(0.5, 3, -0.1),
        lambda: theory.optimal_gamma(0.5, 0.1, max_gamma=0),
        lambda: theory.measured_cost_speedup(2.0, 3, 0.001, 0.0, 0.01),
        lambda: theory.geometric_accept_pmf(float("nan"), 3),
    ],
)
def test_bad_inputs_raise_specjax_error(call):
  with pytest.raises(SpecjaxError):
    call()


def test_specjax_error_is_a_value_error():
  assert issubclass(SpecjaxError, ValueError)
  assert math.isfinite(theory.leviathan_speedup(0.0, 0, 0.0))


def test_geometric_check_accepts_the_law_and_rejects_all_or_nothing():
  from specjax.metrics.stats import SpecStats, geometric_check
  def stats(hist, alpha):
    g = len(hist) - 1
    return SpecStats(gamma=g, n_predict=0, n_drafted=0, n_accept=0, n_steps=sum(hist),
                     n_kept=0, n_catchup=0, accept_rate=0.0, tokens_per_step=0.0,
                     mean_accepted=0.0, alpha=alpha, accept_hist=hist,
                     alpha_at_pos=[None] * g)
  law = theory.geometric_accept_pmf(0.6, 4)
  good = geometric_check(stats([int(round(10000 * x)) for x in law], 0.6))
  assert good["tv"] < 1e-3 and good["p"] > 0.5
  bad = geometric_check(stats([4000, 0, 0, 0, 6000], 0.6))
  assert bad["tv"] > 0.3 and bad["p"] < 1e-10


def test_paper_outputs_reproduce_the_published_numbers(tmp_path):
  from specjax.bench.studies import paper  # pylint: disable=import-outside-toplevel
  summary = paper.write_outputs(str(tmp_path), 6)
  for printed in ("2.1594861448542773", "2.7629832057356403", "| 0.8 | 5 | 1.63× |"):
    assert printed in summary, printed
  assert "3.6893×" in summary  # Table 1, alpha 0.8, gamma 5 (the paper: 3.69x)
  rows = (tmp_path / "results.csv").read_text().splitlines()
  assert len(rows) == 1 + len(paper.PLOT_CS) * len(paper.ALPHAS) * 6
  for name in ("speedup_vs_gamma.png", "optimal_gamma_vs_alpha.png", "config.json",
               "results.jsonl", "summary.md"):
    assert (tmp_path / name).stat().st_size > 0, name
  with pytest.raises(SpecjaxError, match="max_gamma"):
    paper.write_outputs(str(tmp_path), 0)
