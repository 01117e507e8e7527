"""The gamma sweep's batch outputs: speedup against the batch
(speedup_vs_batch.png), the best gamma per (batch, alpha) from the measured
cost surface (best_gamma.png), the verify surface T(B, n) / T(B, 1)
(verify_surface.png and .csv), the crossover batch, auto gamma against
the fixed gammas and per-row lengths against both (rows_report.py; the
summary's batch section)."""

from __future__ import annotations

import math
import os
import statistics
from typing import Any

import numpy as np

from specjax import workdir as wd
from specjax.bench.sweep import engine, rows_report


def fmt(x, spec=".2f") -> str:
  return "-" if x is None else format(x, spec)


def is_auto(r) -> bool:
  return r["gamma"] == "auto"


is_rows = rows_report.is_rows


def is_fixed(r) -> bool:
  """A fixed gamma's point (not auto, not per-row lengths)."""
  return not is_auto(r) and not is_rows(r)


def _settings(records):
  return sorted({(r["accept_rule"], r["temperature"]) for r in records})


def plot_speedup_vs_batch(path: str, records) -> None:
  """Speedup against B, one colour per gamma: measured markers, the tail
  model's prediction as lines, auto gamma as black stars, per-row lengths
  with their allocator's prediction and the oracle bound at the step costs
  they ran (predicted_rows); one panel per (rule, T)."""
  plt = wd.pyplot()
  settings = _settings(records)
  fig, axes = plt.subplots(1, len(settings), figsize=(6.5 * len(settings), 5), squeeze=False)
  gammas = sorted({r["gamma"] for r in records if is_fixed(r)})
  colors = plt.cm.viridis(np.linspace(0, 0.9, max(len(gammas), 1)))
  for ax, (acc, temp) in zip(axes[0], settings):
    rs = [r for r in records if (r["accept_rule"], r["temperature"]) == (acc, temp)]
    for g, col in zip(gammas, colors):
      pts = sorted((r for r in rs if r["gamma"] == g), key=lambda r: r["batch"])
      b = [r["batch"] for r in pts]
      ax.plot(b, [r["speedup"] for r in pts], "o", color=col, ms=7, label=f"gamma {g}: measured")
      ax.plot(b, [r["predicted_tail"] for r in pts], "-", color=col, lw=1.5)
    auto = sorted((r for r in rs if is_auto(r)), key=lambda r: r["batch"])
    if auto:
      ax.plot([r["batch"] for r in auto], [r["speedup"] for r in auto], "k*", ms=11,
              label="auto gamma: measured")
    for spec, marker in zip(sorted({r["gamma"] for r in rs if is_rows(r)}), "DPXsp^v<>"):
      pts = sorted((r for r in rs if r["gamma"] == spec), key=lambda r: r["batch"])
      b = [r["batch"] for r in pts]
      ax.plot(b, [r["speedup"] for r in pts], marker, color="C3",
              ms=8, mfc="none", label=f"{rows_report.label(spec)}: measured")
      if all(r.get("predicted_rows") for r in pts):
        ax.plot(b, [r["predicted_rows"]["predicted"] for r in pts], "-", color="C3", lw=1.2,
                label=f"{rows_report.label(spec)}: predicted (allocator)")
        ax.plot(b, [r["predicted_rows"]["oracle"] for r in pts], ":", color="C3", lw=1.2,
                label=f"{rows_report.label(spec)}: oracle bound")
    ax.axhline(1.0, color="red", lw=1, ls="--", label="1x (no gain)")
    ax.plot([], [], "k-", label="predicted (measured costs at B, tail model)")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("batch B (rows)")
    ax.set_ylabel("speedup over target-only at the same B (x)")
    ax.set_title(f"{acc}, T={temp:g}")
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=7)
  wd.save_figure(fig, path)


ALPHA_GRID = np.round(np.arange(0.1, 0.96, 0.05), 2)


def best_gamma_map(costs: dict[str, Any], gammas, n_tokens: int | None):
  """(batches, alphas, best gamma [B, alpha], its predicted speedup) from the
  measured cost surface (engine.choose_gamma, for the drafter the costs were
  measured with: only a draft model pays the catch-up)."""
  drafter = costs.get("drafter", "model")
  bc = {int(b): engine.BatchCosts.from_dict(d) for b, d in costs["batches"].items()}
  bs = sorted(bc)
  best = np.zeros((len(bs), len(ALPHA_GRID)), int)
  speed = np.zeros(best.shape)
  for i, b in enumerate(bs):
    for j, a in enumerate(ALPHA_GRID):
      pred = engine.predicted_gamma_speedups(bc[b], float(a), gammas, n_tokens, drafter=drafter)
      g = engine.choose_gamma(bc[b], float(a), gammas, n_tokens, drafter=drafter)
      best[i, j], speed[i, j] = g, pred[g]
  return bs, ALPHA_GRID, best, speed


def plot_best_gamma(path: str, bs, alphas, best, speed) -> None:
  plt = wd.pyplot()
  fig, ax = plt.subplots(figsize=(max(7, 0.55 * len(alphas)), 0.6 * len(bs) + 2))
  im = ax.imshow(np.log2(speed), aspect="auto", cmap="RdBu", vmin=-2, vmax=2, origin="lower")
  for i in range(len(bs)):
    for j in range(len(alphas)):
      ax.text(j, i, str(best[i, j]), ha="center", va="center", fontsize=8,
              color="black" if abs(np.log2(speed[i, j])) < 1.2 else "white")
  ax.set_xticks(range(len(alphas)), [f"{a:.2f}" for a in alphas], rotation=60, fontsize=7)
  ax.set_yticks(range(len(bs)), [str(b) for b in bs])
  ax.set_xlabel("alpha (per-token acceptance)")
  ax.set_ylabel("batch B")
  ax.set_title("Best gamma (number) and its predicted speedup (colour, log2) from measured costs")
  fig.colorbar(im, ax=ax, label="log2 predicted speedup (0 = 1x)")
  wd.save_figure(fig, path)


def verify_surface(costs: dict[str, Any]):
  """(batches, ns, T(B, n) / T(B, 1))."""
  bd = costs["batches"]
  bs = sorted(int(b) for b in bd)
  ns = sorted({int(n) for d in bd.values() for n in d["t_target_s"]})
  ratio = np.array([[bd[str(b)]["t_target_s"][str(n)] / bd[str(b)]["t_target_s"]["1"]
                     for n in ns] for b in bs])
  return bs, ns, ratio


def plot_verify_surface(path: str, bs, ns, ratio, title: str = "Verify cost T(B, n) / T(B, 1)") -> None:
  plt = wd.pyplot()
  fig, ax = plt.subplots(figsize=(1.0 * len(ns) + 3, 0.6 * len(bs) + 2))
  im = ax.imshow(ratio, aspect="auto", cmap="magma_r", origin="lower")
  for i in range(len(bs)):
    for j in range(len(ns)):
      ax.text(j, i, f"{ratio[i, j]:.2f}", ha="center", va="center", fontsize=8,
              color="white" if ratio[i, j] > 0.6 * ratio.max() else "black")
  ax.set_xticks(range(len(ns)), [str(n) for n in ns])
  ax.set_yticks(range(len(bs)), [str(b) for b in bs])
  ax.set_xlabel("n tokens per row in one target forward")
  ax.set_ylabel("batch B")
  ax.set_title(title)
  fig.colorbar(im, ax=ax, label="T(B, n) / T(B, 1)")
  wd.save_figure(fig, path)


def crossover(points: list[tuple[int, float]]) -> int | None:
  """The first batch (ascending) whose speedup is below 1, None if none."""
  for b, s in sorted(points):
    if s < 1.0:
      return b
  return None


def _gmean(xs) -> float:
  xs = [x for x in xs if x and x > 0]
  return math.exp(sum(math.log(x) for x in xs) / len(xs)) if xs else float("nan")


def batch_markdown(records, costs, n_tokens, best=None) -> list[str]:
  fixed = [r for r in records if is_fixed(r)]
  auto = [r for r in records if is_auto(r)]
  gammas = sorted({r["gamma"] for r in fixed})
  out = ["", "## Batches: the batch x gamma surface", "",
         "Every point runs target-only and speculative generation on the same B ragged rows "
         "(tokens/s summed over rows). predicted = the measured-cost model at B (costs measured "
         "at B) with the tail model's expected loop steps: the loop runs until its slowest row "
         "is done, P(max <= s) = P(row <= s)^B.", "",
         "| B | gamma | accept rule | T | base t/s | spec t/s | speedup | predicted | "
         "steps (meas.) | steps (pred.) | T(B,g+1)/T(B,1) | efficiency | gammas used |",
         "|" + "---|" * 13]
  for r in sorted(fixed + auto, key=lambda r: (r["temperature"], r["accept_rule"], r["batch"],
                                               99 if is_auto(r) else r["gamma"])):
    cell = lambda k, spec=".3f": fmt(r.get(k), spec)
    used = ("-" if not is_auto(r) else
            " ".join(f"{g}:{n}" for g, n in r["gammas_used"].items() if n))
    out.append("| " + " | ".join([
        str(r["batch"]), str(r["gamma"]), r["accept_rule"], f"{r['temperature']:g}",
        f"{r['baseline_tps']:.1f}", f"{r['spec_tps']:.1f}", f"{r['speedup']:.3f}",
        cell("predicted_tail"), cell("steps_measured", ".1f"), cell("steps_predicted", ".1f"),
        cell("verify_ratio", ".2f"), cell("efficiency_tail"), used]) + " |")
  out += ["", "### Crossover: the first batch where speculative decoding is slower (speedup < 1)",
          "", "| accept rule | T | gamma | measured | predicted |", "|---|---|---|---|---|"]
  for acc, temp in _settings(fixed):
    for g in gammas:
      rs = [r for r in fixed if (r["accept_rule"], r["temperature"], r["gamma"]) == (acc, temp, g)]
      m = crossover([(r["batch"], r["speedup"]) for r in rs])
      p = crossover([(r["batch"], r["predicted_tail"]) for r in rs])
      show = lambda b: "none (>= 1x at every B)" if b is None else f"B = {b}"
      out.append(f"| {acc} | {temp:g} | {g} | {show(m)} | {show(p)} |")
  if auto:
    out += ["", "### Auto gamma against the fixed gammas", "",
            "Per point: auto's speedup over the best fixed gamma in hindsight (goal >= 0.95).", "",
            "| B | accept rule | T | auto | best fixed (gamma) | auto / best | gammas used |",
            "|---|---|---|---|---|---|---|"]
    ratios = []
    for r in sorted(auto, key=lambda r: (r["temperature"], r["accept_rule"], r["batch"])):
      rs = [f for f in fixed if (f["batch"], f["accept_rule"], f["temperature"]) ==
            (r["batch"], r["accept_rule"], r["temperature"])]
      if not rs:
        continue
      bf = max(rs, key=lambda f: f["speedup"])
      ratios.append(r["speedup"] / bf["speedup"])
      used = " ".join(f"{g}:{n}" for g, n in r["gammas_used"].items() if n)
      out.append(f"| {r['batch']} | {r['accept_rule']} | {r['temperature']:g} | "
                 f"{r['speedup']:.3f} | {bf['speedup']:.3f} ({bf['gamma']}) | "
                 f"{ratios[-1]:.3f} | {used} |")
    keys = {(r["batch"], r["accept_rule"], r["temperature"]) for r in auto}
    gm = {g: _gmean([f["speedup"] for f in fixed if f["gamma"] == g and
                     (f["batch"], f["accept_rule"], f["temperature"]) in keys]) for g in gammas}
    ga = _gmean([r["speedup"] for r in auto])
    if ratios:
      out += ["", f"- auto / best fixed: median {statistics.median(ratios):.3f}, min "
              f"{min(ratios):.3f}; within 5% at {sum(x >= 0.95 for x in ratios)} of "
              f"{len(ratios)} points.",
              "- Across the whole sweep (geometric mean of the speedups over the auto points' "
              "(B, rule, T)): auto " + f"{ga:.3f}; " + ", ".join(
                  f"gamma {g} {v:.3f}" for g, v in gm.items()) + ". Auto beats every single "
              f"fixed gamma: {'yes' if all(ga > v for v in gm.values()) else 'no'}."]
  out += rows_report.rows_markdown(records)
  if best is not None:
    bs, alphas, bg, _ = best
    out += ["", "### Best gamma per (B, alpha) from the measured costs (best_gamma.png)", "",
            "| B | " + " | ".join(f"{a:.2f}" for a in alphas[::2]) + " |",
            "|---|" + "---|" * len(alphas[::2])]
    for i, b in enumerate(bs):
      out.append(f"| {b} | " + " | ".join(str(x) for x in bg[i, ::2]) + " |")
  return out + [""]


def write_batch_report(workdir: str, records, costs, n_tokens: int | None) -> str:
  """speedup_vs_batch.png, best_gamma.png, verify_surface.png (and
  verify_surface.csv) and the summary's batch section."""
  fixed = [r for r in records if is_fixed(r)]
  if fixed:
    plot_speedup_vs_batch(os.path.join(workdir, "speedup_vs_batch.png"), records)
  best = None
  if "batches" in costs:
    gammas = sorted({int(r["gamma"]) for r in fixed}) or sorted(
        int(g) for g in next(iter(costs["batches"].values()))["t_accept_s"])
    best = best_gamma_map(costs, gammas, n_tokens)
    plot_best_gamma(os.path.join(workdir, "best_gamma.png"), *best)
    bs, ns, ratio = verify_surface(costs)
    plot_verify_surface(os.path.join(workdir, "verify_surface.png"), bs, ns, ratio)
    wd.write_csv(os.path.join(workdir, "verify_surface.csv"),
                 [{"batch": b, **{str(n): ratio[i, j] for j, n in enumerate(ns)}}
                  for i, b in enumerate(bs)], ["batch"] + [str(n) for n in ns])
  return "\n".join(batch_markdown(records, costs, n_tokens, best))
