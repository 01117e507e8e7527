"""The contexts dimension (issue 39, part 4): one gamma sweep per context
depth C, in WORKDIR/ctx-C/, with a cache of C slots (plus the drafts') and
the prompts at that context (prompts.context_prompts: the long suite's, or
prompt_tokens tiled), so the target's and the drafts' cost probes run at
depth C too. Every sweep is planned and checked before the first one runs,
the models loaded once; each appends its points as they finish, and a resume
skips them. Every record gains its `context` and its prompts' lengths;
WORKDIR/contexts.jsonl holds them all, contexts.md a table of the speedup
per (drafter, context, batch, gamma) and the best drafter per (context,
batch), contexts.png speedup against batch, measured and predicted, a line
per context and a panel per drafter (context_plot.py). docs/streaming.md,
"Long prompts".
"""

from __future__ import annotations

import os

from specjax import workdir as wd
from specjax.bench.sweep import context_plot, gamma, harness, outputs
from specjax.bench.sweep.config import SweepConfig
from specjax.errors import ConfigError
from specjax.workdir import Record

RECORDS, REPORT, PLOT = "contexts.jsonl", "contexts.md", "contexts.png"


def context_config(cfg: SweepConfig, context: int) -> SweepConfig:
  """The gamma sweep at one context: its prompts and a cache of that depth."""
  return cfg.replace(contexts=(), context=context, ctx_size=context)


def run_contexts(cfg: SweepConfig, workdir: str, resume: bool = False, overwrite: bool = False,
                 progress: bool = True) -> list[Record]:
  """Every context's sweep, all checked first; returns every record (module
  docstring) and writes contexts.jsonl, the report and the plot."""
  if not cfg.contexts:
    raise ConfigError("config.contexts names no context")
  models: harness.Models = {}
  plan = [(c, harness.prepare(gamma.RUNNER, context_config(cfg, c),
                              os.path.join(workdir, f"ctx-{c}"), resume, overwrite, models))
          for c in sorted(cfg.contexts)]
  if overwrite:
    outputs.move_aside(workdir, (REPORT, PLOT, RECORDS))
  records = []
  for c, p in plan:
    lens = [len(x) for x in p.setup.prompts]
    records += [dict(r, context=c, prompt_lens=lens) for r in harness.execute(p, progress)]
  wd.restart_jsonl(os.path.join(workdir, RECORDS), records)
  write_report(workdir, records, cfg)
  return records


def key(r: Record) -> tuple:
  return (r["drafter"], r["context"], r["batch"], str(r["gamma"]), r["accept_rule"],
          r["temperature"])


def best(records: list[Record]) -> dict[tuple, Record]:
  """(context, batch, temperature) -> the record with the highest speedup."""
  out: dict[tuple, Record] = {}
  for r in records:
    k = (r["context"], r["batch"], r["temperature"])
    if k not in out or r["speedup"] > out[k]["speedup"]:
      out[k] = r
  return out


def table(records: list[Record]) -> list[str]:
  lines = ["| drafter | context | prompt tokens | batch | gamma | T | alpha | MAT | speedup "
           "| predicted (measured cost) |", "|---|---|---|---|---|---|---|---|---|---|"]
  for r in sorted(records, key=key):
    lens = r.get("prompt_lens") or [0]
    pred = r.get("predicted_measured_cost")
    lines.append(f"| {r['drafter']} | {r['context']} | {min(lens)}-{max(lens)} | {r['batch']} "
                 f"| {r['gamma']} | {r['temperature']:g} | {r['alpha']:.3f} "
                 f"| {r['tokens_per_step']:.2f} | {r['speedup']:.2f}x "
                 f"| {f'{pred:.2f}x' if pred else 'n/a'} |")
  return lines


def write_report(workdir: str, records: list[Record], cfg: SweepConfig) -> None:
  """contexts.md and contexts.png (module docstring)."""
  lines = [f"# Speedup by context depth: {cfg.target}\n",
           f"Contexts {', '.join(map(str, sorted(cfg.contexts)))}; prompts: "
           f"{'prompt_tokens tiled' if cfg.prompt_tokens else 'the long suite'}; "
           f"{cfg.n_predict} tokens per run, {cfg.reps} repetitions.\n",
           "## The best drafter per (context, batch)\n",
           "| context | batch | T | drafter | gamma | speedup |", "|---|---|---|---|---|---|"]
  for (c, b, t), r in sorted(best(records).items()):
    lines.append(f"| {c} | {b} | {t:g} | {r['drafter']} | {r['gamma']} | {r['speedup']:.2f}x |")
  lines += ["", "## Every point\n", *table(records)]
  with open(os.path.join(workdir, REPORT), "w") as f:
    f.write("\n".join(lines) + "\n")
  context_plot.plot(records, os.path.join(workdir, PLOT))
