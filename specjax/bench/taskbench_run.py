"""Runs the task suite through the sweep and writes a Spec-Bench-style report.

configs/sweep_gamma.py:taskbench (and :taskbench_quick) name the categories
in `config.taskbench`; each category is one ordinary sweep (bench/sweep.py:
every drafter x temperature x gamma, the category's conversations run in
turn) in WORKDIR/CATEGORY/, and this module gathers their records into

  WORKDIR/taskbench.md    the leaderboard: per drafter and temperature, the
                          speedup in each category, the mean accepted tokens
                          (MAT) and the overall speedup (Spec-Bench's
                          columns), then per category and drafter: MAT, alpha,
                          tokens/s, speedup and both predictions
  WORKDIR/taskbench.png   MAT and speedup per category, one bar per drafter
  WORKDIR/taskbench.jsonl every point's record with its "category"

MAT is stats.SpecStats.tokens_per_step (tokens kept per loop step: the
accepted drafts plus the target's token, as Spec-Bench counts them). Where a
category ran several gammas, the row takes the gamma of the best measured
speedup (and names it).

With `config.prompt_tokens` set (models without a tokenizer: the tests'
tiny pair) every category runs those ids instead of its conversations.
"""

from __future__ import annotations

import os
import statistics

import ml_collections

from specjax import workdir as wd
from specjax.bench import sweep
from specjax.bench import taskbench
from specjax.errors import ConfigError

REPORT, PLOT, RECORDS = "taskbench.md", "taskbench.png", "taskbench.jsonl"


def categories(cfg) -> tuple[str, ...]:
  cats = tuple(str(c) for c in cfg.get("taskbench", ()))
  for c in cats:
    if c not in taskbench.CATEGORIES:
      raise ConfigError(f"config.taskbench: unknown category {c!r}; valid: "
                        f"{', '.join(taskbench.CATEGORIES)}")
  return cats


def run_taskbench(cfg, workdir: str, resume: bool = False, progress: bool = True) -> list[dict]:
  """One sweep per category of `cfg.taskbench`; returns every record, each
  with its "category", and writes the report."""
  cats = categories(cfg)
  if not cats:
    raise ConfigError("config.taskbench names no category")
  records = []
  for cat in cats:
    sub = ml_collections.ConfigDict(cfg.to_dict())
    sub.taskbench = ()
    sub.taskbench_category = cat
    for rec in sweep.run_sweep(sub, os.path.join(workdir, cat), resume, progress):
      records.append(dict(rec, category=cat))
  wd.restart_jsonl(os.path.join(workdir, RECORDS), records)
  write_report(workdir, records, cfg)
  return records


def best_points(records: list[dict]) -> dict[tuple, dict]:
  """(category, drafter, temperature) -> the record of the best measured
  speedup over its gammas (real acceptance only)."""
  out: dict[tuple, dict] = {}
  for r in records:
    if r.get("accept_rule") != "real":
      continue
    key = (r["category"], r["drafter"], float(r["temperature"]))
    if key not in out or r["speedup"] > out[key]["speedup"]:
      out[key] = r
  return out


def leaderboard(records: list[dict]) -> str:
  """The Spec-Bench-shaped table, then the per-category details."""
  best = best_points(records)
  cats = [c for c in taskbench.CATEGORIES if any(k[0] == c for k in best)]
  rows = sorted({(k[1], k[2]) for k in best}, key=lambda x: (x[1], x[0]))
  head = ["Drafter", "T", *[taskbench.TITLES[c] for c in cats], "MAT", "Overall"]
  lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
  for drafter, temp in rows:
    pts = [best.get((c, drafter, temp)) for c in cats]
    have = [p for p in pts if p is not None]
    cells = [f"{p['speedup']:.2f}x" if p else "-" for p in pts]
    mat = statistics.mean(p["tokens_per_step"] for p in have)
    overall = statistics.mean(p["speedup"] for p in have)
    lines.append(f"| {drafter} | {temp:g} | " + " | ".join(cells)
                 + f" | {mat:.2f} | {overall:.2f}x |")
  lines += ["", "Per category (the gamma of the best measured speedup):", "",
            "| Category | Drafter | T | gamma | MAT | alpha | tok/s spec | tok/s target "
            "| speedup | pred. measured-cost | pred. Leviathan |",
            "|" + "---|" * 11]
  for c in cats:
    for drafter, temp in rows:
      p = best.get((c, drafter, temp))
      if p is None:
        continue
      lines.append(
          f"| {taskbench.TITLES[c]} | {drafter} | {temp:g} | {p['gamma']} "
          f"| {p['tokens_per_step']:.2f} | {p['alpha']:.3f} | {p['spec_tps']:.1f} "
          f"| {p['baseline_tps']:.1f} | {p['speedup']:.2f}x "
          f"| {p['predicted_measured_cost']:.2f}x | {p['predicted_leviathan']:.2f}x |")
  return "\n".join(lines) + "\n"


def write_report(workdir: str, records: list[dict], cfg) -> None:
  """taskbench.md (config, machine, the tables) and taskbench.png."""
  env = records[0].get("env", {}) if records else {}
  text = (f"# Task suite: {cfg.target}\n\n"
          f"{int(cfg.n_predict)} tokens per prompt, {int(cfg.reps)} repetitions, "
          f"dtype {cfg.dtype or 'the model default'}, prompts through the chat template; "
          f"{wd.machine_line(env)}."
          f"\n\nSpeedup per category; MAT = mean accepted tokens per step (drafts accepted "
          f"+ 1), averaged over the categories:\n\n" + leaderboard(records))
  with open(os.path.join(workdir, REPORT), "w") as f:
    f.write(text)
  _plot(workdir, records)


def _plot(workdir: str, records: list[dict]) -> None:
  plt = wd.pyplot()
  best = best_points(records)
  cats = [c for c in taskbench.CATEGORIES if any(k[0] == c for k in best)]
  rows = sorted({(k[1], k[2]) for k in best}, key=lambda x: (x[1], x[0]))
  fig, axes = plt.subplots(1, 2, figsize=(12, 4))
  width = 0.8 / max(len(rows), 1)
  for ax, field, title in ((axes[0], "tokens_per_step", "MAT (tokens per step)"),
                           (axes[1], "speedup", "speedup over target-only")):
    for i, (drafter, temp) in enumerate(rows):
      xs = [j + i * width for j in range(len(cats))]
      ys = [best[(c, drafter, temp)][field] if (c, drafter, temp) in best else 0 for c in cats]
      ax.bar(xs, ys, width, label=f"{drafter} T={temp:g}")
    ax.set_xticks([j + 0.4 - width / 2 for j in range(len(cats))])
    ax.set_xticklabels([taskbench.TITLES[c] for c in cats], rotation=20)
    ax.set_title(title)
    if field == "speedup":
      ax.axhline(1.0, color="k", lw=0.8)
  axes[0].legend(fontsize=7)
  fig.tight_layout()
  fig.savefig(os.path.join(workdir, PLOT), dpi=100)
  plt.close(fig)
