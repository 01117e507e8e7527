"""Per-row draft lengths from a verify budget (decode/allocation.py) against
a brute-force optimum of the geometric model: every length vector within the
budget tried, the expected tokens from metrics.theory (Leviathan et al.
Eq. 1 per row, summed). Each check is shown able to fail: MUTATIONS are
deliberate bugs, each of which must fail (test_each_deliberate_bug_fails)."""

import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from specjax.decode import allocation
from specjax.errors import ConfigError
from specjax.metrics import theory

GAMMA_MAX = 3
ALPHAS = [(0.9, 0.1), (0.5, 0.5), (0.0, 0.8), (1.0, 0.3), (0.6, 0.75, 0.2),
          (0.95, 0.0, 0.5), (0.3, 0.3, 0.9)] + \
    [tuple(np.random.RandomState(s).uniform(0, 1, 3).round(3)) for s in range(4)]


def expected(alpha, lengths) -> float:
  return float(sum(theory.expected_tokens_per_step(a, int(n)) for a, n in zip(alpha, lengths)))


LIMITS = {(0.9, 0.1): (1, 3), (0.6, 0.75, 0.2): (3, 0, 2), (0.3, 0.3, 0.9): (2, 3, 1)}


def best(alpha, budget, limit) -> float:
  """The brute-force optimum: the most expected tokens within the budget."""
  extra = budget - len(alpha)
  return max(expected(alpha, ls) for ls in itertools.product(range(GAMMA_MAX + 1),
                                                             repeat=len(alpha))
             if sum(ls) <= extra and all(n <= m for n, m in zip(ls, limit)))


def mismatches() -> list[str]:
  """Cases (alpha, budget N = B .. B (1 + gamma_max) + 1, with no limit and
  with LIMITS) where allocate's lengths break the budget or a row's limit,
  or fall short of the optimum."""
  bad = []
  cases = [(a, None) for a in ALPHAS] + list(LIMITS.items())
  for alpha, limit in cases:
    b = len(alpha)
    cap = (GAMMA_MAX,) * b if limit is None else limit
    for budget in range(b, b * (1 + GAMMA_MAX) + 2):
      got = np.asarray(allocation.allocate(jnp.asarray(alpha), budget, GAMMA_MAX,
                                           None if limit is None else jnp.asarray(limit)))
      if got.min() < 0 or (got > np.asarray(cap)).any() or got.sum() > budget - b:
        bad.append(f"{alpha} limit {limit} N {budget}: lengths {got.tolist()} out of bounds")
      elif not expected(alpha, got) >= best(alpha, budget, cap) - 1e-6:
        bad.append(f"{alpha} limit {limit} N {budget}: lengths {got.tolist()} give "
                   f"{expected(alpha, got):.4f} < {best(alpha, budget, cap):.4f}")
  return bad


def test_allocation_is_the_brute_force_optimum():
  assert mismatches() == []


def test_shares_are_prefixes_and_zero_gains_stay_padding():
  """Hand-made cases: the higher alpha first; a row at alpha 0 gets nothing
  even with budget to spare; N = B gives tails only."""
  alloc = lambda a, n: np.asarray(allocation.allocate(jnp.asarray(a), n, GAMMA_MAX)).tolist()
  assert alloc((0.9, 0.1), 4) == [2, 0]   # 0.9 + 0.81 beats 0.9 + 0.1
  assert alloc((0.0, 0.8), 10) == [0, 3]
  assert alloc((0.5, 0.7, 0.2), 3) == [0, 0, 0]
  jitted = jax.jit(allocation.allocate, static_argnums=(1, 2))  # alpha traced
  assert np.asarray(jitted(jnp.asarray([0.5, 0.6]), 5, GAMMA_MAX)).tolist() == [1, 2]
  with pytest.raises(ConfigError, match="at least B = 3"):
    allocation.allocate(jnp.asarray([0.5, 0.5, 0.5]), 2, GAMMA_MAX)


# ------------------------------------------------------------ deliberate bugs


MUTATIONS = {
    "the k-th draft's gain alpha^(k-1)": (
        "gains", lambda orig: lambda a, g: orig(a, g) / jnp.asarray(a, jnp.float32)[:, None]),
    "rows counted column-major (index mod B)": (
        "lengths_of", lambda orig: lambda c, v, b, g: jnp.zeros((b,), jnp.int32).at[c % b].add(
            v.astype(jnp.int32))),
    "the budget's tails forgotten (N drafts, not N - B)": (
        "n_drafts", lambda orig: lambda budget, batch: budget),
    "a row's limit off by one (one draft past it)": (
        "capped", lambda orig: lambda table, limit: orig(table, jnp.asarray(limit) + 1)),
}


@pytest.mark.parametrize("bug", list(MUTATIONS))
def test_each_deliberate_bug_fails(monkeypatch, bug):
  name, make = MUTATIONS[bug]
  monkeypatch.setattr(allocation, name, make(getattr(allocation, name)))
  bad = mismatches()
  print(f"MUTATION | {bug} | {len(bad)} mismatches, e.g. {bad[:2]}")
  assert bad, f"{bug}: no mismatch found"
