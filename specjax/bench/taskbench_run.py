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

Token trees: `config.taskbench_trees` lists rows "DRAFTER@TREE" (e.g.
"eagle:smollm2-eagle@dynamic:4,4,16"); per category, each drafter's trees
run through the trees sweep (bench/tree_sweep.py, the category's prompts,
batch 1, the config's rules and temperatures) in WORKDIR/CATEGORY/trees-NAME-HASH/
and each (drafter, tree) becomes a leaderboard row of its own, labelled
"DRAFTER TREE". Its columns: MAT and alpha as the trees sweep measures them
(alpha: the i.i.d. rate whose capped geometric over the tree's depth gives
the measured mean accepted length), tokens/s and speedup, the trees sweep's
own measured-cost prediction (a static tree: tree_theory at the measured p by
rank over the measured costs; a dynamic tree: the measured MAT over the
measured step costs); no Leviathan prediction (a chain's theorem).

The report opens with the published MATs next to ours and ends with the
goals (issue 27), computed from the records (`goals`): the EAGLE dynamic
tree's MAT on code editing and averaged over the categories at T = 0; the
points within 10 % of their measured-cost prediction (those outside listed);
per category at T = 0, whether the best drafter beats target-only (if not,
the measured costs that say why).

An interrupted run loses no finished point: every sweep (chains and trees)
appends each point as it finishes, and `resume` skips them.

With `config.prompt_tokens` set (models without a tokenizer: the tests'
tiny pair) every category runs those ids instead of its conversations.
"""

from __future__ import annotations

import hashlib
import os
import re
import statistics

import ml_collections

from specjax import workdir as wd
from specjax.bench import sweep
from specjax.bench import taskbench
from specjax.bench import tree_sweep
from specjax.drafters import registry
from specjax.errors import ConfigError
from specjax.model import tree as trees

REPORT, PLOT, RECORDS = "taskbench.md", "taskbench.png", "taskbench.jsonl"
PUBLISHED = ("Published MATs (mean accepted tokens per step, Spec-Bench, Vicuna-7B, T=0): "
             "EAGLE 3.61, EAGLE-2 4.36")
GOAL_EDIT_MAT, GOAL_MEAN_MAT = 3.0, 2.5  # EAGLE dynamic tree at T = 0 (issue 27)
GOAL_EFFICIENCY = 0.10  # |measured / measured-cost prediction - 1| at every point


def categories(cfg) -> tuple[str, ...]:
  cats = tuple(str(c) for c in cfg.get("taskbench", ()))
  for c in cats:
    if c not in taskbench.CATEGORIES:
      raise ConfigError(f"config.taskbench: unknown category {c!r}; valid: "
                        f"{', '.join(taskbench.CATEGORIES)}")
  return cats


def tree_rows(cfg) -> list[tuple[str, str]]:
  """config.taskbench_trees ("DRAFTER@TREE", ...) -> [(drafter spec, tree
  spec)], each checked (the drafter parses, the tree is a fixed one)."""
  rows = []
  for row in cfg.get("taskbench_trees", ()) or ():
    drafter, sep, tree = str(row).rpartition("@")
    if not sep or not drafter or not tree:
      raise ConfigError(f"config.taskbench_trees: {row!r} is not DRAFTER@TREE "
                        "(e.g. eagle:smollm2-eagle@dynamic:4,4,16)")
    t = trees.parse(tree, 1)
    if not isinstance(t, (trees.Tree, trees.DynamicTree)):
      raise ConfigError(f"config.taskbench_trees: {row!r}: {tree} is not a fixed tree "
                        "(chain:G, kary:K,D, sequoia:N,D, dynamic:K,D,N)")
    rows.append((registry.parse(drafter).spec, t.spec if hasattr(t, "spec") else tree))
  if len(set(rows)) < len(rows):
    raise ConfigError(f"config.taskbench_trees names a row twice: {list(cfg.taskbench_trees)}")
  return rows


def tree_label(drafter: str, tree: str) -> str:
  """A tree row's name in the leaderboard."""
  return f"{drafter} {tree}"


def tree_dir(drafter: str) -> str:
  """A drafter's trees sweep's subdirectory of its category's workdir: the
  spec made filesystem-safe (readable), then a short hash of the spec itself,
  since the sanitising maps different specs (eagle:/a/b_c, eagle:/a/b/c)
  to one name and two drafters must never share a sweep's records."""
  digest = hashlib.sha1(drafter.encode()).hexdigest()[:8]
  return "trees-" + re.sub(r"[^A-Za-z0-9.,-]+", "_", drafter).strip("_") + "-" + digest


def tree_config(cfg, cat: str, drafter: str, specs: list[str]):
  """The trees sweep of one category and drafter: its trees at batch 1, the
  config's rules and temperatures."""
  sub = ml_collections.ConfigDict(cfg.to_dict())
  sub.taskbench, sub.taskbench_trees, sub.taskbench_category = (), (), cat
  sub.drafters, sub.trees, sub.batches = (drafter,), tuple(specs), (1,)
  return sub


def run_taskbench(cfg, workdir: str, resume: bool = False, progress: bool = True) -> list[dict]:
  """One sweep per category of `cfg.taskbench`, and per category one trees
  sweep per drafter of `cfg.taskbench_trees`; returns every record, each
  with its "category" (a tree row's "drafter" is its label, the drafter's
  spec in "tree_drafter"), and writes the report."""
  cats = categories(cfg)
  if not cats:
    raise ConfigError("config.taskbench names no category")
  rows = tree_rows(cfg)
  by_drafter: dict[str, list[str]] = {}
  for d, t in rows:
    by_drafter.setdefault(d, []).append(t)
  chains = bool(list(cfg.get("drafters", ()) or ())) or not rows  # () and rows: trees only
  records = []
  for cat in cats:
    if chains:
      sub = ml_collections.ConfigDict(cfg.to_dict())
      sub.taskbench, sub.taskbench_trees = (), ()
      sub.taskbench_category = cat
      for rec in sweep.run_sweep(sub, os.path.join(workdir, cat), resume, progress):
        records.append(dict(rec, category=cat))
    for d, specs in by_drafter.items():
      sub = tree_config(cfg, cat, d, specs)
      out = os.path.join(workdir, cat, tree_dir(d))
      for rec in tree_sweep.run_tree_sweep(sub, out, resume, progress):
        if rec["tree"] in specs and rec.get("drafter") == d:  # this drafter's own points only
          records.append(dict(rec, category=cat, tree_drafter=d,
                              drafter=tree_label(d, rec["tree"])))
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
  lines += ["", "Per category (the gamma of the best measured speedup; a tree row: its "
            "tree, its prediction the trees sweep's):", "",
            "| Category | Drafter | T | gamma | MAT | alpha | tok/s spec | tok/s target "
            "| speedup | pred. measured-cost | pred. Leviathan |",
            "|" + "---|" * 11]
  for c in cats:
    for drafter, temp in rows:
      p = best.get((c, drafter, temp))
      if p is None:
        continue
      lines.append(
          f"| {taskbench.TITLES[c]} | {drafter} | {temp:g} | {p.get('tree') or p['gamma']} "
          f"| {p['tokens_per_step']:.2f} | {p['alpha']:.3f} | {p['spec_tps']:.1f} "
          f"| {p['baseline_tps']:.1f} | {p['speedup']:.2f}x "
          f"| {_x(p.get('predicted_measured_cost'))} | {_x(p.get('predicted_leviathan'))} |")
  return "\n".join(lines) + "\n"


def _x(v) -> str:
  return "n/a" if v is None else f"{v:.2f}x"


def is_eagle_dynamic(rec: dict) -> bool:
  """A tree row of an EAGLE head drafting a dynamic tree."""
  return (str(rec.get("tree", "")).startswith("dynamic:")
          and str(rec.get("tree_drafter", "")).startswith("eagle"))


def goals(records: list[dict]) -> dict:
  """Issue 27's goals from the records (real acceptance):
    eagle_dynamic  per EAGLE dynamic-tree row at T = 0: its MAT on code
                   editing and its MAT averaged over the categories it ran
                   (the leaderboard's points), each against its goal;
    efficiency     every point with a measured-cost prediction: within
                   GOAL_EFFICIENCY of it or not (those outside listed);
    beats_target   per category at T = 0: the drafter of the best measured
                   speedup, that speedup, and the measured step in units of
                   a target decode step T_target(1) (the MAT a step would
                   need to break even) with the verify's T(N)/T(1)."""
  best = best_points(records)
  out: dict = {"eagle_dynamic": [], "efficiency": {}, "beats_target": []}
  labels = sorted({k[1] for k, r in best.items() if k[2] == 0.0 and is_eagle_dynamic(r)})
  for label in labels:
    mats = {k[0]: r["tokens_per_step"] for k, r in best.items() if k[1:] == (label, 0.0)}
    edit = mats.get("code_editing")
    mean = statistics.mean(mats.values())
    out["eagle_dynamic"].append({
        "drafter": label, "code_editing": edit, "mean": mean, "n_categories": len(mats),
        "code_editing_ok": edit is not None and edit >= GOAL_EDIT_MAT,
        "mean_ok": mean >= GOAL_MEAN_MAT})
  pts = [r for r in records if r.get("accept_rule") == "real"
         and r.get("predicted_measured_cost")]
  outside = []
  for r in pts:
    ratio = r["speedup"] / r["predicted_measured_cost"]
    if abs(ratio - 1.0) > GOAL_EFFICIENCY:
      outside.append({"category": r["category"], "drafter": r["drafter"],
                      "temperature": float(r["temperature"]),
                      "gamma": r.get("tree") or r["gamma"], "speedup": r["speedup"],
                      "predicted": r["predicted_measured_cost"], "ratio": ratio})
  out["efficiency"] = {"n": len(pts), "within": len(pts) - len(outside), "outside": outside}
  for c in taskbench.CATEGORIES:
    here = [r for k, r in best.items() if k[0] == c and k[2] == 0.0]
    if not here:
      continue
    r = max(here, key=lambda r: r["speedup"])
    t1 = r.get("t_target_s")
    step = r.get("predicted_step_s")
    out["beats_target"].append({
        "category": c, "drafter": r["drafter"], "speedup": r["speedup"],
        "beats": r["speedup"] > 1.0, "mat": r["tokens_per_step"],
        "step_over_t1": step / t1 if step and t1 else None,
        "verify_over_t1": r["t_verify_s"] / t1 if r.get("t_verify_s") and t1 else None})
  return out


def goals_lines(g: dict) -> list[str]:
  """The report's goals section from `goals`."""
  ok = lambda b: "met" if b else "NOT met"
  lines = ["## Goals (issue 27, from the records above)", ""]
  if not g["eagle_dynamic"]:
    lines.append("- EAGLE dynamic tree: no such row at T=0 in this run.")
  for e in g["eagle_dynamic"]:
    edit = "not run" if e["code_editing"] is None else f"{e['code_editing']:.2f}"
    lines.append(f"- {e['drafter']}, T=0: MAT {edit} on code editing (goal >= "
                 f"{GOAL_EDIT_MAT:g}: {ok(e['code_editing_ok'])}), {e['mean']:.2f} averaged "
                 f"over {e['n_categories']} categories (goal >= {GOAL_MEAN_MAT:g}: "
                 f"{ok(e['mean_ok'])}); published: EAGLE 3.61, EAGLE-2 4.36.")
  eff = g["efficiency"]
  lines.append(f"- Measured speedup within {GOAL_EFFICIENCY:.0%} of the measured-cost "
               f"prediction: {eff['within']} of {eff['n']} points"
               + (":" if eff["outside"] else " (every point)."))
  if eff["outside"]:
    lines += ["", "| Category | Drafter | T | gamma / tree | speedup | predicted | "
              "measured / predicted |", "|---|---|---|---|---|---|---|"]
    for o in eff["outside"]:
      lines.append(f"| {taskbench.TITLES[o['category']]} | {o['drafter']} | "
                   f"{o['temperature']:g} | {o['gamma']} | {o['speedup']:.2f}x | "
                   f"{o['predicted']:.2f}x | {o['ratio']:.2f} |")
    lines.append("")
  if not g["beats_target"]:
    lines.append("- Best drafter per category at T=0 against target-only: no T=0 rows in "
                 "this run.")
    return lines
  lines.append("- Best drafter per category at T=0 against target-only (a step costs "
               "step/T(1) target decode steps and keeps MAT tokens: it wins when MAT > "
               "step/T(1)):")
  lines += ["", "| Category | best drafter | speedup | faster? | MAT | step / T(1) | "
            "T(verify) / T(1) |", "|---|---|---|---|---|---|---|"]
  f = lambda v: "-" if v is None else f"{v:.2f}"
  for b in g["beats_target"]:
    lines.append(f"| {taskbench.TITLES[b['category']]} | {b['drafter']} | {b['speedup']:.2f}x "
                 f"| {'yes' if b['beats'] else 'no'} | {b['mat']:.2f} | "
                 f"{f(b['step_over_t1'])} | {f(b['verify_over_t1'])} |")
  return lines


def write_report(workdir: str, records: list[dict], cfg) -> None:
  """taskbench.md (config, machine, the tables) and taskbench.png."""
  env = records[0].get("env", {}) if records else {}
  text = (f"# Task suite: {cfg.target}\n\n"
          f"{int(cfg.n_predict)} tokens per prompt, {int(cfg.reps)} repetitions, "
          f"dtype {cfg.dtype or 'the model default'}, prompts through the chat template; "
          f"{wd.machine_line(env)}."
          f"\n\n{PUBLISHED}; ours (the leaderboard's MAT column): {_ours(records)}."
          f"\n\nSpeedup per category; MAT = mean accepted tokens per step (drafts accepted "
          f"+ 1), averaged over the categories:\n\n" + leaderboard(records)
          + "\n" + "\n".join(goals_lines(goals(records))) + "\n")
  with open(os.path.join(workdir, REPORT), "w") as f:
    f.write(text)
  _plot(workdir, records)


def _ours(records: list[dict]) -> str:
  """Each drafter row's mean MAT over its categories at T=0 (all rows where
  none ran at T=0)."""
  best = best_points(records)
  temps = {k[2] for k in best}
  t = 0.0 if 0.0 in temps else min(temps, default=0.0)
  rows = sorted({k[1] for k in best if k[2] == t})
  parts = [f"{d} {statistics.mean(r['tokens_per_step'] for k, r in best.items() if k[1:] == (d, t)):.2f}"
           for d in rows]
  return f"T={t:g}: " + ", ".join(parts) if parts else "none"


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
