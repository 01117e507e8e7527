"""Closed-form models of speculative decoding, each formula defined once.

Sources:
  [L23] Leviathan, Kalman, Matias, "Fast Inference from Transformers via
        Speculative Decoding", ICML 2023 (arXiv:2211.17192).
  [T3649] llama.cpp issue #3649, "Speculative Decoding is slower than expected
        on A100" (Oct 2023): the corrected Theorem 3.8 plug-in, ggerganov's V100
        approximation, the E[X] script, and the 70B/7B speed accounting.

Symbols: alpha is the per-token acceptance probability under the i.i.d.
assumption of [L23] Section 3.1 (not llama.cpp's `accept` = n_accept /
n_drafted); gamma (= n_draft) is the number of drafted tokens per step; c is
T_draft(1) / T_target(1) ([L23] Definition 3.7). Pure numpy: functions
broadcast over arrays where marked, and return a float for scalar inputs.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Union

import numpy as np

from specjax.errors import SpecjaxError

ArrayLike = Union[float, int, np.ndarray, Sequence[float]]
# A measured T_target(n) curve: {n: seconds} or a pair (ns, seconds).
Curve = Union[Mapping[int, float], tuple[Sequence[float], Sequence[float]]]

_BISECTION_STEPS = 64  # 2**-64 < float64 spacing near 1, so the result is converged.


def _out(x: np.ndarray) -> float | np.ndarray:
  """A Python float for 0-d results, the array otherwise."""
  return float(x) if np.ndim(x) == 0 else x


def _probability(x: ArrayLike, name: str) -> np.ndarray:
  arr = np.asarray(x, dtype=float)
  if np.any(~((arr >= 0.0) & (arr <= 1.0))):
    raise SpecjaxError(f"{name} must be a probability in [0, 1], got {x!r}")
  return arr


def _draft_length(gamma: ArrayLike, minimum: int = 0) -> np.ndarray:
  arr = np.asarray(gamma)
  if np.any(arr != np.floor(arr)) or np.any(arr < minimum):
    raise SpecjaxError(f"gamma must be an integer >= {minimum}, got {gamma!r}")
  return arr.astype(np.int64)


def _non_negative(x: ArrayLike, name: str) -> np.ndarray:
  arr = np.asarray(x, dtype=float)
  if np.any(~(arr >= 0.0)):
    raise SpecjaxError(f"{name} must be >= 0, got {x!r}")
  return arr


def _positive(x: ArrayLike, name: str) -> np.ndarray:
  arr = np.asarray(x, dtype=float)
  if np.any(~(arr > 0.0)):
    raise SpecjaxError(f"{name} must be > 0, got {x!r}")
  return arr


# --- Tokens per step and acceptance counts ----------------------------------


def expected_tokens_per_step(alpha: ArrayLike, gamma: ArrayLike) -> float | np.ndarray:
  """Expected tokens emitted per speculative step: [L23] Section 3.1, Equation (1).

  E[# generated tokens] = (1 - alpha^(gamma+1)) / (1 - alpha), the mean of a
  geometric variable capped at gamma + 1 (the accepted drafts plus the one
  correction or bonus token sampled from the target).

  Evaluated as the equal sum alpha^0 + .. + alpha^gamma (alpha in [0, 1],
  gamma >= 0), which has no 0/0 at alpha = 1 (exactly gamma + 1) and no
  cancellation near it; in [1, gamma + 1]. Broadcasts over alpha and gamma.
  """
  a = _probability(alpha, "alpha")
  g = _draft_length(gamma)
  i = np.arange(int(g.max(initial=0)) + 1)
  powers = np.where(i <= g[..., None], a[..., None] ** i, 0.0)
  return _out(powers.sum(axis=-1))


def geometric_accept_pmf(alpha: ArrayLike, gamma: int) -> np.ndarray:
  """P(accepted = k) for k = 0..gamma: the capped geometric law of [L23] Section 3.1.

  With i.i.d. acceptance probability alpha, the first rejection ends the step:
  P(k) = alpha^k (1 - alpha) for k < gamma, and P(gamma) = alpha^gamma. This is
  the table in ggerganov's E[X] script in [T3649] and what a measured
  accepted-length histogram is compared against. Returns alpha.shape +
  (gamma + 1,), summing to 1 on the last axis (gamma: a scalar).
  """
  a = _probability(alpha, "alpha")[..., None]
  g = int(_draft_length(gamma))
  k = np.arange(g + 1)
  return np.where(k < g, a**k * (1.0 - a), a**k)


def expected_accepted(n_draft: int, p: ArrayLike) -> float | np.ndarray:
  """Expected accepted drafts per step, E[X]: ggerganov's script in [T3649].

  E[X] = sum_{i<N} i p^i (1-p) + N p^N for N = n_draft drafts accepted one by
  one with probability p until the first rejection. It is the mean of
  `geometric_accept_pmf(p, N)` and equals expected_tokens_per_step(p, N) - 1.
  The argument order (N, p) follows the thread's `expect.py N p`; in [0, N].
  """
  pmf = geometric_accept_pmf(p, n_draft)
  return _out(pmf @ np.arange(pmf.shape[-1], dtype=float))


def expected_accepted_fraction(n_draft: ArrayLike, f: ArrayLike) -> float | np.ndarray:
  """Accepted drafts per step under the deterministic `fraction:F` simulation.

  ggerganov's patch in [T3649] accepts drafted position i (0-based) while
  `i_dft < F*N`, i.e. the first ceil(F * N) of N drafts every step. That is
  the count behind the thread's 87.5 % for N = 8, F = 0.8 (7 of 8), so it is
  the definition used here and by `specjax.decode.acceptance` (not floor(F * N),
  which gives 6). Returns ceil(F * N) as a float (a tiny tolerance keeps
  0.8 * 5 at 4).
  """
  n = _draft_length(n_draft)
  frac = _probability(f, "f")
  return _out(np.ceil(frac * n - 1e-9).astype(float))


def alpha_from_mean_accepted(mean_accepted: ArrayLike, gamma: int) -> float | np.ndarray:
  """The alpha whose E[X] for draft length gamma equals a measured mean.

  Inverts `expected_accepted(gamma, alpha)`, which increases strictly with
  alpha, by bisection on [0, 1]. This is an ESTIMATE of [L23]'s alpha under
  the i.i.d. assumption of Section 3.1; with position-dependent acceptance it
  is only the i.i.d. alpha that reproduces the same mean. Use
  mean_accepted = n_accept / n_steps (not llama.cpp's n_accept / n_drafted).
  Returns alpha in [0, 1]: 0.0 at mean 0, 1.0 when the mean is >= gamma.
  """
  target = _non_negative(mean_accepted, "mean_accepted")
  g = int(_draft_length(gamma, minimum=1))
  lo, hi = np.zeros_like(target), np.ones_like(target)
  for _ in range(_BISECTION_STEPS):
    mid = 0.5 * (lo + hi)
    below = np.asarray(expected_accepted(g, mid)) < target
    lo, hi = np.where(below, mid, lo), np.where(below, hi, mid)
  alpha = np.where(target >= g, 1.0, np.where(target <= 0.0, 0.0, 0.5 * (lo + hi)))
  return _out(alpha)


def alpha_from_accepted_steps(n_accept: int, gammas: ArrayLike) -> float:
  """The alpha whose expected accepted total over steps of draft lengths
  `gammas` (one per step, mixed: gamma chosen at run time) equals n_accept.

  Solves sum_s E[X | gamma_s, alpha] = n_accept by bisection (the sum
  increases strictly with alpha): alpha_from_mean_accepted's estimate when
  the steps differ in gamma. Charging every step the largest gamma instead
  would count drafts that steps at a smaller gamma never proposed, and bias
  alpha low (every draft accepted at gamma 1 reads as alpha 0.5 at gamma 8).
  With one gamma it equals alpha_from_mean_accepted(n_accept / steps, gamma).

  Returns:
    alpha in [0, 1]: 0.0 at n_accept 0 or no steps, 1.0 when n_accept >= sum gammas.
  """
  g = _draft_length(np.asarray(gammas).ravel(), minimum=1)
  target = float(_non_negative(n_accept, "n_accept"))
  if g.size == 0 or target <= 0.0:
    return 0.0
  if target >= g.sum():
    return 1.0
  counts = np.bincount(g)
  used = np.nonzero(counts)[0]
  total = lambda a: sum(counts[k] * expected_accepted(int(k), a) for k in used)
  lo, hi = 0.0, 1.0
  for _ in range(_BISECTION_STEPS):
    mid = 0.5 * (lo + hi)
    lo, hi = (mid, hi) if total(mid) < target else (lo, mid)
  return 0.5 * (lo + hi)


# --- Leviathan et al. walltime and operations -------------------------------


def leviathan_speedup(alpha: ArrayLike, gamma: ArrayLike, c: ArrayLike) -> float | np.ndarray:
  """Expected walltime improvement factor: [L23] Theorem 3.8.

  (1 - alpha^(gamma+1)) / ((1 - alpha)(gamma c + 1)): Equation (1) tokens per
  step over a step cost of gamma draft calls plus ONE target call. It assumes
  verifying gamma + 1 tokens costs the same as decoding one, which [T3649]
  found false in llama.cpp; `measured_cost_speedup` drops that assumption.
  Broadcasts over all arguments.

  Args:
    alpha: per-token acceptance probability in [0, 1].
    gamma: draft length, an integer >= 0.
    c: cost coefficient T_draft(1) / T_target(1), >= 0 (Definition 3.7).
  """
  c = _non_negative(c, "c")
  return _out(np.asarray(expected_tokens_per_step(alpha, gamma)) / (np.asarray(gamma) * c + 1.0))


def optimal_gamma(alpha: ArrayLike, c: ArrayLike, max_gamma: int = 64) -> int | np.ndarray:
  """The integer gamma in [1, max_gamma] maximising Theorem 3.8: [L23] Section 3.5.

  "Since gamma is an integer, it can be easily found numerically" ([L23]
  Figure 3 plots it against alpha for several c). Ties go to the smaller
  gamma. When alpha <= c even the optimum is below 1 (see
  `speedup_possible`). Broadcasts over alpha and c.

  Returns:
    An int for scalar inputs, an integer array otherwise.
  """
  g_max = int(_draft_length(max_gamma, minimum=1))
  gammas = np.arange(1, g_max + 1)
  a = np.asarray(alpha, dtype=float)[..., None]
  cc = np.asarray(c, dtype=float)[..., None]
  best = np.argmax(np.asarray(leviathan_speedup(a, gammas, cc)), axis=-1) + 1
  return int(best) if best.ndim == 0 else best


def speedup_possible(alpha: ArrayLike, c: ArrayLike) -> bool | np.ndarray:
  """Whether some gamma >= 1 gives a walltime improvement: [L23] Corollary 3.9.

  Corollary 3.9: if alpha > c there is a gamma with an improvement. Its proof
  (an improvement at gamma implies one at every smaller gamma >= 1) also gives
  the converse, so this is exactly "alpha > c".
  """
  result = _probability(alpha, "alpha") > _non_negative(c, "c")
  return bool(result) if result.ndim == 0 else result


def min_speedup_gamma1(alpha: ArrayLike, c: ArrayLike) -> float | np.ndarray:
  """Lower bound on the best improvement when alpha > c: [L23] Corollary 3.9.

  (1 + alpha) / (1 + c), which is Theorem 3.8 at gamma = 1; the optimal gamma
  does at least this well.
  """
  a = _probability(alpha, "alpha")
  return _out((1.0 + a) / (1.0 + _non_negative(c, "c")))


def operations_factor(alpha: ArrayLike, gamma: ArrayLike, c_hat: ArrayLike) -> float | np.ndarray:
  """Expected factor of increase in total arithmetic operations: [L23] Theorem 3.11.

  (1 - alpha)(gamma c_hat + gamma + 1) / (1 - alpha^(gamma+1)): a step costs
  gamma draft runs plus gamma + 1 parallel target runs, divided by Equation (1)
  tokens per step. Broadcasts over all arguments.

  Args:
    alpha: per-token acceptance probability in [0, 1].
    gamma: draft length, an integer >= 0.
    c_hat: arithmetic operations per token of the draft over those of the
      target, >= 0 (Definition 3.10).
  """
  g = np.asarray(gamma)
  ops_per_step = g * _non_negative(c_hat, "c_hat") + g + 1.0
  return _out(ops_per_step / np.asarray(expected_tokens_per_step(alpha, gamma)))


# --- Measured-cost model -----------------------------------------------------


def measured_cost_speedup(
    tokens_per_step: ArrayLike,
    gamma: ArrayLike,
    t_draft: ArrayLike,
    t_target: ArrayLike,
    t_verify: ArrayLike,
    t_overhead: ArrayLike = 0.0,
) -> float | np.ndarray:
  """Predicted speedup from measured costs (this project's model).

  speedup = tokens_per_step * T_target(1) / (gamma T_draft(1) + T_target(gamma+1) + overhead)

  The proof of [L23] Theorem 3.8 with its step cost gamma T c + T replaced by
  measured times; ggerganov's observation in [T3649] that T_target(N) lies
  between T_target(1) and N T_target(1) is why T_target(gamma+1) is measured
  rather than assumed equal to T_target(1). With t_verify = t_target and no
  overhead it is Theorem 3.8 with c = t_draft / t_target. Any time unit works
  if all four times share it. Broadcasts over all arguments: tokens_per_step
  (accepted drafts plus the correction or bonus, e.g. n_predict / n_steps),
  t_draft = T_draft(1), t_target = T_target(1), t_verify = T_target(gamma+1),
  t_overhead (sampling, acceptance, host sync).
  """
  step_time = (
      np.asarray(gamma) * _non_negative(t_draft, "t_draft")
      + _positive(t_verify, "t_verify")
      + _non_negative(t_overhead, "t_overhead")
  )
  return _out(np.asarray(tokens_per_step, dtype=float) * _positive(t_target, "t_target") / step_time)


def measured_cost_speedup_at_alpha(alpha: ArrayLike, gamma: ArrayLike, t_draft: ArrayLike,
                                   t_target: ArrayLike, t_verify: ArrayLike,
                                   t_overhead: ArrayLike = 0.0) -> float | np.ndarray:
  """`measured_cost_speedup` with Equation (1) tokens per step at this alpha."""
  tokens = expected_tokens_per_step(alpha, gamma)
  return measured_cost_speedup(tokens, gamma, t_draft, t_target, t_verify, t_overhead)


# --- Batches: the slowest row sets the number of steps -----------------------


def accept_pmf_from_position_probs(probs: Sequence[float]) -> np.ndarray:
  """P(accepted = k), k = 0..gamma, when draft position i (0-based) is
  accepted with probability probs[i] until the first miss (the simulated
  rules' acceptance.position_probs; bernoulli:P gives the capped geometric)."""
  p = np.asarray(probs, float)
  reach = np.concatenate([[1.0], np.cumprod(p)])   # P(accepted >= k)
  return reach - np.concatenate([reach[1:], [0.0]])


def steps_cdf(accept_pmf: Sequence[float], n_tokens: int) -> np.ndarray:
  """P(S <= s) for s = 0..n_tokens, S the steps one row needs to emit
  n_tokens tokens when every step emits 1 + k, k ~ accept_pmf (independent
  steps); the last step may overshoot (the engine cuts it). Exact, by the
  distribution of the emitted total capped at n_tokens (absorbing)."""
  pmf = np.asarray(accept_pmf, float)
  n = int(n_tokens)
  if n < 0:
    raise SpecjaxError(f"n_tokens must be >= 0, got {n_tokens!r}")
  if n == 0:
    return np.ones(1)
  # one step as a matrix on the emitted total (n absorbing)
  step = np.zeros((n + 1, n + 1))
  step[n, n] = 1.0
  for k, pk in enumerate(pmf):
    np.add.at(step, (np.minimum(np.arange(n) + k + 1, n), np.arange(n)), pk)
  dist = np.zeros(n + 1)
  dist[0] = 1.0
  cdf = np.ones(n + 1)
  cdf[0] = 0.0  # n >= 1 tokens need a step
  for s in range(1, n + 1):   # each step emits >= 1 token: n steps always suffice
    dist = step @ dist
    cdf[s] = dist[n]
    if dist[n] >= 1.0 - 1e-15:  # done to rounding: the rest is 1
      break
  cdf[n] = 1.0
  return cdf


def expected_batch_steps(accept_pmf: Sequence[float], n_tokens: int, batch: int) -> float:
  """E[max over B rows of the steps each row needs] for n_tokens tokens per
  row, rows independent: P(max <= s) = P(S <= s)^B, E[max] = sum_s (1 - P(max <= s)).
  The batch loop runs until its slowest row is done (the tail effect)."""
  if int(batch) < 1:
    raise SpecjaxError(f"batch must be >= 1, got {batch!r}")
  cdf = steps_cdf(accept_pmf, n_tokens)
  return float(np.sum(1.0 - cdf[:-1] ** int(batch)))


def catchup_any_share(alpha: ArrayLike, gamma: int, batch: int) -> float | np.ndarray:
  """P(some row of B accepted every draft last step): the draft's catch-up
  forward runs for the whole batch when any row needs it (a lax.cond).
  Ignores rows that finished (an upper bound near the end)."""
  a = _probability(alpha, "alpha")
  return _out(1.0 - (1.0 - a ** int(gamma)) ** int(batch))


def batch_speedup(accept_pmf: Sequence[float], n_tokens: int, batch: int, gamma: int,
                  t_target: float, t_verify: float, t_draft: float,
                  t_overhead: float = 0.0, catchup_share: float = 0.0) -> float:
  """Predicted speedup of a batch of B rows, each emitting n_tokens tokens,
  every cost measured at batch B:
    target-only  n_tokens T_target(B, 1)
    speculative  E[max steps] ((gamma + catchup_share) T_draft(B, 1)
                 + T_target(B, gamma+1) + overhead)
  At B = 1 and n_tokens large it tends to measured_cost_speedup at
  tokens_per_step = E[1 + k]."""
  step_s = (gamma + catchup_share) * t_draft + t_verify + t_overhead
  return batch_speedup_at_step(accept_pmf, n_tokens, batch, t_target, step_s)


def batch_speedup_at_step(accept_pmf: Sequence[float], n_tokens: int, batch: int,
                          t_target: float, step_s: float) -> float:
  """batch_speedup with the seconds of one speculative step given whole:
  n_tokens T_target(B, 1) / (E[max steps] step_s). For a step time measured
  in the loop itself (autogamma's calibrated t_step) rather than summed from
  the parts."""
  steps = expected_batch_steps(accept_pmf, n_tokens, batch)
  return float(n_tokens * t_target / (steps * float(_positive(step_s, "step_s"))))


def _curve_points(curve: Curve) -> tuple[np.ndarray, np.ndarray]:
  if isinstance(curve, Mapping):
    ns, ts = list(curve.keys()), list(curve.values())
  else:
    ns, ts = curve
  ns, ts = np.asarray(ns, dtype=float), np.asarray(ts, dtype=float)
  if ns.ndim != 1 or ns.shape != ts.shape or ns.size == 0:
    raise SpecjaxError("curve needs matching 1-D, non-empty n and time sequences")
  order = np.argsort(ns)
  ns, ts = ns[order], ts[order]
  if np.any(np.diff(ns) == 0):
    raise SpecjaxError(f"curve has repeated n values: {ns}")
  return ns, _positive(ts, "curve times")


def verify_time_from_curve(curve: Curve, n: ArrayLike) -> float | np.ndarray:
  """T_target(n) by linear interpolation of a measured cost curve.

  The curve can come from any backend (XLA, PyTorch, llama.cpp's
  `llama-bench -p 1,2,...,8` as in [T3649]: time = n / (t/s)). Points need not
  be contiguous; n outside the measured range is an error, not an
  extrapolation.

  Args:
    curve: {n: seconds} or a pair (ns, seconds).
    n: batch size(s) to evaluate.
  """
  ns, ts = _curve_points(curve)
  x = np.asarray(n, dtype=float)
  if np.any((x < ns[0]) | (x > ns[-1])):
    raise SpecjaxError(f"n={n!r} is outside the measured curve range [{ns[0]:g}, {ns[-1]:g}]")
  return _out(np.interp(x, ns, ts))


def speedup_from_curve(
    alpha: ArrayLike,
    gamma: ArrayLike,
    t_draft: ArrayLike,
    curve: Curve,
    t_overhead: ArrayLike = 0.0,
) -> float | np.ndarray:
  """Measured-cost speedup with T_target(1) and T_target(gamma+1) read off a curve.

  `measured_cost_speedup_at_alpha` with t_target = curve(1) and
  t_verify = curve(gamma + 1); the curve must cover n = 1 and n = gamma + 1.
  """
  t_target = verify_time_from_curve(curve, 1)
  t_verify = verify_time_from_curve(curve, np.asarray(gamma) + 1)
  return measured_cost_speedup_at_alpha(alpha, gamma, t_draft, t_target, t_verify, t_overhead)
