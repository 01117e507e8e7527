"""Whether a sweep's numbers are noisy: the spread of what should not move.

Points of one workload (same batch and sampling settings) run the same
target-only generation and probe the same T_target(1), whatever their
drafter, gamma, tree or rule: across them (and across a point's own
repetitions) those figures measure the machine, not speculative decoding.
`assess` keeps, per workload, their spread (max - min) / median; a workload
whose spread exceeds the threshold flags the run and, in it, each point
more than half the threshold from the workload's median (so a flagged run
always names a point); so does a point whose own repetitions spread more
than the threshold. One line names the likely cause (`cause`). docs/sweep.md.
"""

from __future__ import annotations

import statistics
from typing import Any, Sequence

from specjax.workdir import Record

FIGURES = (("baseline_tps", "target-only speed", "tokens/s"), ("t_target_s", "T(1)", "s"))


def workload(rec: Record) -> tuple:
  return (int(rec.get("batch", 1)), float(rec["temperature"]), int(rec.get("top_k", 0)),
          float(rec.get("top_p", 1.0)))


def spread(xs: Sequence[float]) -> float:
  """(max - min) / median; 0 for fewer than two values."""
  xs = [x for x in xs if x]
  return (max(xs) - min(xs)) / statistics.median(xs) if len(xs) > 1 else 0.0


def point_name(rec: Record) -> str:
  what = rec.get("tree") if rec.get("tree") is not None else f"gamma {rec.get('gamma')}"
  return (f"{rec.get('drafter') or 'model'} B={rec.get('batch', 1)} {what} "
          f"{rec.get('accept_rule')} T={float(rec['temperature']):g}")


def assess(records: Sequence[Record], threshold: float) -> dict[str, Any]:
  """The spread of each figure per workload, the flagged points, the verdict."""
  groups: dict[tuple, list[Record]] = {}
  for r in records:
    groups.setdefault(workload(r), []).append(r)
  out: dict[str, Any] = {"threshold": threshold, "workloads": [], "points": []}
  flagged: dict[str, list[str]] = {}
  for key, rs in sorted(groups.items()):
    row: dict[str, Any] = {"batch": key[0], "temperature": key[1], "n_points": len(rs)}
    for field, what, unit in FIGURES:
      xs = [r[field] for r in rs if r.get(field)]
      if not xs:
        continue
      med = statistics.median(xs)
      row[field] = {"min": min(xs), "median": med, "max": max(xs), "spread": spread(xs)}
      for r in rs:
        if spread(xs) > threshold and r.get(field) and abs(r[field] / med - 1) > threshold / 2:
          flagged.setdefault(point_name(r), []).append(
              f"{what} {r[field]:.4g} {unit} against a median of {med:.4g}")
        reps = r.get(f"{field}_reps") or []
        if spread(reps) > threshold:
          flagged.setdefault(point_name(r), []).append(
              f"its repetitions' {what} spread {100 * spread(reps):.0f} %")
    out["workloads"].append(row)
  out["points"] = [{"point": k, "why": v} for k, v in flagged.items()]
  out["noisy"] = bool(flagged)  # a workload over the threshold always flags a point
  out["cause"] = cause(records) if out["noisy"] else None
  return out


def cause(records: Sequence[Record]) -> str:
  """One line: the likely cause of a noisy run, from the load average each
  record carries (env.load_avg, 1 min, taken as the point finished) and the
  order of the target-only speeds."""
  loads = [r["env"]["load_avg"][0] for r in records
           if (r.get("env") or {}).get("load_avg")]
  cores = next(((r.get("env") or {}).get("cpu_count") for r in records), None) or 1
  if loads and max(loads) - min(loads) > 1.0:
    return (f"the machine's load changed during the run (1-min load average "
            f"{min(loads):.1f} to {max(loads):.1f} on {cores} cores): other work ran beside it")
  if loads and max(loads) > cores + 1:
    return (f"other processes competed for the cores (1-min load average up to "
            f"{max(loads):.1f} on {cores} cores)")
  speeds = [r["baseline_tps"] for r in records if r.get("baseline_tps")]
  steps = [b - a for a, b in zip(speeds, speeds[1:])]
  if steps and (all(s <= 0 for s in steps) or all(s >= 0 for s in steps)):
    return "a steady drift in the machine's speed (CPU frequency scaling or thermal throttling)"
  return ("bursts of other work shorter than the load average shows, or CPU frequency "
          "changes: rerun on an idle machine, or with more repetitions")


def section(found: dict[str, Any]) -> list[str]:
  """The summary's noise section (module docstring)."""
  t = found["threshold"]
  lines = ["## Noise: what should not move between points", "",
           f"Per workload (batch, temperature), the spread (max - min) / median across the "
           f"run's points; threshold {100 * t:.0f} %.", "",
           "| B | T | points | target-only tok/s min / median / max | spread | "
           "T(1) ms min / median / max | spread |", "|---|---|---|---|---|---|---|"]
  for w in found["workloads"]:
    b, t1 = w.get("baseline_tps"), w.get("t_target_s")
    cells = [f"{b['min']:.1f} / {b['median']:.1f} / {b['max']:.1f}", f"{100 * b['spread']:.0f} %"
             ] if b else ["-", "-"]
    cells += [f"{1e3 * t1['min']:.2f} / {1e3 * t1['median']:.2f} / {1e3 * t1['max']:.2f}",
              f"{100 * t1['spread']:.0f} %"] if t1 else ["-", "-"]
    lines.append(f"| {w['batch']} | {w['temperature']:g} | {w['n_points']} | "
                 + " | ".join(cells) + " |")
  if not found["noisy"]:
    return lines + ["", f"Every spread is within {100 * t:.0f} %: the machine held still."]
  lines += ["", f"NOISY RUN: likely cause: {found['cause']}.", "", "Flagged points:"]
  lines += [f"- {p['point']}: {'; '.join(p['why'])}" for p in found["points"]]
  return lines


def with_section(summary: str, found: dict[str, Any]) -> str:
  """The summary with its noise section at the end and, for a noisy run,
  one warning line under its title."""
  lines = summary.rstrip("\n").split("\n")
  if found["noisy"]:
    warn = (f"**Noisy run**: the target-only speed or T(1) moved more than "
            f"{100 * found['threshold']:.0f} % between points of the same work (see Noise "
            f"below); likely cause: {found['cause']}.")
    lines[1:1] = ["", warn]
  return "\n".join(lines + [""] + section(found)) + "\n"
