"""The one timing method every benchmark and script uses.

* Compile time is measured from JAX's own compile events (tracing, lowering
  and backend compilation) and reported on its own, never mixed into a timing.
* Every clock stops after `block_until_ready` on the result.
* Several repetitions after warm-up; medians and spread are reported.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import statistics
import time
from typing import Any, Callable

import jax
from jax import monitoring

_COMPILE_EVENTS = ("/jax/core/compile/jaxpr_trace_duration",
                   "/jax/core/compile/jaxpr_to_mlir_module_duration",
                   "/jax/core/compile/backend_compile_duration")
_BACKEND_COMPILE = "/jax/core/compile/backend_compile_duration"
_active_watches: list["CompileWatch"] = []
_listener_installed = False


def _on_event(name: str, secs: float, fun_name: str = "", **_: Any) -> None:
  if name in _COMPILE_EVENTS:
    for w in _active_watches:
      w.seconds += secs
      if name == _BACKEND_COMPILE:
        w.count += 1
        w.names[fun_name.removeprefix("jit(").removesuffix(")")] += 1


class CompileWatch(contextlib.AbstractContextManager):
  """Counts XLA compilations and sums compile seconds inside a `with` block.

  `names` counts compilations per function name (small eager ops compile too).
  """

  def __init__(self):
    global _listener_installed
    if not _listener_installed:
      monitoring.register_event_duration_secs_listener(_on_event)
      _listener_installed = True
    self.count = 0
    self.seconds = 0.0
    self.names: collections.Counter[str] = collections.Counter()

  def __enter__(self):
    _active_watches.append(self)
    return self

  def __exit__(self, *exc):
    _active_watches.remove(self)
    return False


def block(x):
  """Waits for every array in the pytree x; returns x."""
  return jax.block_until_ready(x)


def timed(fn: Callable[[], Any]) -> tuple[Any, float]:
  """Runs fn() to completion on the device; returns (result, seconds)."""
  t0 = time.perf_counter()
  out = block(fn())
  return out, time.perf_counter() - t0


@dataclasses.dataclass
class Timing:
  """Wall times of repeated runs (seconds), compile time kept apart."""
  times: list[float]
  compile_s: float = 0.0
  n_compiles: int = 0

  @property
  def median(self) -> float:
    return statistics.median(self.times)

  @property
  def mean(self) -> float:
    return statistics.fmean(self.times)

  @property
  def std(self) -> float:
    return statistics.stdev(self.times) if len(self.times) > 1 else 0.0

  @property
  def min(self) -> float:
    return min(self.times)

  def to_dict(self) -> dict[str, Any]:
    return {"median_s": self.median, "mean_s": self.mean, "std_s": self.std,
            "min_s": self.min, "reps": len(self.times),
            "compile_s": self.compile_s, "n_compiles": self.n_compiles}


def measure(run: Callable[[], Any], reps: int = 5, warmup: int = 1) -> Timing:
  """Times `run()` `reps` times after `warmup` untimed calls.

  Compilation happens during warm-up and is reported in `compile_s`; a
  compilation during the timed repetitions is a bug in the caller (shapes
  changing) and raises. `warmup=0` is for functions already compiled.
  """
  with CompileWatch() as cw:
    for _ in range(warmup):
      block(run())
  with CompileWatch() as late:
    times = [timed(run)[1] for _ in range(reps)]
  if late.count:
    raise RuntimeError(f"{late.count} compilation(s) during timed repetitions")
  return Timing(times=times, compile_s=cw.seconds, n_compiles=cw.count)
