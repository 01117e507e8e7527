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

from specjax import workdir as wd
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


def plot(recs: list[dict], vocab_size: int, path) -> None:
  """c against V_d per drafter (the full vocabulary at V), and each size's
  held-out coverage on a second axis where the records carry it."""
  plt = wd.pyplot()
  fig, ax = plt.subplots(figsize=(6.4, 4.2))
  size = lambda r: vocab_size if r["vocab"] == "full" else int(r["vocab"])
  for spec in dict.fromkeys(r["drafter"] for r in recs):
    rs = sorted((r for r in recs if r["drafter"] == spec), key=size)
    ax.plot([size(r) for r in rs], [r["c"] for r in rs], "o-", label=spec)
  ax.set_xscale("log", base=2)
  ax.set_xlabel("draft vocabulary V_d (ids)")
  ax.set_ylabel("c = T_draft(1) / T_target(1)")
  ax.set_ylim(bottom=0)
  cov = sorted({(size(r), r["coverage"]) for r in recs if r.get("coverage") is not None})
  if cov:
    ax2 = ax.twinx()
    ax2.plot([s for s, _ in cov], [c for _, c in cov], "k:", label="held-out coverage")
    ax2.set_ylabel("held-out coverage of the target's tokens")
    ax2.set_ylim(0, 1.02)
    ax2.legend(loc="lower right")
  ax.legend(loc="upper left")
  ax.grid(alpha=0.3)
  wd.save_figure(fig, path)
