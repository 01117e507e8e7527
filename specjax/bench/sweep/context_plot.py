"""contexts.png (issue 39, part 5): speedup against batch, a line per context,
a panel per (engine, drafter). Measured (solid) beside the sweep's own
prediction from the costs it probed (each record's predicted_measured_cost,
dashed) and, given a cost-surface fit (`SurfaceFit`), the fit's
(metrics/context_cost.speedups at the point's alpha and gamma, dash-dot)
with the fit's KV share of the target's decode step on a second axis. Each
line's crossover (context_cost.turning_batch) is marked and named in its
label. The sweeps run the JAX engine (a record may name another: PyTorch's
runs of experiments/long_batch_check.py); an engine the fit holds and no
record ran gets panels from its fit alone, titled as predicted.
`curves` is a pure function of the records and the fit; `plot` draws it.
docs/long_context.md.
"""

from __future__ import annotations

import dataclasses
from typing import Mapping, Sequence

from specjax import workdir as wd
from specjax.errors import SpecjaxError
from specjax.metrics import context_cost as cc
from specjax.workdir import Record

MEASURED = "xla"  # the engine every sweep runs
NAMES = {"xla": "XLA", "torch": "PyTorch"}


@dataclasses.dataclass(frozen=True)
class SurfaceFit:
  """A cost surface's fitted step models (engine -> role -> model; roles:
  "target" and drafter specs) and what each role's step reads."""
  models: Mapping[str, Mapping[str, cc.StepModel]]
  reads: Mapping[str, cc.Reads]

  def has(self, engine: str, drafter: str) -> bool:
    ms = self.models.get(engine, {})
    return "target" in ms and drafter in ms and drafter in self.reads and "target" in self.reads

  def speedup(self, engine: str, r: Record) -> float | None:
    """The fit's batch speedup at a record's (context, batch, alpha, gamma) and
    tokens per row; None where the fit has no such drafter or N."""
    if not self.has(engine, r["drafter"]) or not isinstance(r["gamma"], int):
      return None
    ms = self.models[engine]
    try:
      return float(cc.speedups(ms["target"], ms[r["drafter"]], self.reads["target"],
                               self.reads[r["drafter"]], r["alpha"], r["gamma"], r["context"],
                               [r["batch"]], n_tokens=tokens_per_row(r))[0])
    except SpecjaxError:  # gamma + 1 outside the measured N, a step predicted <= 0 s
      return None

  def kv_share(self, engine: str, context: int, batch: int) -> float | None:
    """The KV term's share of the target's decode step T(B, 1) at `context`."""
    m = self.models.get(engine, {}).get("target")
    if m is None or "target" not in self.reads:
      return None
    return float(m.kv_share(batch, 1, self.reads["target"].bytes(batch, context, 1)))


@dataclasses.dataclass(frozen=True)
class Curve:
  """One context's line; a series is None where its panel has none."""
  context: int
  batches: tuple[int, ...]
  measured: tuple[float, ...] | None
  predicted_cost: tuple[float | None, ...] | None  # the sweep's measured-cost prediction
  predicted_fit: tuple[float | None, ...] | None   # the cost surface fit's
  kv_share: tuple[float | None, ...] | None

  @property
  def main(self) -> tuple[float | None, ...]:
    """The series the crossover is read on: measured, else the fit's."""
    return self.measured if self.measured is not None else self.predicted_fit

  @property
  def turn(self) -> str:
    return turn_label(self.batches, self.main)

  @property
  def fit_turn(self) -> str:
    return turn_label(self.batches, self.predicted_fit) if self.predicted_fit else ""


@dataclasses.dataclass(frozen=True)
class Panel:
  engine: str
  drafter: str
  curves: tuple[Curve, ...]

  @property
  def predicted_only(self) -> bool:
    return all(c.measured is None for c in self.curves)

  @property
  def title(self) -> str:
    name = NAMES.get(self.engine, self.engine)
    return f"{name}{' (predicted from its fit, not measured)' if self.predicted_only else ''}: " \
           f"{self.drafter}"


def tokens_per_row(r: Record) -> int:
  """The tokens a row generated beyond the prefill's first: a batch-1 point
  runs each prompt alone, a batch-B point one group of B rows."""
  rows = r["batch"] if r["batch"] > 1 else r.get("n_prompts", 1)
  return max(1, round(r["n_predict"] / rows) - 1)


def turn_label(batches: Sequence[int], values: Sequence[float | None] | None) -> str:
  """Where the speedup stops falling and rises (context_cost.turning_batch)."""
  if not values or len(batches) < 2 or any(v is None for v in values):
    return ""
  b = cc.turning_batch(batches, values)
  if b is None:
    return "never rises"
  return f"rises from B={b}" if b == batches[0] else f"turns at B={b}"


def engine_of(r: Record) -> str:
  """The engine that ran a record: the sweeps' (XLA) unless it names one
  (experiments/long_batch_check.py --engine=torch)."""
  return r.get("engine", MEASURED)


def chosen(records: Sequence[Record]) -> dict[tuple[str, str, int, int], Record]:
  """(engine, drafter, context, batch) -> the record plotted: the lowest
  temperature's (greedy when run), the best gamma's speedup."""
  temp = min(r["temperature"] for r in records)
  out: dict[tuple[str, str, int, int], Record] = {}
  for r in records:
    k = (engine_of(r), r["drafter"], r["context"], r["batch"])
    if r["temperature"] == temp and (k not in out or r["speedup"] > out[k]["speedup"]):
      out[k] = r
  return out


def curves(records: Sequence[Record], fit: SurfaceFit | None = None) -> list[Panel]:
  """The panels (module docstring): each measured engine's (XLA first), a
  panel per drafter, then per other engine of the fit its drafters'
  predicted-only panels, at the first measured engine's points."""
  pts = chosen(records)
  drafters = sorted({d for _, d, _, _ in pts})
  ran = sorted({e for e, _, _, _ in pts}, key=lambda e: (e != MEASURED, e))
  engines = ran + sorted(set(fit.models) - set(ran) if fit else ())
  panels = []
  for e in engines:
    measured = e in ran
    src = e if measured else ran[0]  # a predicted-only panel: at the measured points
    for d in drafters:
      if (not measured and not fit.has(e, d)) or not any(k[:2] == (src, d) for k in pts):
        continue
      lines = []
      for c in sorted({k[2] for k in pts if k[:2] == (src, d)}):
        rs = [pts[k] for k in sorted(pts) if k[:3] == (src, d, c)]
        bs = tuple(r["batch"] for r in rs)
        pred = tuple(fit.speedup(e, r) for r in rs) if fit and fit.has(e, d) else None
        lines.append(Curve(
            c, bs, tuple(r["speedup"] for r in rs) if measured else None,
            tuple(r.get("predicted_measured_cost") for r in rs) if measured else None, pred,
            tuple(fit.kv_share(e, c, b) for b in bs) if fit and e in fit.models else None))
      panels.append(Panel(e, d, tuple(lines)))
  return panels


def plot(records: Sequence[Record], path: str, fit: SurfaceFit | None = None) -> None:
  """contexts.png: `curves` drawn, a row per drafter, a column per engine
  (its panels sharing the speedup axis)."""
  plt = wd.pyplot()
  panels = curves(records, fit)
  engines = list(dict.fromkeys(p.engine for p in panels))
  drafters = list(dict.fromkeys(p.drafter for p in panels))
  fig, axes = plt.subplots(len(drafters), len(engines), figsize=(5.6 * len(engines),
                                                                 4.2 * len(drafters)),
                           squeeze=False, sharey="row")
  for i, d in enumerate(drafters):
    for j, e in enumerate(engines):
      p = next((p for p in panels if (p.engine, p.drafter) == (e, d)), None)
      if p is None:
        axes[i][j].axis("off")
      else:
        draw(axes[i][j], p)
  wd.save_figure(fig, path)


def draw(ax, p: Panel) -> None:
  """One panel: per context, measured o-, the measured-cost prediction s--,
  the fit's ^-., the crossover ringed; the fit's KV share : on the right."""
  twin = ax.twinx() if any(c.kv_share for c in p.curves) else None
  for i, c in enumerate(p.curves):
    color, xs, tag = f"C{i}", list(c.batches), f"{c.context}"
    series = ((c.measured, "o-", f"{tag} measured" + (f": {c.turn}" if c.turn else "")),
              (c.predicted_cost, "s--", f"{tag} predicted, measured costs"),
              (c.predicted_fit, "^-.", f"{tag} predicted, surface fit"
               + (f": {c.fit_turn}" if c.fit_turn else "")))
    for ys, style, label in series:
      if ys is not None and all(y is not None for y in ys):
        ax.plot(xs, ys, style, color=color, label=label, ms=4)
    b = cc.turning_batch(xs, c.main) if c.turn and c.turn != "never rises" else None
    if b is not None:
      ax.plot([b], [c.main[xs.index(b)]], "o", ms=13, mfc="none", mec=color, mew=1.5)
    if twin is not None and c.kv_share and all(v is not None for v in c.kv_share):
      twin.plot(xs, c.kv_share, ":", color=color, lw=1.2)
      ax.plot([], [], ":", color=color, label=f"{tag} KV share of T(B, 1), fit (right)")
  if twin is not None:
    twin.set_ylim(0, 1)
    twin.set_ylabel("KV share of the target's decode step (fit)", fontsize=8)
  ax.axhline(1.0, color="grey", lw=0.8)
  ax.set_title(p.title, fontsize=9)
  ax.set_xlabel("batch")
  ax.set_ylabel("speedup (best gamma; ring: where it turns)")
  ax.grid(alpha=0.3)
  ax.legend(fontsize=7, loc="lower right")
