"""The gamma x acceptance sweep: measured speedup next to the theory's.

For every (gamma, acceptance rule, temperature) point, in one run on one
machine:
  measured   target-only tokens/s and speculative tokens/s (device loop,
             medians over repetitions of identical work, the two alternating),
             their ratio, and the acceptance statistics (specjax.metrics.stats);
  costs      T_target(1), T_target(gamma), T_target(gamma+1) and T_draft(1)
             with the point's sampling settings, measured in every repetition
             right after the runs they predict, and the point's accept cost
             (specjax.bench.costs); points that differ only in their rule share
             the target-only runs and the probes (run_group);
  predicted  Leviathan's Theorem 3.8 at the measured alpha and c, the
             thread's approximation, and the measured-cost model
             (costs.predict);
  efficiency measured / measured-cost prediction, paired within each
             repetition (run_group), median over repetitions;
  split      draft / verify / accept / rest shares of the step time, from
             one run of the host loop (which times each phase).
Nothing may compile inside a timed repetition: it would be timed as work.

Outputs (workdir, specjax.workdir's conventions): results.jsonl (appended as
each point finishes; `resume` skips finished points), results.csv,
config.json, costs.json, speedup.png, verify_cost.png, acceptance.png and
summary.md. Records follow specjax.metrics.schema.
"""

from __future__ import annotations

import dataclasses
import os
import statistics
import time
from typing import Any

import numpy as np

from specjax.decode import acceptance
from specjax.decode import autogamma
from specjax.formats import checkpoint
from specjax.bench import costs
from specjax.decode import probes
from specjax.drafters import base as drafters
from specjax.drafters import draft_model, registry
from specjax.decode import generation
from specjax.metrics import schema
from specjax.decode import speculative
from specjax.metrics import theory
from specjax.metrics import stats as stats_lib
from specjax.model import steps
from specjax import workdir as wd
from specjax.errors import SpecjaxError
from specjax.model.sampling import SamplingParams
from specjax.metrics.timing import CompileWatch
from specjax.workdir import Record
from specjax.bench.sweep_points import (AUTO, Point, batch_prompts, check_same_sweep,
                                         drafter_specs, group_key, point_key,
                                         sweep_prompts, validate)



@dataclasses.dataclass
class Bench:
  """What every point of a sweep shares: models, prompts, capacity, probes."""
  target: steps.Runner
  draft: steps.Runner | None  # the draft model (drafter `model`), else None
  prompts: list[list[int]]
  capacity: int
  probe_t: probes.CostProbe
  probe_d: probes.CostProbe | probes.ProposeProbe
  cfg: Any
  compiled: set = dataclasses.field(default_factory=set)  # programs already run once
  drafter: drafters.Drafter = draft_model.MODEL
  probes: dict = dataclasses.field(default_factory=dict)  # batch -> (target, draft) probes
  batch_costs: dict = dataclasses.field(default_factory=dict)  # batch -> autogamma.BatchCosts
  auto_costs: dict = dataclasses.field(default_factory=dict)  # auto point key -> calibrated costs

  def probe(self, batch: int) -> tuple[probes.CostProbe, probes.CostProbe]:
    """The (target, draft) cost probes at `batch` (batch 1: probe_t, probe_d)."""
    if batch == 1:
      return self.probe_t, self.probe_d
    if batch not in self.probes:
      make = lambda m: probes.CostProbe(m, self.capacity, self.probe_t.depth,
                                       k=probes.PROBE_REPEATS, batch=batch)
      # a model-free drafter's proposal cost is per row and tiny: its batch-1 probe
      draft = (make(self.probe_d.m) if isinstance(self.probe_d, probes.CostProbe)
               else self.probe_d)
      self.probes[batch] = (make(self.target), draft)
    return self.probes[batch]

  @property
  def auto_set(self) -> tuple[int, ...]:
    return tuple(sorted(int(g) for g in self.cfg.gammas))

  def warm_up(self, p: Point, split: bool) -> float:
    """Runs once, untimed, what this point needs and no earlier point has
    compiled: the speculative loop (one program per gamma, rule kind and
    sampling settings: a simulated rule's rate is traced), the target-only
    loop (per sampling settings) and the host loop's phases. Returns the
    compile seconds (0 when everything was warm)."""
    kind = acceptance.parse_rule(p.accept_rule).simulated
    runs = {("spec", p.batch, p.gamma, kind, p.sp): lambda: self.spec(p),
            ("base", p.batch, p.sp): lambda: self.base(p)}
    if p.auto:  # every gamma's chunk program, each forced once
      runs[("spec", p.batch, p.gamma, kind, p.sp)] = lambda: [
          r for g in self.auto_set for r in self.spec(p, fixed=[g])]
    if split and not p.auto:
      runs[("host", p.batch, p.gamma, kind, p.sp)] = lambda: self.spec(p, "host")
    compile_s = 0.0
    for key, run in runs.items():
      if key not in self.compiled:
        compile_s += sum(r.compile_s for r in run())
        self.compiled.add(key)
    if p.auto and p.key not in self.auto_costs and self.cfg.get("auto_calibrate", True):
      # each gamma's loop step timed in the loop itself (first prompt group)
      self.auto_costs[p.key] = autogamma.calibrate(
          self.target, self.draft, batch_prompts(self.prompts, p.batch)[0],
          int(self.cfg.n_predict), self.batch_costs[p.batch], self.auto_set, sp=p.sp,
          rule=p.accept_rule, seed=int(self.cfg.seed), capacity=self.capacity,
          every=int(self.cfg.get("auto_every", autogamma.EVERY)), drafter=self.drafter)
    return compile_s

  def spec(self, p: Point, loop: str = "device", fixed=None) -> list[speculative.SpecResult]:
    c = self.cfg
    if p.auto:
      cost = (self.batch_costs[p.batch] if fixed is not None else
              self.auto_costs.get(p.key, self.batch_costs[p.batch]))
      return [autogamma.generate(self.target, self.draft, rows, int(c.n_predict),
                                 cost, self.auto_set, sp=p.sp,
                                 rule=p.accept_rule, seed=int(c.seed), capacity=self.capacity,
                                 every=int(c.get("auto_every", autogamma.EVERY)), fixed=fixed,
                                 drafter=self.drafter)
              for rows in batch_prompts(self.prompts, p.batch)]
    return [speculative.generate(self.target, self.draft, rows, int(c.n_predict), p.gamma,
                                 sp=p.sp, rule=p.accept_rule, seed=int(c.seed),
                                 capacity=self.capacity, loop=loop, drafter=self.drafter)
            for rows in batch_prompts(self.prompts, p.batch)]

  def base(self, p: Point) -> list[generation.GenerationResult]:
    c = self.cfg
    return [generation.generate(self.target, rows, int(c.n_predict), p.sp, seed=int(c.seed),
                                capacity=self.capacity)
            for rows in batch_prompts(self.prompts, p.batch)]


PROBE_REPS = 3  # probe repetitions per sweep repetition (of probes.PROBE_REPEATS forwards)


def _rep_costs(bench: Bench, p: Point) -> dict[str, float]:
  """The point's costs at its batch, each the median of PROBE_REPS short
  probes: cheap next to the runs, and a single probe is as noisy as the
  machine."""
  probe_t, probe_d = bench.probe(p.batch)
  ts = probe_t.times([1, p.gamma, p.gamma + 1], PROBE_REPS, sp=p.sp)
  return {"t_target": ts[1].median, "t_target_gamma": ts[p.gamma].median,
          "t_verify": ts[p.gamma + 1].median,
          "t_draft": probe_d.times([1], PROBE_REPS, sp=p.sp)[1].median}


def loop_steps(res: list[speculative.SpecResult]) -> tuple[int, int, int]:
  """(loop steps, row-steps of the rows a loop step carried, loop steps in
  which some row first fed the draft d_gamma), summed over the runs: a batch
  loop runs until its slowest row is done, and its catch-up forward runs
  when any row needs it."""
  steps = carried = catchup = 0
  for r in res:
    rec = r.records
    s = int(rec.step.max()) + 1 if rec.step.size else 0
    steps += s
    carried += s * (int(rec.row.max()) + 1 if rec.row.size else 0)
    catchup += len(np.unique(rec.step[rec.caught_up.astype(bool)]))
  return steps, carried, catchup


def expected_steps(p: Point, st: stats_lib.SpecStats, groups: list[list[list[int]]],
                   n_predict: int) -> float:
  """The tail model's expected loop steps (theory.expected_batch_steps), summed
  over the point's runs: a simulated rule's own law of accepted counts, the
  capped geometric at the measured alpha for the real rule."""
  rule = acceptance.parse_rule(p.accept_rule).resolve(p.gamma)
  pmf = (theory.accept_pmf_from_position_probs(acceptance.position_probs(rule, p.gamma))
         if rule.simulated else theory.geometric_accept_pmf(st.alpha, p.gamma))
  return sum(theory.expected_batch_steps(pmf, n_predict - 1, len(rows)) for rows in groups)


def _batch_predictions(p: Point, st, c: costs.StepCosts, steps: int, carried: int,
                       catchup: int, exp_steps: float) -> dict[str, float]:
  """At batch B, from costs measured at B (speeds count the tokens of every row):
    step_s                  (gamma + catch-up share) T_draft(B,1) + T_target(B,gamma+1) + T_accept(B)
    predicted_measured_cost n_kept / carried row-steps x T_target(B,1) / step_s
                            (the measured number of loop steps: equals costs.predict at B = 1)
    predicted_tail          the same with the tail model's expected steps."""
  share = catchup / steps if steps else 0.0
  step_s = (p.gamma + share) * c.t_draft + c.t_verify + c.t_accept
  rows = carried / steps if steps else 1.0
  per_row_steps = carried / rows if rows else 0.0
  return {"predicted_step_s": step_s,
          "predicted_measured_cost": st.n_kept / carried * c.t_target / step_s if carried else 0.0,
          "predicted_tail": st.n_kept / rows / exp_steps * c.t_target / step_s if exp_steps else 0.0,
          "catchup_any_share": share, "steps_measured": per_row_steps}


def run_group(bench: Bench, ps: list[Point]) -> list[Record]:
  """Measures the points of one group (group_key: they differ only in their
  acceptance rule) and their predictions; one record per point, in order.

  Each repetition runs target-only generation once and every point's
  speculative generation (at batch 1 each over every prompt, one after
  another; at batch B > 1 one run of B ragged rows: batch_prompts; the
  target-only run goes first in even repetitions and last in odd ones), then
  the cost probes at the group's batch and gamma, once. The target-only run
  and the probes do not depend on the rule, so the group shares them: the
  same quantities as measuring them per point, at a fraction of the time.
  Each point pairs them with its own run: its speedup in a repetition is the
  ratio of the two runs, its prediction comes from the probes taken right
  after them, and its efficiency is their ratio. The machine's speed drifts
  over seconds; pairing within a repetition cancels the drift that a ratio
  of medians taken apart would keep. Reported: the median over repetitions
  of each (speed and costs too). Tokens/s pool all prompts and rows; so do
  the acceptance statistics (identical in every repetition: same seed).
  An auto point (gamma chosen at run time) has no cost prediction.
  """
  if len({group_key(p) for p in ps}) != 1:
    raise ValueError(f"run_group: points of different groups {[p.key for p in ps]}")
  p0 = ps[0]
  split = bool(bench.cfg.measure_split) and not p0.auto
  compile_s = [bench.warm_up(p, split) for p in ps]  # the probes warm up on their first call
  t_accept = [None if p.auto else probes.accept_cost(
      speculative.SpecConfig(bench.target.cfg, bench.draft and bench.draft.cfg, p.gamma, p.sp,
                             acceptance.parse_rule(p.accept_rule).simulated,
                             drafter=bench.drafter),
      int(bench.cfg.reps), batch=p.batch).median for p in ps]
  reps: list[list[dict]] = [[] for _ in ps]
  for rep in range(int(bench.cfg.reps)):
    with CompileWatch() as cw:
      first = rep % 2 == 0
      b = bench.base(p0) if first else None
      res = [bench.spec(p) for p in ps]
      if not first:
        b = bench.base(p0)
    if cw.count:
      raise SpecjaxError(f"{cw.count} compilation(s) inside timed repetition {rep} of "
                         f"{[p.key for p in ps]} ({dict(cw.names)}): shapes changed between runs")
    probed = {} if p0.auto else _rep_costs(bench, p0)
    base_s = sum(r.eval_s for r in b) / sum(r.n_eval * len(r.tokens) for r in b)
    for i, r_i in enumerate(res):
      reps[i].append({"base_s": base_s,
                      "spec_s": sum(r.eval_s for r in r_i) / sum(r.stats.n_kept for r in r_i),
                      **probed})
  return [_point_record(bench, p, reps[i], res[i], compile_s[i], t_accept[i],
                        split) for i, p in enumerate(ps)]


def _point_record(bench: Bench, p: Point, reps: list[dict], res: list[speculative.SpecResult],
                  compile_s: float, t_accept: float | None, split: bool) -> Record:
  """One point's record from its repetitions (run_group) and its last runs."""
  pooled = stats_lib.Records.concat([r.records for r in res])
  gamma = max(bench.auto_set) if p.auto else p.gamma
  st = stats_lib.SpecStats.compute(pooled, gamma=gamma,
                                   n_predict=sum(r.stats.n_predict for r in res))
  steps, carried, catchup = loop_steps(res)
  groups = batch_prompts(bench.prompts, p.batch)
  for r in reps:
    r["speedup"] = r["base_s"] / r["spec_s"]
  med = lambda k: statistics.median(r[k] for r in reps)
  common = dict(
      batch=p.batch, accept_rule=p.accept_rule, temperature=p.sp.temperature,
      top_k=p.sp.top_k, top_p=p.sp.top_p, seed=int(bench.cfg.seed), loop="device",
      capacity=bench.capacity, n_prompts=len(bench.prompts), reps=int(bench.cfg.reps),
      baseline_tps=1 / med("base_s"), spec_tps=1 / med("spec_s"), speedup=med("speedup"),
      compile_s=compile_s, loop_steps=steps, steps_measured=steps / len(groups))
  if p.auto:
    used = [g for r in res for g in r.gammas_used]
    return schema.run_record(
        st, **common, gamma=AUTO, auto_set=list(bench.auto_set),
        auto_every=int(bench.cfg.get("auto_every", autogamma.EVERY)),
        gammas_used={str(g): used.count(g) for g in bench.auto_set},
        auto_alpha=[r.alphas[-1] if r.alphas else None for r in res],
        auto_step_s={str(g): t for g, t in getattr(bench.auto_costs.get(p.key), "t_step",
                                                   {}).items()})
  exp_steps = expected_steps(p, st, groups, int(bench.cfg.n_predict))

  def predictions(c: costs.StepCosts) -> dict[str, float]:
    pred = costs.predict(st, c)
    if p.batch > 1:
      pred.update(_batch_predictions(p, st, c, steps, carried, catchup, exp_steps))
    else:
      pred["predicted_tail"] = _batch_predictions(p, st, c, steps, carried, catchup,
                                                  exp_steps)["predicted_tail"]
    return pred

  for r in reps:
    step = costs.StepCosts(r["t_target"], r["t_target_gamma"], r["t_verify"], r["t_draft"],
                           t_accept)
    pred = predictions(step)
    r["efficiency"] = r["speedup"] / pred["predicted_measured_cost"]
    r["efficiency_tail"] = r["speedup"] / pred["predicted_tail"]
  step_costs = costs.StepCosts(med("t_target"), med("t_target_gamma"), med("t_verify"),
                               med("t_draft"), t_accept)
  pred = predictions(step_costs)
  pred.pop("steps_measured", None)
  return schema.run_record(
      st, **common, gamma=p.gamma,
      t_target_s=step_costs.t_target, t_target_gamma_s=step_costs.t_target_gamma,
      t_verify_s=step_costs.t_verify, t_draft_s=step_costs.t_draft, t_accept_s=t_accept,
      c=step_costs.c, verify_ratio=step_costs.verify_ratio, **pred,
      steps_predicted=exp_steps / len(groups),
      efficiency=med("efficiency"), efficiency_reps=[r["efficiency"] for r in reps],
      efficiency_tail=med("efficiency_tail"),
      geometric=stats_lib.geometric_check(st),
      **(time_split(bench, p) if split else {}))


def time_split(bench: Bench, p: Point) -> dict[str, float]:
  """Shares of the step time per phase, from a run of the host loop (its
  phases compiled by Bench.warm_up)."""
  phase: dict[str, float] = {}
  for r in bench.spec(p, "host"):
    for k, v in r.stats.phase_s.items():
      phase[k] = phase.get(k, 0.0) + v
  total = sum(phase.values())
  return {f"{k[:-2]}_share": v / total for k, v in phase.items()}


def run_sweep(cfg, workdir: str, resume: bool = False, progress: bool = True) -> list[Record]:
  """Runs every point of the config; returns all records (finished + new)."""
  if tuple(cfg.get("trees", ())):  # the trees dimension: bench/tree_sweep.py
    from specjax.bench import tree_sweep  # pylint: disable=import-outside-toplevel
    return tree_sweep.run_tree_sweep(cfg, workdir, resume, progress=True)
  validate(cfg)
  os.makedirs(workdir, exist_ok=True)
  jsonl = os.path.join(workdir, wd.RESULTS)
  done = wd.read_jsonl(jsonl) if resume else []
  if done:
    check_same_sweep(workdir, cfg)
  wd.restart_jsonl(jsonl, done)  # whole records only: a torn line is dropped
  env = wd.environment()
  wd.write_config(workdir, cfg.to_dict(), env, schema=schema.SCHEMA_VERSION)

  specs = [registry.parse(x) for x in drafter_specs(cfg)]
  tcfg, tparams, tok = checkpoint.load_model(cfg.target, dtype=cfg.dtype, seed=int(cfg.seed))
  target, draft = steps.Runner(tcfg, tparams), None
  if any(d.needs_draft_model for d in specs):
    dcfg, dparams, _ = checkpoint.load_model(cfg.draft, dtype=cfg.dtype, seed=int(cfg.seed) + 1,
                                             role="draft")
    speculative.check_vocabularies(tcfg, dcfg)  # before any timing
    draft = steps.Runner(dcfg, dparams)
  prompts = sweep_prompts(cfg, tok, tcfg.vocab_size)
  depth = max(len(p) for p in prompts)
  gammas = sorted(int(g) for g in cfg.gammas)
  capacity = generation.plan_capacity(tcfg, depth, int(cfg.n_predict),
                                      extra=max(gammas), ctx_size=int(cfg.ctx_size))
  probe_t = probes.CostProbe(target, capacity, depth, k=probes.PROBE_REPEATS)
  benches = {}
  for drafter in specs:  # one bench per drafter; the target and its probe are shared
    # the model the drafter runs (the draft, a layer subset of the target, or none)
    probe_d = probes.draft_probe(drafter, target, draft, max(gammas), capacity, depth,
                                k=probes.PROBE_REPEATS)
    benches[drafter.spec] = Bench(target, draft if drafter.needs_draft_model else None,
                                  prompts, capacity, probe_t, probe_d, cfg, drafter=drafter)
  batches = sorted(int(b) for b in cfg.get("batches", (1,)))
  auto = [AUTO] if cfg.get("auto_gamma", False) else []
  points = [Point(g, a, SamplingParams(float(t), int(cfg.top_k), float(cfg.top_p)), b, d.spec)
            for d in specs for b in batches for t in cfg.temps for g in gammas + auto
            for a in cfg.accepts]
  finished = {point_key(r) for r in done}
  todo = [p for p in points if p.key not in finished]

  curves = {}
  for spec, bench in benches.items():
    curve_d = dict(costs.measure_curve(bench.probe_t, bench.probe_d, gammas,
                                       int(cfg.reps)).to_dict(), drafter=spec)
    if len(batches) > 1 or auto:  # the cost surface at every batch (auto points choose from it)
      bench.batch_costs = measure_batch_costs(bench, batches, gammas, cfg)
      curve_d["batches"] = {str(b): c.to_dict() for b, c in bench.batch_costs.items()}
    curves[spec] = curve_d
  # costs.json: the first drafter's costs at the top level (one-drafter sweeps
  # as before), every drafter's under "drafters"
  curve_d = dict(curves[specs[0].spec], **({"drafters": curves} if len(specs) > 1 else {}))
  wd.write_json(os.path.join(workdir, "costs.json"), curve_d)
  records = list(done)
  bar = _progress(len(points), len(points) - len(todo), progress)
  t_start = time.perf_counter()
  groups: dict[tuple, list[Point]] = {}
  for p in todo:  # in order; a group's points follow one another in `points`
    groups.setdefault(group_key(p), []).append(p)
  n_done = 0
  for group in groups.values():
    bench = benches[group[0].drafter]
    recs = run_group(bench, group)
    n_done += len(group)
    left = (time.perf_counter() - t_start) / n_done * (len(todo) - n_done)
    for p, rec in zip(group, recs):
      prompt_set = ({"prompt_set": str(cfg.get("prompt_set", "continuation"))}
                    if int(cfg.get("heldout_prompts", 0)) else {})
      d_cfg = bench.drafter.draft_config(tcfg, draft and draft.cfg)
      rec.update(target=tcfg.name, draft=d_cfg.name if d_cfg is not None else None,
                 drafter=p.drafter, **prompt_set,
                 precision=tcfg.precision, env=env)
      wd.append_jsonl(jsonl, [rec])
      records.append(rec)
      wd.write_csv(os.path.join(workdir, wd.CSV_FILE), records, schema.CSV_COLUMNS)
      bar.update(1)
      bar.set_postfix_str(f"{p.drafter} B={p.batch} g={p.gamma} {p.accept_rule} "
                          f"T={p.sp.temperature:g}: {rec['speedup']:.2f}x")
      if not progress:  # logs: one line per point with the time left
        eff = f", efficiency {rec['efficiency']:.3f}" if "efficiency" in rec else ""
        print(f"point {len(records)}/{len(points)}: {p.drafter}, batch {p.batch}, "
              f"gamma {p.gamma}, {p.accept_rule}, T={p.sp.temperature:g}: speedup "
              f"{rec['speedup']:.3f}x{eff}; ~{left / 60:.1f} min left", flush=True)
  bar.close()
  from specjax.bench import sweep_report  # matplotlib only when writing the report
  sweep_report.write_report(workdir, records, curve_d, env, int(cfg.n_predict) - 1)
  return records


def measure_batch_costs(bench: Bench, batches: list[int], gammas: list[int],
                        cfg) -> dict[int, autogamma.BatchCosts]:
  """T_target(B, n) for n = 1, every gamma and gamma + 1, T_draft(B, 1) and
  the accept cost of the sweep's first rule kind at every gamma (greedy), at
  every batch: the verify-cost surface and what auto points choose from."""
  sp = SamplingParams(0.0, int(cfg.top_k), float(cfg.top_p))
  simulated = acceptance.parse_rule(cfg.accepts[0]).simulated
  ns = sorted({1} | set(gammas) | {g + 1 for g in gammas})
  out = {}
  for b in batches:
    probe_t, probe_d = bench.probe(b)
    t_target = {n: t.median for n, t in probe_t.times(ns, int(cfg.reps), sp=sp).items()}
    t_draft = probe_d.times([1], int(cfg.reps), sp=sp)[1].median
    t_accept = {g: probes.accept_cost(speculative.SpecConfig(bench.target.cfg,
                                                            bench.draft and bench.draft.cfg,
                                                            g, sp, simulated,
                                                            drafter=bench.drafter),
                                     int(cfg.reps), batch=b).median for g in gammas}
    out[b] = autogamma.BatchCosts(b, t_target, t_draft, t_accept)
  return out


def _progress(total: int, initial: int, enabled: bool):
  from tqdm import tqdm  # pylint: disable=import-outside-toplevel
  return tqdm(total=total, initial=initial, desc="sweep points", unit="pt",
              disable=not enabled, dynamic_ncols=True)
