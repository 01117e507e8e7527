"""The cost surface's report: the table (XLA and PyTorch side by side, their
ratio, the bytes read, the peak memory), the fitted context model of each
step (metrics/context_cost.py: the target's weights and KV terms, each
draft's weights term beside the target's kappa), the predicted batch where
speculation's speedup turns, per context, and the plot (T against the
context, a line per batch, the KV share of the fitted step on a second
axis). docs/long_context.md."""

from __future__ import annotations

import os
from typing import Sequence

import numpy as np

from specjax import workdir as wd
from specjax.bench import tables
from specjax.bench.studies import cost_surface as cs
from specjax.bench.sweep import context_plot
from specjax.drafters import registry
from specjax.drafters import streaming
from specjax.errors import SpecjaxError
from specjax.metrics import context_cost as cc


def points(recs: Sequence[wd.Record], engine: str, role: str) -> list[cc.Point]:
  return [cc.Point(r["batch"], r["n"], r["kv_bytes"], r["seconds"])
          for r in cs.measured(recs) if r["engine"] == engine and r["role"] == role]


def fits(recs: Sequence[wd.Record], engine: str) -> dict[str, cc.StepModel]:
  """{role: its model}: the target's with kappa fitted; each draft's with
  the target's kappa (its KV read costs what the target's does)."""
  out = {"target": cc.fit(points(recs, engine, "target"))}
  for role in sorted({r["role"] for r in cs.measured(recs) if r["engine"] == engine} - {"target"}):
    out[role] = cc.fit(points(recs, engine, role), kappa=out["target"].kappa)
  return out


def reads(cfg, role: str, dcfg=None) -> cc.Reads:
  """What a step of `role` reads per slot and how many slots (the theory's
  view of cost_surface.draft_reads)."""
  if role == "target":
    return cc.Reads(cs.slot_bytes(cfg))
  d = registry.parse(role)
  if isinstance(d, streaming.StreamingDrafter):
    return cc.Reads(cs.slot_bytes(cfg), window=d.sinks + d.window)
  return cc.Reads(cs.slot_bytes(dcfg))


def surface_fit(recs: Sequence[wd.Record]) -> context_plot.SurfaceFit:
  """Every engine's fits (those that fit) and what each role's step reads,
  its slot bytes taken from the records (kv_bytes / (B x kv_slots)): the
  predictions the sweeps' contexts.png draws (bench/sweep/context_plot.py)."""
  models = {}
  for e in sorted({r["engine"] for r in cs.measured(recs)}):
    try:
      models[e] = fits(recs, e)
    except SpecjaxError:
      continue
  out = {}
  for r in cs.measured(recs):
    if r["role"] not in out:
      d = None if r["role"] == "target" else registry.parse(r["role"])
      window = d.sinks + d.window if isinstance(d, streaming.StreamingDrafter) else None
      out[r["role"]] = cc.Reads(r["kv_bytes"] / (r["batch"] * r["kv_slots"]), window=window)
  return context_plot.SurfaceFit(models, out)

def crossovers(models: dict[str, cc.StepModel], cfg, dcfgs: dict, contexts: Sequence[int],
               alphas: Sequence[float], gamma: int, batches: Sequence[int]) -> list[wd.Record]:
  """Per drafter, alpha and context: the predicted speedup along the batch
  and the batch where it turns (context_cost.turning_batch)."""
  rows = []
  for role, model in models.items():
    if role == "target":
      continue
    for alpha in alphas:
      for c in contexts:
        try:
          sp = cc.speedups(models["target"], model, reads(cfg, "target"),
                           reads(cfg, role, dcfgs.get(role)), alpha, gamma, c, batches)
        except SpecjaxError as e:
          rows.append({"drafter": role, "alpha": alpha, "context": c, "error": str(e)})
          continue
        rows.append({"drafter": role, "alpha": alpha, "context": c, "gamma": gamma,
                     "batches": list(batches), "speedups": [float(x) for x in sp],
                     "turning_batch": cc.turning_batch(batches, sp)})
  return rows


def sensitivity(models: dict[str, cc.StepModel], cfg, contexts: Sequence[int], alpha: float,
                gammas: Sequence[int], windows: Sequence[int], batches: Sequence[int]) -> str:
  """How the turn moves with W and gamma (at one alpha), per context: the
  first streaming drafter's fit with its window replaced (its KV term at
  the target's kappa)."""
  role = next((r for r in models if r.startswith("streaming")), None)
  if role is None:
    return ""
  sinks, rows = registry.parse(role).sinks, []
  for w in windows:
    for g in gammas:
      if g + 1 > models["target"].ns[-1]:
        continue
      for c in contexts:
        try:
          sp = cc.speedups(models["target"], models[role], reads(cfg, "target"),
                           cc.Reads(cs.slot_bytes(cfg), window=sinks + w), alpha, g, c, batches)
        except SpecjaxError:
          continue
        rows.append([w, g, c, f"{sp[0]:.2f}", f"{sp[-1]:.2f}",
                     cc.turning_batch(batches, sp) or "none"])
  return tables.markdown_table(["W", "gamma", "context", f"B={batches[0]}", f"B={batches[-1]}",
                                "turns at B"], rows)


def surface_table(recs: Sequence[wd.Record]) -> str:
  """One row per (context, batch, role, N): both engines' ms, torch / XLA,
  the weights and KV read (XLA's; torch reads its whole capacity), peak."""
  by = {}
  for r in cs.measured(recs):
    by.setdefault((r["context"], r["batch"], r["role"], r["n"]), {})[r["engine"]] = r
  rows = []
  for (c, b, role, n), e in sorted(by.items(), key=lambda kv: (kv[0][0], kv[0][1],
                                                               kv[0][2] != "target", kv[0])):
    x, t = e.get("xla"), e.get("torch")
    ms = lambda r: "-" if r is None else f"{1e3 * r['seconds']:.1f}"
    ratio = "-" if x is None or t is None else f"{t['seconds'] / x['seconds']:.2f}"
    any_r = x or t
    rows.append([c, b, role, n, ms(x), ms(t), ratio, tables.format_size(any_r["weight_bytes"]),
                 tables.format_size(any_r["kv_bytes"]),
                 "-" if t is None else tables.format_size(t["kv_bytes"]),
                 "-" if any_r.get("peak_rss_bytes") is None
                 else tables.format_size(any_r["peak_rss_bytes"])])
  return tables.markdown_table(
      ["context", "B", "step", "N", "XLA ms", "torch ms", "torch/XLA", "weights",
       "KV read (XLA)", "KV read (torch)", "peak RSS"], rows,
      right=[True, True, False, True, True, True, True, True, True, True, True])


def fit_table(models: dict[str, dict[str, cc.StepModel]], recs) -> str:
  rows = []
  for engine, ms in models.items():
    for role, m in ms.items():
      err = cc.relative_errors(m, points(recs, engine, role))
      for n, w0, w1 in zip(m.ns, m.w0, m.w1):
        rows.append([engine, role, n, f"{1e3 * w0:.2f}", f"{1e3 * w1:.2f}",
                     f"{1e12 * m.kappa:.1f}", f"{100 * np.max(np.abs(err)):.0f}%"])
  return tables.markdown_table(["engine", "step", "N", "w0 ms", "w1 ms/row", "kappa ms/GB",
                                "max |error|"], rows,
                               right=[False, False, True, True, True, True, True])


def crossover_table(rows: Sequence[wd.Record], engine: str) -> str:
  fine = [r for r in rows if "error" not in r]
  shown = [b for b in (1, 4, 8, 16, 32) if fine and b in fine[0]["batches"]]
  out = []
  for r in rows:
    if "error" in r:
      out.append([engine, r["drafter"], r["alpha"], r["context"], r["error"]]
                 + [""] * len(shown))
      continue
    sp = dict(zip(r["batches"], r["speedups"]))
    out.append([engine, r["drafter"], r["alpha"], r["context"]]
               + [f"{sp[b]:.2f}" for b in shown] + [r["turning_batch"] or "none"])
  return tables.markdown_table(["engine", "drafter", "alpha", "context"]
                               + [f"B={b}" for b in shown] + ["turns at B"], out)


def plot(recs: Sequence[wd.Record], models: dict, cfg, dcfgs: dict, path) -> None:
  """T against the context, a line per batch, a panel per (engine, step);
  the fitted model's KV share dashed on the right axis."""
  plt = wd.pyplot()
  rec = cs.measured(recs)
  panels = sorted({(r["engine"], r["role"], r["n"]) for r in rec},
                  key=lambda k: (k[0], k[1] != "target", k))
  cols = 3
  rows = -(-len(panels) // cols)
  fig, axes = plt.subplots(rows, cols, figsize=(5 * cols, 3.6 * rows), squeeze=False)
  for ax, (engine, role, n) in zip(axes.flat, panels):
    twin = ax.twinx()
    for i, b in enumerate(sorted({r["batch"] for r in rec})):
      pts = sorted((r["context"], r["seconds"], r["kv_bytes"]) for r in rec
                   if (r["engine"], r["role"], r["n"], r["batch"]) == (engine, role, n, b))
      if not pts:
        continue
      c, t, kv = (np.asarray(x, float) for x in zip(*pts))
      ax.plot(c, 1e3 * t, "o-", color=f"C{i}", label=f"B={b}")
      m = models.get(engine, {}).get(role)
      if m is not None:
        twin.plot(c, m.kv_share(b, n, kv), "--", color=f"C{i}", alpha=0.6)
    twin.set_ylim(0, 1)
    twin.set_ylabel("KV share (fit, dashed)")
    ax.set_title(f"{engine}: {role}" + (f" N={n}" if role == "target" else " (one draft step)"),
                 fontsize=9)
    ax.set_xlabel("context (tokens)")
    ax.set_ylabel("ms per step")
    ax.legend(fontsize=7, loc="upper left")
  for ax in list(axes.flat)[len(panels):]:
    ax.axis("off")
  wd.save_figure(fig, path)


def write(work, recs: Sequence[wd.Record], cfg, dcfgs: dict, s: cs.Settings,
          alphas: Sequence[float], batches: Sequence[int], env: wd.Record) -> str:
  """summary.md, crossover.json and surface.png in `work`; returns the summary."""
  models, unfitted = {}, []
  for e in s.engines:
    try:
      models[e] = fits(recs, e)
    except SpecjaxError as err:  # e.g. one capacity for every context: torch reads it all
      unfitted.append(f"{e}: not fitted ({err})")
  cross = {e: crossovers(m, cfg, dcfgs, s.contexts, alphas, s.gamma, batches)
           for e, m in models.items()}
  wd.write_json(os.path.join(work, "crossover.json"),
                {"fits": {e: {r: vars(m) for r, m in ms.items()} for e, ms in models.items()},
                 "crossovers": cross})
  plot(recs, models, cfg, dcfgs, os.path.join(work, "surface.png"))
  refused = [r["refused"] for r in recs if "refused" in r]
  text = [f"# The cost surface T(B, N, context): {s.model} ({s.dtype})", "",
          f"Machine: {wd.machine_line(env)}; medians of {s.reps} alternating repetitions, "
          f"{s.k} steps a call; torch {'compiled' if s.torch_compile else 'eager'}.", "",
          surface_table(recs), ""]
  text += ["Refused before running:", ""] + [f"- {r}" for r in refused] + [""] if refused else []
  text += ["## The fitted model: T = w0(N) + w1(N) B + kappa KV bytes", "", fit_table(models, recs),
           ""] + [f"- {u}" for u in unfitted] + ["", f"## Predicted speedup along the batch (gamma {s.gamma}, geometric alpha)", ""]
  text += [crossover_table(cross[e], e) + "\n" for e in cross]
  for e in cross:
    table = sensitivity(models[e], cfg, s.contexts, max(alphas), (2, 4), (64, 256, 1024), batches)
    if table:
      text += [f"### {e}: the turn against W and gamma (streaming, alpha {max(alphas)})", "",
               table, ""]
  out = "\n".join(text)
  with open(os.path.join(work, wd.SUMMARY), "w") as f:
    f.write(out)
  return out
