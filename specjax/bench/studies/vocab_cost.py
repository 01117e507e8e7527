"""What a reduced draft vocabulary saves: the time of one draft step against
the set's size V_d, next to the target's decode step T(1), with the probes
the sweeps use (decode/probes.py; a drafter's whole proposal per token, or
its model's forward with the head over the set), alternated over repetitions
so that drift in the machine's load hits every size alike; medians.
c = T_draft(1) / T_target(1)."""

from __future__ import annotations

import dataclasses
from typing import Callable, Sequence

import numpy as np

from specjax.decode import probes
from specjax.drafters import registry
from specjax.drafters.network import NetworkDrafter
from specjax.model import steps


def with_vocab(spec: str, size: str) -> NetworkDrafter:
  """The drafter of `spec` over `size` ids ('full': the whole vocabulary)."""
  return dataclasses.replace(registry.parse(spec), vocab=size)


def vocab_cost(target: steps.Runner, draft: steps.Runner | None, specs: Sequence[str],
               sizes: Sequence[str], gamma: int, capacity: int, depth: int, reps: int,
               log: Callable[[str], None] = print) -> list[dict]:
  """One record per (drafter, size): T_draft(1), T_target(1) and c, medians of
  `reps` alternating repetitions (compile and warm-up untimed)."""
  tprobe = probes.CostProbe(target, capacity, depth)
  cells = {}
  for spec in specs:
    for size in sizes:
      drafter = with_vocab(spec, size)
      cells[(spec, size)] = probes.draft_probe(drafter.for_target(target.cfg), target, draft,
                                               gamma, capacity, depth)
  times: dict = {key: [] for key in cells}
  t_target: list[float] = []
  for r in range(reps + 1):  # the first round compiles and warms up, untimed
    t = tprobe.times([1])[1].median
    for key, probe in cells.items():
      times[key].append(probe.times([1])[1].median)
    if r:
      t_target.append(t)
    else:
      times = {key: [] for key in cells}
    log(f"repetition {r}/{reps}" + (" (warm-up)" if not r else ""))
  tt = float(np.median(t_target))
  return [{"drafter": spec, "vocab": size, "t_draft_s": float(np.median(v)),
           "t_target_s": tt, "c": float(np.median(v)) / tt, "reps": reps,
           "spread": float((np.max(v) - np.min(v)) / np.median(v))}
          for (spec, size), v in times.items()]
