"""The trees sweep's report (trees.py): the summary's text and trees.png.

For each (drafter, acceptance rule, temperature):
  - per batch, each tree's tokens per step and speedup, measured and
    predicted (tree_theory at the measured or the rule's p; the costs
    measured at that batch);
  - the best tree (not a chain) against the best chain at each batch, and
    the crossover batch: the smallest measured B from which on the best
    chain is at least as fast as the best tree (`crossover`);
  - auto against the best fixed tree at each batch.
trees.png: tokens per step against tree size, measured (points) and
predicted (line), per batch; the best tree's and the best chain's speedup
against the batch.
"""

from __future__ import annotations

import os
from typing import Mapping, Sequence

from specjax import workdir as wd
from specjax.workdir import Record

AUTO = "auto"


def is_chain(rec: Record) -> bool:
  """A chain point: chain:G, or a tree whose topology is a chain (as many
  nodes as levels: e.g. Sequoia's best 4-node tree at p = (0.6, 0.2, 0.1))."""
  nodes = rec.get("tree_nodes")
  return str(rec["tree"]).startswith("chain") or (nodes is not None and nodes == rec["gamma"])


def series_key(rec: Record) -> tuple:
  return (str(rec.get("drafter") or "model"), str(rec["accept_rule"]),
          float(rec["temperature"]))


def best_per_batch(records: Sequence[Record]) -> dict[int, dict[str, Record]]:
  """batch -> {'tree': the fastest non-chain fixed tree's record, 'chain':
  the fastest chain's, 'auto': the auto point's} (each where measured), for
  records of one series."""
  out: dict[int, dict[str, Record]] = {}
  for r in records:
    kind = AUTO if r["tree"] == AUTO else "chain" if is_chain(r) else "tree"
    cur = out.setdefault(int(r["batch"]), {})
    if kind not in cur or r["speedup"] > cur[kind]["speedup"]:
      cur[kind] = r
  return out


def crossover(best: Mapping[int, Mapping[str, float]]) -> int | None:
  """The smallest batch B from which on (B and every larger measured batch)
  the best chain's speedup is at least the best tree's; None when the tree
  wins at the largest batch (no crossover in range). best: batch ->
  {'tree': speedup, 'chain': speedup}; batches lacking either are skipped."""
  bs = sorted(b for b, v in best.items() if "tree" in v and "chain" in v)
  cross = None
  for b in reversed(bs):
    if best[b]["chain"] >= best[b]["tree"]:
      cross = b
    else:
      break
  return cross


def _fmt(x, spec=".3f") -> str:
  return "-" if x is None else format(x, spec)


def summary_lines(records: Sequence[Record], skipped: Sequence[str] = ()) -> list[str]:
  series: dict[tuple, list[Record]] = {}
  for r in records:
    series.setdefault(series_key(r), []).append(r)
  lines = ["# Trees sweep", ""]
  if records:
    r0 = records[0]
    lines += [f"target {r0.get('target')}, draft {r0.get('draft')}, {r0.get('precision')}, "
              f"{r0.get('n_prompts')} prompt(s), {r0.get('reps')} repetition(s)", ""]
  for line in skipped:
    lines += [f"- {line}"]
  if skipped:
    lines.append("")
  for (drafter, rule, temp), recs in series.items():
    lines += [f"## {drafter}, {rule}, T={temp:g}", "",
              "| B | tree | nodes | depth | tokens/step | predicted | speedup | predicted | "
              "p by rank |", "|---|---|---|---|---|---|---|---|---|"]
    for r in sorted(recs, key=lambda r: (r["batch"], r.get("tree_nodes") or 1e9)):
      p = ", ".join(_fmt(x, ".2f") for x in (r.get("p_by_rank") or [])[:4])
      lines.append(f"| {r['batch']} | {r['tree']} | {r.get('tree_nodes', '-')} | {r['gamma']} | "
                   f"{r['tokens_per_step']:.2f} | {_fmt(r.get('tokens_per_step_predicted'), '.2f')} "
                   f"| {r['speedup']:.3f} | {_fmt(r.get('predicted_measured_cost'))} | {p} |")
    best = best_per_batch(recs)
    lines += ["", "| B | best tree | speedup | best chain | speedup | tree/chain | auto | "
              "auto/best fixed |", "|---|---|---|---|---|---|---|---|"]
    for b in sorted(best):
      v = best[b]
      t, c, a = v.get("tree"), v.get("chain"), v.get(AUTO)
      fixed = max((x["speedup"] for x in (t, c) if x), default=None)
      lines.append(
          f"| {b} | {t['tree'] if t else '-'} | {_fmt(t and t['speedup'])} | "
          f"{c['tree'] if c else '-'} | {_fmt(c and c['speedup'])} | "
          f"{_fmt(t['speedup'] / c['speedup'] if t and c else None)} | "
          f"{_fmt(a and a['speedup'])} | {_fmt(a['speedup'] / fixed if a and fixed else None)} |")
    cross = crossover({b: {k: v[k]["speedup"] for k in ("tree", "chain") if k in v}
                       for b, v in best.items()})
    lines += ["", "Crossover batch (the best chain at least as fast as the best tree from "
              f"here on): {cross if cross is not None else 'none in the measured range'}", ""]
  return lines


def plot(path: str, records: Sequence[Record]) -> None:
  plt = wd.pyplot()
  series: dict[tuple, list[Record]] = {}
  for r in records:
    series.setdefault(series_key(r), []).append(r)
  fig, axes = plt.subplots(len(series) or 1, 2, figsize=(11, 4 * max(1, len(series))),
                           squeeze=False)
  for row, ((drafter, rule, temp), recs) in enumerate(series.items()):
    ax = axes[row][0]
    for b in sorted({r["batch"] for r in recs}):
      color = None
      for chain, mark, style in ((False, "o", "-"), (True, "s", ":")):  # trees, then chains
        pts = sorted((r for r in recs if r["batch"] == b and r["tree"] != AUTO
                      and is_chain(r) == chain), key=lambda r: r["tree_nodes"])
        if not pts:
          continue
        kind = "chains" if chain else "trees"
        ln = ax.plot([r["tree_nodes"] for r in pts], [r["tokens_per_step"] for r in pts], mark,
                     color=color, label=f"B={b} {kind} measured")
        color = ln[0].get_color()
        pred = [r for r in pts if r.get("tokens_per_step_predicted") is not None]  # not dynamic
        if pred:
          ax.plot([r["tree_nodes"] for r in pred], [r["tokens_per_step_predicted"] for r in pred],
                  style, color=color, alpha=0.6, label=f"B={b} {kind} predicted")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("draft nodes N")
    ax.set_ylabel("tokens per step")
    ax.set_title(f"{drafter}, {rule}, T={temp:g}")
    ax.legend(fontsize=7)
    ax = axes[row][1]
    best = best_per_batch(recs)
    bs = sorted(best)
    for kind in ("tree", "chain", AUTO):
      xs = [b for b in bs if kind in best[b]]
      ax.plot(xs, [best[b][kind]["speedup"] for b in xs], "o-", label=f"best {kind}")
    ax.axhline(1.0, color="grey", lw=0.5)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("batch B")
    ax.set_ylabel("speedup")
    ax.legend(fontsize=7)
  wd.save_figure(fig, path)


def write_report(workdir: str, records: Sequence[Record], env: Record,
                 skipped: Sequence[str] = ()) -> str:
  """trees.png; returns the summary's text (the harness writes summary.md)."""
  lines = summary_lines(records, skipped)
  lines += ["", f"Machine: {wd.machine_line(env)}"]
  if records:
    plot(os.path.join(workdir, "trees.png"), records)
  return "\n".join(lines) + "\n"
