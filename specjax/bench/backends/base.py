"""The backend interface, its measurement, and the parity check.

Every backend is timed by `timing.measure` (the one method) through a Python
callable (`Backend.measure`); compile and first-call time is kept out of
every timing and reported apart. Before any timing, every backend's logits
for the timed call are checked against xla's (`check_parity`); a mismatch
stops the run (`ParityError`).

Parity error: max |logit - xla logit| / max |xla logit|, against a tolerance
per compute dtype (`parity_tolerance`).
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any, Callable

import numpy as np

from specjax.metrics import timing
from specjax.errors import SpecjaxError

# Parity: max |logit - xla logit| / max |xla logit|, per compute dtype.
PARITY_TOL = {"float32": 1e-4, "bfloat16": 5e-2, "float16": 1e-2}
PARITY_TOL_LLAMACPP_F32 = 1e-3  # its own kernels and accumulation order


class ParityError(SpecjaxError):
  """Two backends holding the same weights compute different logits."""


class Unavailable(Exception):
  """A backend cannot run here; the comparison goes on without it."""


def first_line(e: BaseException) -> str:
  """'Type: first line of the message', at most 300 characters (for notes)."""
  text = (str(e).strip().splitlines() or [type(e).__name__])[0]
  return f"{type(e).__name__}: {text}"[:300]

# ---------------------------------------------------------------- parity


def parity_error(ref: np.ndarray, other: np.ndarray) -> float:
  """max |other - ref| / max |ref|: the logit error, relative to their scale."""
  ref, other = np.asarray(ref, np.float32), np.asarray(other, np.float32)
  if ref.shape != other.shape:
    return float("inf")
  return float(np.max(np.abs(other - ref)) / max(float(np.max(np.abs(ref))), 1e-30))


def parity_tolerance(backend: str, dtype: str) -> float:
  if backend == "llama.cpp" and dtype == "float32":
    return PARITY_TOL_LLAMACPP_F32
  return PARITY_TOL[dtype]


def check_parity(ref: np.ndarray, other: np.ndarray, tol: float,
                 what: str) -> float:
  """Returns the parity error, or raises ParityError naming `what` and both
  numbers when it exceeds `tol` (or the shapes differ)."""
  err = parity_error(ref, other)
  if not err <= tol:
    shapes = ("" if np.shape(ref) == np.shape(other)
              else f" (shapes {np.shape(other)} vs {np.shape(ref)})")
    raise ParityError(f"parity check failed: {what}: max |Δlogit| / max "
                      f"|logit| = {err:.3g} > tolerance {tol:g}{shapes}: the "
                      f"backends do not compute the same model (weights or "
                      f"their conversion differ); stopping")
  return err

# ---------------------------------------------------------------- backends


@dataclasses.dataclass
class Sample:
  """One backend's measurement of one point (in one round)."""
  timing: timing.Timing
  first_call_s: float | None  # wall s of the first (warm-up) call at this shape
  cpu_util: float             # process CPU s / wall s over the timed repetitions


class CpuUse:
  """Process CPU seconds over wall seconds inside a `with` block: the cores a
  backend kept busy (spinning threads count)."""

  def __enter__(self):
    self.p0, self.w0 = time.process_time(), time.perf_counter()
    return self

  def __exit__(self, *exc):
    self.util = (time.process_time() - self.p0) / max(time.perf_counter() - self.w0, 1e-9)
    return False


class Backend:
  """One way to run the model. `prepare` fills a new cache of `capacity`
  slots per row with `prefix` [B, depth] (calls will add at most `max_n`
  tokens per row); `runner(tokens [B, N])` is the timed call (roll back to
  depth, one forward); `logits` runs the same call and returns its logits
  [B, N, V]."""
  name = "?"
  max_batch = 1 << 30
  parity = True  # checked against xla before timing
  threads = 1

  def prepare(self, prefix: np.ndarray, capacity: int, max_n: int) -> None:
    raise NotImplementedError

  def runner(self, tokens: np.ndarray) -> Callable[[], Any]:
    raise NotImplementedError

  def logits(self, tokens: np.ndarray) -> np.ndarray:
    raise NotImplementedError

  def measure(self, tokens: np.ndarray, reps: int, first: bool) -> Sample:
    """timing.measure of the call after one untimed warm-up call; that
    call's wall seconds when it is the `first` at this shape.

    The warm-up is timed here because JAX's compile events see XLA only:
    its wall time minus the median is torch.compile's or llama.cpp's
    first-call cost. Later rounds warm up too: the first call after
    another backend ran meets that backend's thread pool still spinning.
    """
    run = self.runner(tokens)
    with timing.CompileWatch() as cw:
      warm_s = timing.timed(run)[1]
    with CpuUse() as cpu:
      t = timing.measure(run, reps=reps, warmup=0)
    return Sample(dataclasses.replace(t, compile_s=cw.seconds, n_compiles=cw.count),
                  warm_s if first else None, cpu.util)

  def close(self) -> None:
    pass
