"""A step's cost as the context grows, and the batch where speculation's
speedup stops falling and starts rising (issue 39; docs/long_context.md).

A forward of N tokens per row at batch B reads the weights once for the
batch and each row's KV (MagicDec's accounting, measured rather than bound):
  T(B, N, C) = w0(N) + w1(N) B + kappa KV(B, C)
the weights term (w0: the read of the weights and every fixed cost; w1: what
each row adds) and the KV term (kappa seconds per byte, KV(B, C) the bytes of
K and V the step reads: `Reads`). `fit` finds them by least squares on a
measured surface; a draft's fit may take the target's kappa (its KV read
costs what the target's does: the one way to move W, which a surface
measured at one W cannot separate from w1). `speedups` is the batch
speedup (theory.batch_speedup at the geometric law of alpha) along the
batch at one context; `turning_batch` the first batch where it stops
falling and rises.
"""

from __future__ import annotations

import dataclasses
from typing import Sequence

import numpy as np

from specjax.errors import SpecjaxError
from specjax.metrics import theory


@dataclasses.dataclass(frozen=True)
class Reads:
  """The KV bytes one step reads: each of B rows reads `slot_bytes` (K and V
  of one slot over the layers the network runs) for min(C, window) slots of
  its context (window None: all of them) plus the step's own `span` slots."""
  slot_bytes: float
  window: int | None = None

  def bytes(self, batch, context, span: int = 0) -> float | np.ndarray:
    c = np.asarray(context, float)
    slots = c if self.window is None else np.minimum(c, self.window)
    return np.asarray(batch, float) * self.slot_bytes * (slots + span)


@dataclasses.dataclass(frozen=True)
class Point:
  """One measured step: batch B, N tokens per row, kv_bytes read, seconds."""
  batch: int
  n: int
  kv_bytes: float
  seconds: float


@dataclasses.dataclass(frozen=True)
class StepModel:
  """T(B, N, KV) = w0(N) + w1(N) B + kappa KV, per measured N (`ns`,
  ascending); an N between two measured ones interpolates w0 and w1
  linearly, one outside them is refused."""
  ns: tuple[int, ...]
  w0: tuple[float, ...]
  w1: tuple[float, ...]
  kappa: float

  def weights_term(self, batch, n: int) -> float | np.ndarray:
    if not self.ns[0] <= n <= self.ns[-1]:
      raise SpecjaxError(f"N = {n} is outside the measured N {list(self.ns)}")
    w0, w1 = np.interp(n, self.ns, self.w0), np.interp(n, self.ns, self.w1)
    return w0 + w1 * np.asarray(batch, float)

  def seconds(self, batch, n: int, kv_bytes) -> float | np.ndarray:
    return self.weights_term(batch, n) + self.kappa * np.asarray(kv_bytes, float)

  def kv_share(self, batch, n: int, kv_bytes) -> float | np.ndarray:
    """The KV term's share of the step."""
    return self.kappa * np.asarray(kv_bytes, float) / self.seconds(batch, n, kv_bytes)


def design(points: Sequence[Point], ns: Sequence[int]) -> np.ndarray:
  """The least-squares columns: per measured N, [1, B] on that N's rows."""
  cols = []
  for n in ns:
    on = np.asarray([p.n == n for p in points], float)
    cols += [on, on * np.asarray([p.batch for p in points], float)]
  return np.stack(cols, 1)


def fit(points: Sequence[Point], kappa: float | None = None) -> StepModel:
  """Least squares of the model on measured points (kappa fitted too, unless
  given). Each N needs two batches; kappa needs two KV sizes at one (B, N)."""
  if not points:
    raise SpecjaxError("no measured points to fit")
  ns = sorted({p.n for p in points})
  for n in ns:
    if len({p.batch for p in points if p.n == n}) < 2:
      raise SpecjaxError(f"N = {n}: the fit needs at least two batches")
  x = design(points, ns)
  y = np.asarray([p.seconds for p in points], float)
  kv = np.asarray([p.kv_bytes for p in points], float)
  if kappa is None:
    x = np.concatenate([x, kv[:, None]], 1)
    if np.linalg.matrix_rank(x) < x.shape[1]:
      raise SpecjaxError("the KV term cannot be told from the weights term: measure "
                         "two contexts at one (batch, N)")
    coef = np.linalg.lstsq(x, y, rcond=None)[0]
    kappa, coef = float(coef[-1]), coef[:-1]
  else:
    coef = np.linalg.lstsq(x, y - kappa * kv, rcond=None)[0]
  return StepModel(ns=tuple(ns), w0=tuple(float(c) for c in coef[0::2]),
                   w1=tuple(float(c) for c in coef[1::2]), kappa=float(kappa))


def relative_errors(model: StepModel, points: Sequence[Point]) -> np.ndarray:
  """(predicted - measured) / measured at each point."""
  return np.asarray([(model.seconds(p.batch, p.n, p.kv_bytes) - p.seconds) / p.seconds
                     for p in points])


def speedups(target: StepModel, draft: StepModel, target_reads: Reads, draft_reads: Reads,
             alpha: float, gamma: int, context: int, batches: Sequence[int],
             n_tokens: int = 128) -> np.ndarray:
  """The predicted batch speedup at each batch (theory.batch_speedup: target-
  only n_tokens T(B, 1) against E[max steps] (gamma T_draft(B, 1) +
  T(B, gamma + 1)), the geometric law of alpha), every cost from the models
  at `context`: the target reads its context and the step's tokens, the
  draft its reads and the gamma it feeds."""
  pmf = theory.geometric_accept_pmf(alpha, gamma)
  out = []
  for b in batches:
    t1 = target.seconds(b, 1, target_reads.bytes(b, context, 1))
    tv = target.seconds(b, gamma + 1, target_reads.bytes(b, context, gamma + 1))
    td = draft.seconds(b, 1, draft_reads.bytes(b, context, gamma))
    if min(t1, tv, td) <= 0:
      raise SpecjaxError(f"the fit predicts a step of <= 0 s at batch {b}, context {context}: "
                         "too far from the measured batches")
    out.append(theory.batch_speedup(pmf, n_tokens, b, gamma, t1, tv, td))
  return np.asarray(out)


def turning_batch(batches: Sequence[int], values: Sequence[float]) -> int | None:
  """The first batch where the speedup stops falling and starts rising:
  the first point lower than (or equal to) the one before it and lower
  than the one after it; the first batch when the curve rises from there;
  None when it never rises."""
  v = np.asarray(values, float)
  for i in range(len(v) - 1):
    if (i == 0 or v[i] <= v[i - 1]) and v[i + 1] > v[i]:
      return int(batches[i])
  return None
