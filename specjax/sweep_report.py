"""Plots and summary.md for a finished (or partial) sweep (records: specjax.schema)."""

from __future__ import annotations

import math
import os
import statistics
from typing import Any

import matplotlib.ticker
import numpy as np

from specjax import workdir as wd

plt = wd.pyplot()

EFFICIENCY_FLOOR = 0.90


def _log_err(measured: float, predicted: float) -> float:
  return abs(math.log(measured / predicted)) if measured > 0 and predicted > 0 else math.inf


def plot_speedup(path: str, records: list[dict[str, Any]]) -> None:
  """Speedup vs gamma: measured markers, predictions as lines, a colour per setting."""
  settings = sorted({(r["accept_rule"], r["temperature"]) for r in records})
  fig, ax = plt.subplots(figsize=(8, 5.5))
  colors = plt.cm.tab10(np.linspace(0, 1, 10))
  for i, (acc, temp) in enumerate(settings):
    rs = sorted((r for r in records if (r["accept_rule"], r["temperature"]) == (acc, temp)),
                key=lambda r: r["gamma"])
    g = [r["gamma"] for r in rs]
    col = colors[i % 10]
    label = acc if len({t for _, t in settings}) == 1 else f"{acc} T={temp:g}"
    ax.plot(g, [r["speedup"] for r in rs], "o", color=col, ms=7, label=f"{label}: measured")
    ax.plot(g, [r["predicted_measured_cost"] for r in rs], "-", color=col, lw=1.5)
    ax.plot(g, [r["predicted_leviathan"] for r in rs], ":", color=col, lw=1.5)
  ax.axhline(1.0, color="gray", lw=0.8)
  ax.plot([], [], "k-", label="measured-cost model")
  ax.plot([], [], "k:", label="Leviathan Thm 3.8 (measured alpha, c)")
  ax.set_xlabel("gamma (draft tokens per step)")
  ax.set_ylabel("speedup over target-only (x)")
  ax.set_yscale("log")
  ax.yaxis.set_major_formatter(matplotlib.ticker.FormatStrFormatter("%.2g"))
  ax.yaxis.set_minor_formatter(matplotlib.ticker.FormatStrFormatter("%.2g"))
  ax.set_title("Speculative speedup: measured vs predicted")
  ax.legend(fontsize=7, loc="best")
  ax.grid(alpha=0.3, which="both")
  wd.save_figure(fig, path)


def plot_verify_cost(path: str, costs: dict[str, Any]) -> None:
  """T_target(n) / T_target(1) against n, with the flat and linear references."""
  ratios = {int(k): v for k, v in costs["verify_ratio"].items()}
  n = sorted(ratios)
  fig, ax = plt.subplots(figsize=(6.5, 4.5))
  ax.plot(n, [ratios[k] for k in n], "o-", label="measured T(n)/T(1)")
  ax.plot(n, n, "--", color="gray", label="linear: n")
  ax.axhline(1.0, color="gray", ls=":", label="ideal: flat")
  ax.set_xlabel("n tokens in one target forward")
  ax.set_ylabel("T(n) / T(1)")
  ax.set_title("Verify cost (target forward over n tokens)")
  ax.legend()
  ax.grid(alpha=0.3)
  wd.save_figure(fig, path)


def _iid_records(records):
  """Points whose acceptance is random (real or Bernoulli), with a geometric check."""
  return [r for r in records if "geometric" in r and r["geometric"]["observed"]
          and (r["accept_rule"] == "real" or r["accept_rule"].startswith("bernoulli"))]


def plot_acceptance(path: str, records: list[dict[str, Any]]) -> None:
  """Alpha per draft position, and accepted lengths against the geometric law."""
  rs = _iid_records(records)
  settings = sorted({(r["accept_rule"], r["temperature"]) for r in rs})
  fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4.5))
  colors = plt.cm.tab10(np.linspace(0, 1, 10))
  width = 0.8 / max(len(settings), 1)
  for i, (acc, temp) in enumerate(settings):
    pts = [r for r in rs if (r["accept_rule"], r["temperature"]) == (acc, temp)]
    r = max(pts, key=lambda x: x["gamma"])  # the longest draft shows the most positions
    col, label = colors[i % 10], f"{acc} T={temp:g}"
    pos = [(j + 1, a) for j, a in enumerate(r["alpha_at_pos"]) if a is not None]
    ax1.plot([p for p, _ in pos], [a for _, a in pos], "o-", color=col,
             label=f"{label} (gamma {r['gamma']})")
    ax1.axhline(r["alpha"], color=col, ls=":", lw=1)
    g = r["geometric"]
    k = np.arange(len(g["observed"]))
    ax2.bar(k + (i - (len(settings) - 1) / 2) * width, g["observed"], width, color=col,
            alpha=0.7, label=f"{label}: measured")
    ax2.plot(k, g["expected"], "_", color=col, ms=18, mew=2.5)
  ax1.set_xlabel("draft position i")
  ax1.set_ylabel("P(accept i | reached i)")
  ax1.set_title("Alpha per draft position (dotted: i.i.d. alpha)")
  ax1.set_ylim(0, 1.02)
  ax1.grid(alpha=0.3)
  ax1.legend(fontsize=7)
  ax2.plot([], [], "k_", ms=14, mew=2.5, label="capped geometric at the mean alpha")
  ax2.set_xlabel("draft tokens accepted in a step (k)")
  ax2.set_ylabel("share of steps")
  ax2.set_title("Accepted lengths vs the i.i.d. law")
  ax2.legend(fontsize=7)
  ax2.grid(alpha=0.3, axis="y")
  wd.save_figure(fig, path)


def acceptance_markdown(records: list[dict[str, Any]]) -> list[str]:
  """Per-position alpha and the geometric check, for real and Bernoulli points."""
  rs = sorted(_iid_records(records), key=lambda r: (r["temperature"], r["accept_rule"], r["gamma"]))
  if not rs:
    return []
  out = ["## Acceptance against the i.i.d. assumption", "",
         "alpha at position i = P(draft i accepted | drafts 1..i-1 accepted). The theory "
         "assumes one alpha for every position, hence a capped geometric law of accepted "
         "lengths; TV = total-variation distance between the measured and that law, p = "
         "chi-square goodness of fit (small p: not geometric).", "",
         "| gamma | accept rule | T | prompts | steps | alpha (i.i.d.) | alpha per position | "
         "TV | chi2 (dof) | p |", "|---|---|---|---|---|---|---|---|---|---|"]
  for r in rs:
    g = r["geometric"]
    pos = ", ".join("-" if a is None else f"{a:.2f}" for a in r["alpha_at_pos"])
    chi = "-" if g["chi2"] is None else f"{g['chi2']:.1f} ({g['dof']})"
    p = "-" if g["p"] is None else f"{g['p']:.2g}"
    out.append(f"| {r['gamma']} | {r['accept_rule']} | {r['temperature']:g} | {r.get('n_prompts', 1)} | "
               f"{r['n_steps']} | {r['alpha']:.3f} | {pos} | {_fmt(g['tv'], '.3f')} | "
               f"{chi} | {p} |")
  return out + [""]


def _fmt(x, spec=".2f") -> str:
  return "-" if x is None else format(x, spec)


def summary_markdown(records: list[dict[str, Any]], costs: dict[str, Any], env: dict[str, Any]) -> str:
  rs = sorted(records, key=lambda r: (r["temperature"], r["accept_rule"], r["gamma"]))
  lines = [f"# Sweep: {rs[0]['target']} (target) / {rs[0]['draft']} (draft), "
           f"{rs[0]['precision']}" if rs else "# Sweep", "",
           f"Machine: {wd.machine_line(env)}.", ""]
  t1 = costs["t_target_s"]["1"]
  lines += [f"Measured costs (greedy) at cache capacity {costs['capacity']}: T_target(1) = "
            f"{1e3 * t1:.2f} ms, T_draft(1) = {1e3 * costs['t_draft_s']:.2f} ms, "
            f"c = {costs['c']:.3f}. Verify cost T(n)/T(1): " + ", ".join(
                f"{k}: {v:.2f}" for k, v in sorted(costs["verify_ratio"].items(),
                                                   key=lambda kv: int(kv[0]))) + ". "
            "The verify ratio T(gamma+1)/T(1) is what most separates machines: a speedup "
            "measured on one machine transfers to another only with its verify ratio "
            "(column `T(g+1)/T(1)`, measured at each point with its sampling settings).", ""]
  head = ["gamma", "accept rule", "T", "base t/s", "spec t/s", "speedup", "accept %", "mean acc",
          "alpha", "T(g+1)/T(1)", "Leviathan", "thread", "meas.-cost", "efficiency",
          "draft/verify/accept/rest %"]
  lines += ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
  for r in rs:
    split = "/".join(f"{100 * r[k]:.0f}" for k in ("draft_share", "verify_share",
                                                   "accept_share", "rest_share") if k in r)
    lines.append("| " + " | ".join([
        str(r["gamma"]), r["accept_rule"], f"{r['temperature']:g}", f"{r['baseline_tps']:.2f}",
        f"{r['spec_tps']:.2f}", f"{r['speedup']:.3f}", f"{100 * r['accept_rate']:.1f}",
        f"{r['mean_accepted']:.2f}", f"{r['alpha']:.3f}", f"{r['verify_ratio']:.2f}",
        f"{r['predicted_leviathan']:.3f}", f"{r['predicted_thread']:.3f}",
        f"{r['predicted_measured_cost']:.3f}", f"{r['efficiency']:.3f}", split or "-"]) + " |")
  lines += ["", *acceptance_markdown(rs), *verdict(rs)]
  return "\n".join(lines) + "\n"


def verdict(rs: list[dict[str, Any]]) -> list[str]:
  """Which prediction explains the measurements, and the points that fall short."""
  if not rs:
    return ["No points yet."]
  err_lev = statistics.median(_log_err(r["speedup"], r["predicted_leviathan"]) for r in rs)
  err_cost = statistics.median(_log_err(r["speedup"], r["predicted_measured_cost"]) for r in rs)
  eff = [r["efficiency"] for r in rs]
  better = "measured-cost model" if err_cost < err_lev else "Leviathan's formula"
  out = ["## Which prediction explains the measurement", "",
         f"- Median |error| of Leviathan's Theorem 3.8 (measured alpha and c, verify assumed "
         f"to cost one decode step): {100 * (math.exp(err_lev) - 1):.1f}%.",
         f"- Median |error| of the measured-cost model (measured T(gamma+1), draft and accept "
         f"costs): {100 * (math.exp(err_cost) - 1):.1f}%.",
         f"- The {better} explains the measurements better.",
         f"- Efficiency (measured / measured-cost prediction): median {statistics.median(eff):.3f},"
         f" min {min(eff):.3f}, max {max(eff):.3f}.", ""]
  low = [r for r in rs if r["efficiency"] < EFFICIENCY_FLOOR]
  if low:
    out += [f"### Points below efficiency {EFFICIENCY_FLOOR}", ""]
    for r in low:
      split = ", ".join(f"{k[:-6]} {100 * r[k]:.0f}%" for k in
                        ("draft_share", "verify_share", "accept_share", "rest_share") if k in r)
      out.append(f"- gamma {r['gamma']}, {r['accept_rule']}, T={r['temperature']:g}: efficiency "
                 f"{r['efficiency']:.3f}; time split {split or 'not measured'}.")
  else:
    out.append(f"Every point reaches efficiency >= {EFFICIENCY_FLOOR}.")
  return out


def write_report(workdir: str, records: list[dict[str, Any]], costs: dict[str, Any],
                 env: dict[str, Any]) -> str:
  if records:
    plot_speedup(os.path.join(workdir, "speedup.png"), records)
    if _iid_records(records):
      plot_acceptance(os.path.join(workdir, "acceptance.png"), records)
  plot_verify_cost(os.path.join(workdir, "verify_cost.png"), costs)
  md = summary_markdown(records, costs, env)
  with open(os.path.join(workdir, wd.SUMMARY), "w") as f:
    f.write(md)
  return md
