"""Per-row lengths' theory next to the measurement (--gamma=auto:rows).

A per-row run records, per step and live row, the length given (n_drafted),
what the drafter proposed, the running alpha the length came from, and what
was accepted and kept (stats.Records). Under the per-row geometric model a
row of acceptance alpha_b given l_b drafts emits E(alpha_b, l_b) = 1 +
alpha_b + .. + alpha_b^l_b tokens (metrics.theory.expected_tokens_per_step),
so `compare` sets the tokens per step measured beside: the allocator's own
prediction (its running alphas, the lengths it gave); the oracle (each row's
alpha known, fitted from its whole run, and the best lengths for it within
the same budget and proposals: allocation.allocate, the per-row bound); and
the uniform split of the same budget (every row floor((N - B) / B) drafts:
a fixed gamma at the same verify cost). docs/packed_verify.md.
"""

from __future__ import annotations

import dataclasses

import jax
import numpy as np

from specjax.decode import allocation
from specjax.metrics import theory
from specjax.metrics.stats import Records


@dataclasses.dataclass(frozen=True)
class RowsTheory:
  """Tokens per loop step (all live rows together), measured and predicted."""
  budget: float        # N: tokens verified per step (mean, where chosen per chunk)
  steps: int           # loop steps
  rows: float          # live rows per step (mean)
  drafts: float        # drafts verified per step (sum of the lengths given)
  measured: float      # tokens emitted per step (accepted + 1 per live row)
  kept: float          # of which kept (n_predict / EOS cut the last steps)
  predicted: float     # the allocator's prediction: E(its running alpha, length given)
  oracle: float        # each row's fitted alpha, the best lengths for it
  uniform: float       # each row's fitted alpha, floor((N - B) / B) drafts each
  alpha: tuple[float, ...]  # each row's fitted alpha

  def lines(self) -> list[str]:
    return [f"per-row lengths, budget N = {self.budget:g} tokens per step, {self.steps} steps, "
            f"{self.rows:.2f} live rows and {self.drafts:.2f} drafts verified per step",
            f"tokens per step: measured {self.measured:.3f} (kept {self.kept:.3f}); geometric "
            f"model: the allocator's prediction {self.predicted:.3f}, oracle {self.oracle:.3f}"
            f", uniform split {self.uniform:.3f}",
            "each row's alpha (fitted from its run): " + ", ".join(
                f"{a:.2f}" for a in self.alpha)]


def expected_tokens(alpha, lengths) -> float:
  """Sum over rows of E(alpha_b, l_b): one step's expected tokens."""
  return float(np.sum(theory.expected_tokens_per_step(np.asarray(alpha, float),
                                                      np.asarray(lengths))))


def row_alphas(rec: Records, batch: int) -> np.ndarray:
  """[B] each row's alpha: the one whose expected accepted total over the
  lengths it was given equals what it accepted (theory.alpha_from_accepted_steps)."""
  out = np.zeros(batch)
  for b in range(batch):
    sel = rec.row == b
    given = rec.n_drafted[sel]
    out[b] = theory.alpha_from_accepted_steps(int(rec.n_acc[sel].sum()), given[given > 0])
  return out


def by_step(rec: Records, field: str, batch: int, fill=0) -> np.ndarray:
  """[steps, B] a record's field by loop step and row (`fill` where not live)."""
  steps = int(rec.step.max()) + 1 if rec.step.size else 0
  out = np.full((steps, batch), fill, np.asarray(getattr(rec, field)).dtype)
  out[rec.step, rec.row] = getattr(rec, field)
  return out


def best_lengths(alpha, proposed, budgets, gamma_max: int) -> np.ndarray:
  """[steps, B] the best lengths for `alpha` at each step's budget and
  proposals (allocation.allocate, one batched call per distinct budget)."""
  out = np.zeros(proposed.shape, np.int32)
  for n in sorted(set(budgets.tolist())):
    at = budgets == n
    out[at] = jax.vmap(lambda lim: allocation.allocate(alpha, int(n), gamma_max, limit=lim))(
        proposed[at])
  return out


def step_table(rec: Records, budget) -> list[dict]:
  """The run step by step, for a reader asking why budget=auto chose what it
  did: per loop step its budget N and, per live row, the running alpha its
  length came from and the evidence behind it, what it proposed, the length
  given, the drafts accepted, the tokens kept and its free test (1 hit, 0
  miss, -1 none; rows_step.free_test). budget: N, or each loop step's
  (budget=auto)."""
  steps = int(rec.step.max()) + 1 if rec.step.size else 0
  budgets = np.broadcast_to(np.asarray(budget, np.int64), (steps,)) if np.ndim(budget) == 0 \
      else np.asarray(budget, np.int64)[:steps]
  out = [{"step": s, "budget": int(budgets[s]), "rows": []} for s in range(steps)]
  for i in np.argsort(rec.step, kind="stable"):
    out[int(rec.step[i])]["rows"].append({
        "row": int(rec.row[i]), "alpha": round(float(rec.alpha[i]), 4),
        "weight": round(float(rec.weight[i]), 4), "proposed": int(rec.proposed[i]),
        "given": int(rec.n_drafted[i]), "accepted": int(rec.n_acc[i]),
        "kept": int(rec.kept[i]), "free": int(rec.free[i])})
  return out


def compare(rec: Records, budget, gamma_max: int, batch: int) -> RowsTheory:
  """The run's tokens per step against the geometric model's (module
  docstring); budget: N, or each loop step's (budget=auto)."""
  if rec.proposed is None or rec.alpha is None:
    raise ValueError("rows_theory.compare needs a per-row run's records (proposed, alpha)")
  alpha = row_alphas(rec, batch)
  proposed = by_step(rec, "proposed", batch)  # 0 where not live: nothing to give
  steps = proposed.shape[0]
  budgets = np.broadcast_to(np.asarray(budget, np.int64), (steps,)) if np.ndim(budget) == 0 \
      else np.asarray(budget, np.int64)[:steps]
  best = best_lengths(alpha, proposed, budgets, gamma_max)
  live = by_step(rec, "kept", batch, -1) >= 0
  even = np.where(live, np.minimum(proposed, ((budgets - batch) // batch)[:, None]), 0)
  per = lambda lengths: sum(expected_tokens(alpha[lv], ls[lv])
                            for ls, lv in zip(np.asarray(lengths), live)) / max(steps, 1)
  return RowsTheory(
      budget=float(budgets.mean()) if steps else float(np.mean(budget)), steps=steps, rows=float(live.sum() / max(steps, 1)),
      drafts=float(rec.n_drafted.sum() / max(steps, 1)),
      measured=float((rec.n_acc + 1).sum() / max(steps, 1)),
      kept=float(rec.kept.sum() / max(steps, 1)),
      predicted=float(theory.expected_tokens_per_step(rec.alpha.astype(float),
                                                      rec.n_drafted).sum() / max(steps, 1)),
      oracle=per(best), uniform=per(even), alpha=tuple(float(a) for a in alpha))
