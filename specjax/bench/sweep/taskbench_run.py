"""Runs the task suite through the harness: per category of `taskbench`, one
gamma sweep of the drafters (WORKDIR/CATEGORY/) and, per drafter of
`taskbench_trees` ("DRAFTER@TREE" rows), one trees sweep of its trees at
batch 1 (WORKDIR/CATEGORY/trees-NAME-HASH/), each (drafter, tree) a
leaderboard row "DRAFTER TREE" of its own; the mixed category's records
name each row's category (`row_categories`). Every sweep is planned and
checked (harness.prepare) before the first one runs, the models loaded once;
each appends its points as they finish, and a resume skips them. The report:
taskbench_report.py. With `prompt_tokens` (models without a tokenizer, the
tests' tiny pair) every category runs those ids. docs/taskbench.md.
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
import re

from specjax import workdir as wd
from specjax.bench.sweep import gamma, harness, noise, outputs, points, taskbench
from specjax.bench.sweep import taskbench_report, trees
from specjax.bench.sweep.config import AUTO, SweepConfig, tree_rows
from specjax.errors import ConfigError
from specjax.workdir import Record


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


def row_categories(rec: Record) -> list[str]:
  """Each row's category in a mixed point, run after run (points.batch_prompts
  over the mixed prompts: row r of a batch is prompt r mod n)."""
  cats = taskbench.mixed_categories(int(rec["n_prompts"]))
  groups = points.batch_prompts([[i] for i in range(len(cats))], int(rec.get("batch", 1)))
  return [cats[row[0]] for rows in groups for row in rows]


def tree_config(cfg: SweepConfig, cat: str, drafter: str, specs: list[str]) -> SweepConfig:
  """The trees sweep of one category and drafter: its trees at batch 1, the
  config's rules and temperatures; an auto[:N1,..] row is the sweep's auto
  point, choosing among --tree=auto's candidates (auto_candidates), none of
  them a row of its own."""
  autos = [s for s in specs if s.startswith(AUTO)]
  return cfg.replace(taskbench=(), taskbench_trees=(), taskbench_category=cat,
                     drafters=(drafter,), batches=(1,),
                     trees=tuple(AUTO if s in autos else s for s in specs),
                     auto_candidates=autos[0] if autos else "")


@dataclasses.dataclass(frozen=True)
class Sweep:
  """One sweep of the suite: where it runs and which of its records it owns."""
  category: str
  runner: harness.Runner
  cfg: SweepConfig
  workdir: str
  drafter: str | None = None  # a trees sweep's drafter (its rows' tree_drafter)

  def rows(self, records: list[Record]) -> list[Record]:
    """Its records as leaderboard rows: each with its category; a trees
    sweep's only for its own drafter and trees, labelled DRAFTER TREE."""
    if self.drafter is None:
      mixed = self.category == taskbench.MIXED
      return [dict(r, category=self.category, **({"row_categories": row_categories(r)}
                                                  if mixed else {})) for r in records]
    return [dict(r, category=self.category, tree_drafter=self.drafter,
                 drafter=tree_label(self.drafter, r["tree"]))
            for r in records if r["tree"] in self.cfg.trees and r.get("drafter") == self.drafter]


def sweeps(cfg: SweepConfig, workdir: str) -> list[Sweep]:
  """The suite's sweeps, in the order they run (module docstring)."""
  if not cfg.taskbench:
    raise ConfigError("config.taskbench names no category")
  by_drafter: dict[str, list[str]] = {}
  for d, t in tree_rows(cfg):
    by_drafter.setdefault(d, []).append(t)
  chains = bool(cfg.drafters) or not by_drafter  # drafters () and tree rows: trees only
  out = []
  for cat in cfg.taskbench:
    if chains:
      out.append(Sweep(cat, gamma.RUNNER, cfg.replace(taskbench=(), taskbench_trees=(),
                                                      taskbench_category=cat),
                       os.path.join(workdir, cat)))
    out += [Sweep(cat, trees.RUNNER, tree_config(cfg, cat, d, specs),
                  os.path.join(workdir, cat, tree_dir(d)), d) for d, specs in by_drafter.items()]
  return out


def run_taskbench(cfg: SweepConfig, workdir: str, resume: bool = False, overwrite: bool = False,
                  progress: bool = True) -> list[Record]:
  """Every sweep of the suite, all checked first; returns every row (module
  docstring) and writes taskbench.jsonl and the report."""
  models: harness.Models = {}
  plan = [(s, harness.prepare(s.runner, s.cfg, s.workdir, resume, overwrite, models))
          for s in sweeps(cfg, workdir)]
  if overwrite:
    outputs.move_aside(workdir, (taskbench_report.REPORT, taskbench_report.PLOT,
                                 taskbench_report.RECORDS))
  records, notes = [], []
  for s, p in plan:
    got = harness.execute(p, progress)
    records += s.rows(got)
    found = noise.assess(got, cfg.noise_threshold)
    if found["noisy"]:
      notes.append(f"**Noisy sweep** ({s.workdir}): likely cause: {found['cause']}.")
  wd.restart_jsonl(os.path.join(workdir, taskbench_report.RECORDS), records)
  taskbench_report.write_report(workdir, records, cfg, notes)
  return records
