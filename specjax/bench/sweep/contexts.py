"""The contexts dimension (issue 39, part 4): one gamma sweep per context
depth C, in WORKDIR/ctx-C/, with a cache of C slots (plus the drafts') and
the prompts at that context (prompts.context_prompts), so the cost probes
run at depth C too. Every sweep is planned and checked before the first one
runs, memory included (`check_memory`), the models loaded once; a finished
context's prefilled rows and programs are dropped before the next
(`forget`: the first full run was killed by the kernel at 4 K after the 1 K
sweep, 24 GB resident). Records gain `context` and the prompts' lengths;
WORKDIR/contexts.jsonl holds them all, contexts.md the speedup per
(drafter, context, batch, gamma) and the fastest per (context, batch),
contexts.png speedup against batch (context_plot.py). docs/streaming.md,
"Long prompts"; docs/long_context.md.
"""

from __future__ import annotations

import os

import jax

from specjax import workdir as wd
from specjax.bench import memory
from specjax.bench.sweep import context_plot, gamma, harness, outputs, prefills
from specjax.bench.sweep.config import SweepConfig
from specjax.errors import ConfigError
from specjax.model import kv_cache as kvc
from specjax.workdir import Record

RECORDS, REPORT, PLOT = "contexts.jsonl", "contexts.md", "contexts.png"
MEMORY_MARGIN = 0.8  # of the memory available once the models are loaded
# Peak resident memory less what was resident once the models were loaded (0.8 GB), against
# the bytes estimate_bytes counts, measured with SmolLM2 after chunked prefill and the
# memoised cut rows: 17.1 GB at 8 K, batch 8 (the streaming draft, 2ad184b) counting 12.1;
# 10.6 at 8 K, batch 4 (0a7675d) counting 6.0; 10.8 at 4 K, batch 4, four drafters (332ae5d)
# counting 4.6. What is counted, plus BASE_BYTES (the runtime, the compiled programs and
# their temporaries, most with the four drafters), bounds all three. (A factor on the count
# alone, 2.9 before, refused 8 K at batch 8, which fits.)
BASE_BYTES = 6_500_000_000


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
  for c, p in plan:
    check_memory(c, p)
  if overwrite:
    outputs.move_aside(workdir, (REPORT, PLOT, RECORDS))
  records = []
  for c, p in plan:
    lens = [len(x) for x in p.setup.prompts]
    records += [dict(r, context=c, prompt_lens=lens) for r in harness.execute(p, progress)]
    forget(p)
  wd.restart_jsonl(os.path.join(workdir, RECORDS), records)
  write_report(workdir, records, cfg)
  return records


def cache_bytes(cfg, batch: int, capacity: int) -> int:
  """A KV cache's bytes, from its shapes (nothing allocated)."""
  shapes = jax.eval_shape(lambda: kvc.init_cache(cfg, batch, capacity))
  return sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(shapes))


def estimate_bytes(p: harness.Plan) -> int:
  """What a context's largest batch holds at once besides the weights: the
  target's cache three times (a run's, the copy it starts from, a cost
  probe's), the draft model's twice, and the rows prefilled once each
  (MemoRunner's: the prompts and a large batch's cut rows) per hidden-state
  choice (target-only's and each feature-reading drafter's), + BASE_BYTES
  (measured)."""
  loop, batch = p.setup.loop, max(p.setup.cfg.batches)
  target = cache_bytes(loop.target.cfg, batch, loop.capacity)
  draft = 0 if loop.draft is None else cache_bytes(loop.draft.cfg, batch, loop.capacity)
  choices = 1 + len({d.feature_layers for d in p.setup.drafters if d.needs_features})
  rows = len(loop.target.prompts) * choices * cache_bytes(loop.target.cfg, 1, loop.capacity)
  return int(BASE_BYTES + 3 * target + 2 * draft + rows)


def check_memory(context: int, p: harness.Plan) -> None:
  """Refuses, in one line and before any work, a context whose largest batch
  would not fit in MEMORY_MARGIN of the memory available now."""
  need, have = estimate_bytes(p), memory.available_bytes()
  if have is not None and need > MEMORY_MARGIN * have:
    raise ConfigError(
        f"context {context} at batch {max(p.setup.cfg.batches)} needs about {need / 2**30:.1f} "
        f"GiB, {have / 2**30:.1f} GiB available: drop it from config.contexts or lower "
        f"config.batches")


def forget(p: harness.Plan) -> None:
  """A finished context's prefilled rows and compiled programs: none serves
  the next context's shapes."""
  for runner in (p.setup.loop.target, p.setup.loop.draft):
    if isinstance(runner, prefills.MemoRunner):
      runner.memo.clear()
  jax.clear_caches()
  memory.release_memory()


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
           "| context | batch | T | drafter | gamma | speedup | fastest |",
           "|---|---|---|---|---|---|---|"]
  for (c, b, t), r in sorted(best(records).items()):
    fastest = r["drafter"] if r["speedup"] > 1 else "target-only"
    lines.append(f"| {c} | {b} | {t:g} | {r['drafter']} | {r['gamma']} | {r['speedup']:.2f}x "
                 f"| {fastest} |")
  lines += ["", "## Every point\n", *table(records)]
  with open(os.path.join(workdir, REPORT), "w") as f:
    f.write("\n".join(lines) + "\n")
  context_plot.plot(records, os.path.join(workdir, PLOT))
