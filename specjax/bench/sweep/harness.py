"""The sweeps' harness: one owner of the workdir, the resume, the models, the
prompts, the capacity and the record stamping, for every runner (the gamma
sweep, gamma.RUNNER; the trees sweep, trees.RUNNER; the task suite runs
them per category). A runner only measures its points and writes its report.

`prepare` checks everything before any work and writes nothing: the
settings (typed config, then the runner's own `check`), the workdir
(outputs.check), the models, the prompts and the capacity. The models
prefill each prompt once (prefills.MemoRunner). `execute` then
claims the workdir, measures the points not finished yet (each record
appended to results.jsonl as it finishes), and writes costs.json, the
report, and noise.json with the summary's noise section (noise.py).
"""

from __future__ import annotations

import dataclasses
import os
import time
from typing import Any, Callable, Protocol

from specjax import workdir as wd
from specjax.bench import memory
from specjax.bench.sweep import engine, noise, outputs, prefills
from specjax.bench.sweep import points as points_mod
from specjax.bench.sweep.config import SweepConfig
from specjax.bench.sweep.prompts import sweep_prompts
from specjax.formats import checkpoint
from specjax.model import steps
from specjax.workdir import Record

Emit = Callable[[Any, Record], None]


@dataclasses.dataclass
class Setup:
  """What every point of a sweep shares."""
  cfg: SweepConfig
  loop: engine.Loop       # the models, capacity, n_predict and seed, bound to the engine
  drafters: list          # the drafters compared (drafters.base.Drafter), in order
  prompts: list[list[int]]
  env: Record

  @property
  def depth(self) -> int:
    """The longest prompt: the probes' cache depth."""
    return max(len(p) for p in self.prompts)


class Runner(Protocol):
  """A sweep's dimension: its points, how it measures them, its report."""
  csv_columns: tuple[str, ...]  # results.csv's columns

  def check(self, cfg: SweepConfig) -> None: ...  # its settings, before any work
  def points(self, cfg: SweepConfig, drafters: list[str]) -> list: ...  # each has .key, .label
  def record_key(self, rec: Record) -> tuple: ...
  def extra_slots(self, cfg: SweepConfig) -> int: ...  # cache slots past prompt + n_predict
  def measure(self, setup: Setup, todo: list, emit: Emit) -> tuple[dict, list[str]]: ...
  def point_line(self, rec: Record) -> str: ...
  def report(self, workdir: str, records: list[Record], costs: dict, setup: Setup,
             notes: list[str]) -> str: ...


@dataclasses.dataclass
class Plan:
  """A checked sweep, ready to run: nothing written yet."""
  runner: Runner
  setup: Setup
  claim: outputs.Claim
  points: list
  todo: list


Models = dict  # (spec, dtype, seed, role) -> (ModelConfig, params, tokenizer): loaded once


def load(spec: str, cfg: SweepConfig, role: str, models: Models):
  key = (spec, cfg.dtype, cfg.seed + (role == "draft"), role)
  if key not in models:
    models[key] = checkpoint.load_model(spec, dtype=cfg.dtype, seed=key[2], role=role)
  return models[key]


def prepare(runner: Runner, cfg: SweepConfig, workdir: str, resume: bool = False,
            overwrite: bool = False, models: Models | None = None) -> Plan:
  """Every check of a sweep, before any work (module docstring)."""
  runner.check(cfg)
  env = wd.environment()
  claim = outputs.check(workdir, cfg, env, resume, overwrite)
  models = {} if models is None else models
  drafters = [engine.drafter(x) for x in cfg.drafter_specs]
  tcfg, tparams, tok = load(cfg.target, cfg, "target", models)
  target, draft = steps.Runner(tcfg, tparams), None
  if any(d.needs_draft_model for d in drafters):
    dcfg, dparams, _ = load(cfg.draft, cfg, "draft", models)
    engine.check_vocabularies(tcfg, dcfg)
    draft = steps.Runner(dcfg, dparams)
  prompts = sweep_prompts(cfg, tok, tcfg.vocab_size)
  rows = points_mod.distinct_rows(prompts, cfg.batches)
  target, draft = prefills.wrap(target, rows), prefills.wrap(draft, rows)
  capacity = engine.plan_capacity(tcfg, max(len(p) for p in prompts), cfg.n_predict,
                                  extra=runner.extra_slots(cfg), ctx_size=cfg.ctx_size)
  loop = engine.Loop(target, draft, capacity, cfg.n_predict, cfg.seed)
  setup = Setup(cfg, loop, drafters, prompts, env)
  points = runner.points(cfg, [d.spec for d in drafters])
  finished = {runner.record_key(r) for r in claim.done}
  return Plan(runner, setup, claim, points, [p for p in points if p.key not in finished])


def stamp(setup: Setup, point, rec: Record) -> Record:
  """What every record carries besides its measurements: the models, the
  drafter, the prompts (when shipped ones), the precision, the machine
  (with the load average when the point finished, and the process's
  resident memory then and at its peak so far)."""
  loop, d = setup.loop, next(x for x in setup.drafters if x.spec == point.drafter)
  rec.update(target=loop.target.cfg.name, draft=engine.draft_name(d, loop.target, loop.draft),
             drafter=point.drafter, precision=loop.target.cfg.precision,
             env=dict(setup.env, load_avg=wd.load_avg(), rss_bytes=memory.rss(),
                      peak_rss_bytes=memory.peak_rss()))
  if setup.cfg.heldout_prompts:
    rec["prompt_set"] = setup.cfg.prompt_set
  return rec


def execute(plan: Plan, progress: bool = True) -> list[Record]:
  """Runs a prepared sweep; returns every record (finished + new)."""
  setup, workdir = plan.setup, plan.claim.workdir
  outputs.claim(plan.claim, setup.cfg, setup.env)
  jsonl = os.path.join(workdir, wd.RESULTS)
  records = list(plan.claim.done)
  bar = _progress(len(plan.points), len(plan.points) - len(plan.todo), progress)
  t0, n_new = time.perf_counter(), 0

  def emit(point, rec: Record) -> None:
    nonlocal n_new
    rec = stamp(setup, point, rec)
    memory.release_memory()  # the point's freed caches, before the next point's come
    wd.append_jsonl(jsonl, [rec])
    records.append(rec)
    wd.write_csv(os.path.join(workdir, wd.CSV_FILE), records, plan.runner.csv_columns)
    n_new += 1
    line = f"{point.label}: {plan.runner.point_line(rec)}"
    bar.update(1)
    bar.set_postfix_str(line)
    if not progress:  # logs: one line per point with the time left
      left = (time.perf_counter() - t0) / n_new * (len(plan.todo) - n_new)
      print(f"point {len(records)}/{len(plan.points)}: {line}; ~{left / 60:.1f} min left",
            flush=True)

  costs, notes = plan.runner.measure(setup, plan.todo, emit)
  bar.close()
  wd.write_json(os.path.join(workdir, "costs.json"), costs)
  found = noise.assess(records, setup.cfg.noise_threshold)
  wd.write_json(os.path.join(workdir, "noise.json"), found)
  text = plan.runner.report(workdir, records, costs, setup, notes)
  with open(os.path.join(workdir, wd.SUMMARY), "w") as f:
    f.write(noise.with_section(text, found))
  return records


def run(runner: Runner, cfg: SweepConfig, workdir: str, resume: bool = False,
        overwrite: bool = False, progress: bool = True) -> list[Record]:
  """prepare, then execute: every record of the sweep (finished + new)."""
  return execute(prepare(runner, cfg, workdir, resume, overwrite), progress)


def _progress(total: int, initial: int, enabled: bool):
  from tqdm import tqdm  # pylint: disable=import-outside-toplevel
  return tqdm(total=total, initial=initial, desc="sweep points", unit="pt",
              disable=not enabled, dynamic_ncols=True)
