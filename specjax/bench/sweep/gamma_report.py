"""The gamma sweep's report (gamma.py): speedup.png, verify_cost.png,
acceptance.png, drafters.png and the summary's text (records:
specjax.metrics.schema); with several batches or auto points, the batch
section too (batch_report.py). The harness writes summary.md."""

from __future__ import annotations

import math
import os
import statistics
from typing import Any

import matplotlib.ticker
import numpy as np

from specjax import workdir as wd
from specjax.bench.sweep import batch_report

EFFICIENCY_FLOOR = 0.90


def _log_err(measured: float, predicted: float) -> float:
  return abs(math.log(measured / predicted)) if measured > 0 and predicted > 0 else math.inf


def plot_speedup(path: str, records: list[dict[str, Any]]) -> None:
  """Speedup vs gamma: measured markers, predictions as lines, a colour per setting."""
  plt = wd.pyplot()
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
  plt = wd.pyplot()
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
  plt = wd.pyplot()
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
               f"{r['n_steps']} | {r['alpha']:.3f} | {pos} | {batch_report.fmt(g['tv'], '.3f')} | "
               f"{chi} | {p} |")
  return out + [""]


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
                 env: dict[str, Any], n_tokens: int | None = None) -> str:
  """The gamma sweep's plots and summary on the smallest batch's fixed-gamma
  points; with more than one batch (or auto points) the batch outputs too
  (n_tokens: tokens per row after the first, for the best-gamma map's tail
  effect)."""
  all_records = records
  records = base_records(records)
  if len(drafters_of(all_records)) > 1:
    plot_drafters(os.path.join(workdir, "drafters.png"), all_records)
  if records:
    plot_speedup(os.path.join(workdir, "speedup.png"), records)
    if _iid_records(records):
      plot_acceptance(os.path.join(workdir, "acceptance.png"), records)
  plot_verify_cost(os.path.join(workdir, "verify_cost.png"), costs)
  md = summary_markdown(records, costs, env)
  if len(drafters_of(all_records)) > 1:
    md += "\n".join(drafters_markdown(all_records)) + "\n"
  if len(batches_of(all_records)) > 1 or any(not batch_report.is_fixed(r) for r in all_records):
    md += batch_report.write_batch_report(workdir, all_records, costs, n_tokens)
  return md


# ---------------------------------------------------------------- which records


def batches_of(records) -> list[int]:
  return sorted({int(r.get("batch", 1)) for r in records})


def drafters_of(records) -> list[str]:
  """The drafters of the records, in the order the sweep ran them."""
  return list(dict.fromkeys(str(r.get("drafter") or "model") for r in records))


def base_records(records):
  """The fixed-gamma points at the smallest batch: what the gamma sweep's
  plots and tables describe."""
  bs, ds = batches_of(records), drafters_of(records)
  return [r for r in records if batch_report.is_fixed(r) and bs
          and int(r.get("batch", 1)) == bs[0] and str(r.get("drafter") or "model") == ds[0]]


# ---------------------------------------------------------------- drafters


def _drafter_points(records):
  """{(drafter, rule, T): records by gamma} over the fixed-gamma points at
  the sweep's smallest batch (batch 1 unless the sweep has none)."""
  fixed = [r for r in records if batch_report.is_fixed(r)]
  smallest = min((int(r.get("batch", 1)) for r in fixed), default=1)
  out: dict[tuple, list] = {}
  for r in fixed:
    if int(r.get("batch", 1)) != smallest:
      continue
    key = (str(r.get("drafter") or "model"), r["accept_rule"], r["temperature"])
    out.setdefault(key, []).append(r)
  return {k: sorted(v, key=lambda r: r["gamma"]) for k, v in out.items()}


def drafters_markdown(records) -> list[str]:
  """Per drafter, rule and temperature: the best gamma's measured speedup
  next to both predictions, alpha, mean accepted length and c, and the
  speedup at every gamma (at the smallest batch: `_drafter_points`)."""
  groups = _drafter_points(records)
  order = {d: i for i, d in enumerate(drafters_of(records))}
  head = ["drafter", "rule", "T", "best gamma", "speedup", "Leviathan", "meas.-cost",
          "alpha", "mean acc", "c", "speedup at gamma " + "/".join(
              str(g) for g in sorted({r["gamma"] for v in groups.values() for r in v}))]
  lines = ["## Drafters (batch 1; best gamma = highest measured speedup)", "",
           "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
  for (d, rule, t), rs in sorted(groups.items(), key=lambda kv: (kv[0][2], kv[0][1],
                                                                  order[kv[0][0]])):
    best = max(rs, key=lambda r: r["speedup"])
    lines.append("| " + " | ".join([
        d, rule, f"{t:g}", str(best["gamma"]), f"{best['speedup']:.3f}",
        f"{best['predicted_leviathan']:.3f}", f"{best['predicted_measured_cost']:.3f}",
        f"{best['alpha']:.3f}", f"{best['mean_accepted']:.2f}", f"{best['c']:.3f}",
        "/".join(f"{r['speedup']:.2f}" for r in rs)]) + " |")
  return lines + [""]


def plot_drafters(path: str, records) -> None:
  """Measured speedup against gamma, one line per drafter (dashed: the
  measured-cost prediction), one panel per (rule, temperature)."""
  plt = wd.pyplot()
  groups = _drafter_points(records)
  settings = sorted({(rule, t) for _, rule, t in groups})
  if not settings:
    return
  fig, axes = plt.subplots(1, len(settings), figsize=(5.5 * len(settings), 4), squeeze=False)
  for ax, (rule, t) in zip(axes[0], settings):
    for i, d in enumerate(drafters_of(records)):
      rs = groups.get((d, rule, t))
      if not rs:
        continue
      gs = [r["gamma"] for r in rs]
      line, = ax.plot(gs, [r["speedup"] for r in rs], "o-", label=d)
      ax.plot(gs, [r["predicted_measured_cost"] for r in rs], "--", color=line.get_color(),
              alpha=0.6)
    ax.axhline(1.0, color="red", lw=0.8)
    ax.set(title=f"{rule}, T={t:g} (dashed: measured-cost model)", xlabel="gamma",
           ylabel="speedup over target-only")
    ax.legend(fontsize=8)
  wd.save_figure(fig, path)
