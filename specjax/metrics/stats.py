"""Per-step records -> every speculative-decoding metric, each defined once.

`Records` holds what the loops record per live row-step (drafted, accepted,
kept, catch-up, and each step's gamma where steps differ); `SpecStats` is a
run's report: gamma, n_predict, n_drafted, n_accept, n_steps, n_kept,
n_catchup, accept_rate (llama.cpp's "accept", not the paper's alpha),
tokens_per_step, mean_accepted, alpha (an estimate under the i.i.d.
assumption), accept_hist, alpha_at_pos, tokens_per_s. `geometric_check`
sets the accepted-length histogram against the capped geometric law.
The definitions, with llama.cpp's names where it has them, are
ARCHITECTURE.md's "Metric definitions": this module implements them.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import numpy as np

from specjax.metrics import theory

RECORD_FIELDS = ("n_acc", "n_drafted", "kept", "caught_up")
# recorded where the loop records them (Records)
ROW_FIELDS = ("proposed", "alpha", "weight", "free")


@dataclasses.dataclass
class Records:
  """Per-step records of a speculative run: one entry per live row-step, in
  step-major order (a finished row riding along is not recorded)."""
  n_acc: np.ndarray      # accepted drafts
  n_drafted: np.ndarray  # drafts really proposed
  kept: np.ndarray       # tokens kept (n_acc + 1, less what n_predict / EOS cut off)
  caught_up: np.ndarray  # 1 where the step first fed the draft its d_gamma
  step: np.ndarray       # the loop step of the entry
  row: np.ndarray        # the batch row of the entry (offset per run after concat)
  # the gamma the entry's step asked for, where steps differ (autogamma; per-row
  # lengths: the length given); None: every step ran the run's one gamma
  gamma: np.ndarray | None = None
  # what the drafter proposed (n_drafted: what the step verified; they differ
  # under per-row lengths) and the row's running alpha the lengths were
  # allotted from (0 without per-row lengths) with its evidence (decayed
  # accepts and rejections, rows_step.RowAlpha.weight); None: not recorded
  proposed: np.ndarray | None = None
  alpha: np.ndarray | None = None
  weight: np.ndarray | None = None
  # a row given nothing whose d_1 was tested anyway (rows_step.free_test): 1
  # the target's token was d_1, 0 it was not, -1 no such test
  free: np.ndarray | None = None

  @classmethod
  def concat(cls, parts: list["Records"]) -> "Records":
    """The records of several runs (e.g. one per prompt) as one; rows are
    renumbered so that every run keeps its own."""
    offsets = np.cumsum([0] + [int(p.row.max()) + 1 if p.row.size else 0 for p in parts])
    cat = lambda f: np.concatenate([getattr(p, f) for p in parts])
    mixed = {p.gamma is None for p in parts}
    if len(mixed) > 1:
      raise ValueError("Records.concat: some parts record each step's gamma, some do not")
    opt = {f: None if any(getattr(p, f) is None for p in parts) else cat(f)
           for f in ROW_FIELDS}
    return cls(*(cat(f) for f in RECORD_FIELDS), step=cat("step"),
               row=np.concatenate([p.row + o for p, o in zip(parts, offsets)]),
               gamma=None if mixed == {True} else cat("gamma"), **opt)

  @classmethod
  def from_arrays(cls, rec: dict[str, Any]) -> "Records":
    """From the loops' [steps, B] arrays and their `live` mask."""
    live = np.asarray(rec["live"]).astype(bool)
    step, row = np.nonzero(live)
    opt = {f: np.asarray(rec[f])[live] for f in ROW_FIELDS if f in rec}
    return cls(*(np.asarray(rec[f])[live] for f in RECORD_FIELDS), step=step, row=row, **opt)

  def at_step(self, step: int, field: str = "n_acc") -> np.ndarray:
    """`field` of every row live at `step`, by row."""
    sel = self.step == step
    return getattr(self, field)[sel][np.argsort(self.row[sel])]

  def steps_per_row(self) -> np.ndarray:
    """Steps each row was live for."""
    return np.bincount(self.row)


@dataclasses.dataclass
class SpecStats:
  gamma: int
  n_predict: int
  n_drafted: int
  n_accept: int
  n_steps: int
  n_kept: int
  n_catchup: int
  accept_rate: float
  tokens_per_step: float
  mean_accepted: float
  alpha: float
  accept_hist: list[int]
  alpha_at_pos: list[float | None]
  eval_s: float = 0.0
  tokens_per_s: float = 0.0
  phase_s: dict[str, float] = dataclasses.field(default_factory=dict)

  @classmethod
  def compute(cls, rec: Records, gamma: int, n_predict: int, eval_s: float = 0.0,
              phase_s: dict[str, float] | None = None) -> "SpecStats":
    k, m = rec.n_acc.ravel(), rec.n_drafted.ravel()
    n_steps = int(k.size)
    n_accept, n_drafted, n_kept = int(k.sum()), int(m.sum()), int(rec.kept.sum())
    mean_acc = n_accept / n_steps if n_steps else 0.0
    reached = [(k >= i - 1) & (m >= i) for i in range(1, gamma + 1)]
    alpha_pos = [float(((k >= i) & r).sum() / r.sum()) if r.sum() else None
                 for i, r in zip(range(1, gamma + 1), reached)]
    phase = dict(phase_s or {})
    if phase:
      phase["rest_s"] = max(eval_s - sum(phase.values()), 0.0)
    if rec.gamma is None:
      alpha = float(theory.alpha_from_mean_accepted(min(mean_acc, gamma), gamma))
    else:  # each step against its own gamma, not the largest
      if rec.gamma.size and int(rec.gamma.max()) > gamma:
        raise ValueError(f"SpecStats.compute: gamma {gamma} < a step's gamma {rec.gamma.max()}")
      alpha = theory.alpha_from_accepted_steps(n_accept, rec.gamma[rec.gamma > 0])
    return cls(
        gamma=gamma, n_predict=n_predict, n_drafted=n_drafted, n_accept=n_accept,
        n_steps=n_steps, n_kept=n_kept, n_catchup=int(rec.caught_up.sum()),
        accept_rate=n_accept / n_drafted if n_drafted else 0.0,
        tokens_per_step=n_kept / n_steps if n_steps else 0.0,
        mean_accepted=mean_acc,
        alpha=alpha,
        accept_hist=np.bincount(k, minlength=gamma + 1).tolist(),
        alpha_at_pos=alpha_pos, eval_s=eval_s,
        tokens_per_s=n_kept / eval_s if eval_s > 0 else 0.0,
        phase_s=phase)

  @property
  def catchup_share(self) -> float:
    """Catch-up draft steps per step."""
    return self.n_catchup / self.n_steps if self.n_steps else 0.0

  def to_dict(self) -> dict[str, Any]:
    return dataclasses.asdict(self)

  def summary_lines(self) -> list[str]:
    """The seed thread's block (llama.cpp's names), then the rest."""
    lines = [f"n_draft   = {self.gamma}", f"n_predict = {self.n_predict}",
             f"n_drafted = {self.n_drafted}", f"n_accept  = {self.n_accept}",
             f"accept    = {100 * self.accept_rate:.3f}%", "",
             f"n_steps         = {self.n_steps} (target verify calls)",
             f"tokens_per_step = {self.tokens_per_step:.3f} (tokens kept per step)",
             f"mean_accepted   = {self.mean_accepted:.3f}",
             f"n_catchup       = {self.n_catchup} (steps that first fed the draft d_gamma)",
             f"alpha (i.i.d. estimate) = {self.alpha:.4f}",
             f"accepted-length histogram (k=0..{self.gamma}) = {self.accept_hist}",
             "alpha at draft position = [" + ", ".join(
                 "-" if a is None else f"{a:.3f}" for a in self.alpha_at_pos) + "]"]
    if self.phase_s:
      total = max(self.eval_s, 1e-12)
      lines.append("time split: " + ", ".join(
          f"{k[:-2]} {1e3 * v:.1f} ms ({100 * v / total:.1f}%)"
          for k, v in self.phase_s.items()))
    return lines


def chi2_sf(x: float, dof: int) -> float:
  """P(chi-square with `dof` degrees of freedom >= x) (regularised upper gamma).

  Series for x < a + 1, continued fraction otherwise (Numerical Recipes 6.2);
  kept here so the sweep report needs no scipy.
  """
  if dof <= 0:
    return float("nan")
  a, x = dof / 2.0, x / 2.0
  if x <= 0:
    return 1.0
  lg = math.lgamma(a)
  if x < a + 1:
    term = total = 1.0 / a
    n = a
    for _ in range(1000):
      n += 1
      term *= x / n
      total += term
      if abs(term) < abs(total) * 1e-15:
        break
    return max(0.0, 1.0 - total * math.exp(-x + a * math.log(x) - lg))
  b = x + 1.0 - a
  c, d = 1.0 / 1e-300, 1.0 / b
  h = d
  for i in range(1, 1000):
    an = -i * (i - a)
    b += 2.0
    d = an * d + b
    d = 1e-300 if abs(d) < 1e-300 else d
    c = b + an / c
    c = 1e-300 if abs(c) < 1e-300 else c
    d = 1.0 / d
    h *= d * c
    if abs(d * c - 1.0) < 1e-15:
      break
  return min(1.0, math.exp(-x + a * math.log(x) - lg) * h)


def geometric_check(st: SpecStats) -> dict[str, Any]:
  """The accepted-length histogram against the capped geometric law at st.alpha.

  The theory assumes every draft token is accepted independently with the
  same probability; then P(k accepted) = alpha^k (1 - alpha), P(gamma) =
  alpha^gamma (theory.geometric_accept_pmf). Returns the observed and
  expected shares, their total-variation distance, and Pearson's chi-square
  (bins with expected count < 5 pooled into their neighbour) with its p-value
  (dof = bins - 2: the shares sum to one and alpha is fitted).
  Meaningful only without a draft early stop (p_min = 0).
  """
  hist = np.asarray(st.accept_hist, float)
  n = hist.sum()
  if n == 0:
    return {"observed": [], "expected": [], "tv": None, "chi2": None, "dof": 0, "p": None}
  exp = theory.geometric_accept_pmf(st.alpha, st.gamma) * n
  obs_bins, exp_bins, o, e = [], [], 0.0, 0.0
  for ok, ek in zip(hist, exp):
    o, e = o + ok, e + ek
    if e >= 5:
      obs_bins.append(o)
      exp_bins.append(e)
      o = e = 0.0
  if e > 0 and exp_bins:
    obs_bins[-1] += o
    exp_bins[-1] += e
  ob, eb = np.array(obs_bins), np.array(exp_bins)
  chi2 = float(((ob - eb) ** 2 / eb).sum()) if len(eb) else None
  dof = len(eb) - 2
  return {"observed": (hist / n).tolist(), "expected": (exp / n).tolist(),
          "tv": float(0.5 * np.abs(hist / n - exp / n).sum()), "chi2": chi2, "dof": dof,
          "p": chi2_sf(chi2, dof) if chi2 is not None and dof > 0 else None}
