"""The gamma sweep's runner (`RUNNER`): points (drafter, batch, gamma, rule,
temperature), measured speedup next to the theory's.

Per point, in one run on one machine: target-only and speculative tokens/s
(device loop, medians over repetitions of identical work, the two
alternating), their ratio and the acceptance statistics; the costs T(1),
T(gamma), T(gamma+1), T_draft(1) probed in every repetition right after the
runs they predict, and the accept cost (costs.py); Leviathan's, the thread's
and the measured-cost predictions; efficiency = measured / prediction,
paired within a repetition; with measure_split, the phases' shares of a step
from one host-loop run. Points that differ only in their rule share the
target-only runs and the probes (`run_group`); per-row lengths' points
(`row_budgets`) are rows.py's. Nothing may compile inside a timed
repetition. The harness (harness.py) owns the workdir and the records;
gamma_report.py writes the report. docs/sweep.md.
"""

from __future__ import annotations

import dataclasses
import statistics

from specjax.bench.sweep import costs, engine, gamma_report, points, rows
from specjax.bench.sweep.config import SweepConfig
from specjax.bench.sweep.harness import Emit, Setup
from specjax.bench.sweep.points import AUTO, Point, batch_prompts, group_key
from specjax.errors import SpecjaxError
from specjax.metrics import schema, stats as stats_lib, theory
from specjax.metrics.timing import CompileWatch
from specjax.workdir import Record

PROBE_REPS = 3  # probe repetitions per sweep repetition (of engine.PROBE_REPEATS forwards)


@dataclasses.dataclass
class Bench:
  """What the points of one drafter share: the loop, prompts, probes, costs."""
  setup: Setup
  drafter: object  # drafters.base.Drafter
  probe_t: engine.CostProbe
  probe_d: engine.CostProbe | engine.ProposeProbe
  compiled: set = dataclasses.field(default_factory=set)  # programs already run once
  probes: dict = dataclasses.field(default_factory=dict)  # batch -> (target, draft) probes
  # batch -> the target's probe, shared by every drafter's Bench: each holds a cache of
  # its batch at the sweep's depth (at 4 K, batch 8: 1.5 GB), once, not once per drafter
  targets: dict = dataclasses.field(default_factory=dict)
  batch_costs: dict = dataclasses.field(default_factory=dict)  # batch -> engine.BatchCosts
  auto_costs: dict = dataclasses.field(default_factory=dict)  # auto point key -> calibrated
  packed: dict = dataclasses.field(default_factory=dict)  # (batch, G) -> engine.PackedProbe

  @property
  def cfg(self) -> SweepConfig:
    return self.setup.cfg

  @property
  def loop(self) -> engine.Loop:
    return self.setup.loop

  @property
  def auto_set(self) -> tuple[int, ...]:
    return tuple(sorted(self.cfg.gammas))

  def probe(self, batch: int):
    """The (target, draft) cost probes at `batch` (batch 1: probe_t, probe_d)."""
    if batch == 1:
      return self.probe_t, self.probe_d
    if batch not in self.probes:
      make = lambda m: self.loop.cost_probe(m, self.setup.depth, batch)
      # a model-free drafter's proposal cost is per row and tiny: its batch-1 probe,
      # unless it reads the batch's cache (streaming)
      draft = (make(self.probe_d.m) if isinstance(self.probe_d, engine.CostProbe)
               else self.loop.draft_probe(self.drafter, self.probe_d.sc.gamma,
                                          self.setup.depth, batch)
               if self.drafter.reads_batch_cache else self.probe_d)
      if batch not in self.targets:
        self.targets[batch] = make(self.loop.target)
      self.probes[batch] = (self.targets[batch], draft)
    return self.probes[batch]

  def rows(self, p: Point) -> list[list[list[int]]]:
    return batch_prompts(self.setup.prompts, p.batch)

  def warm_up(self, p: Point, split: bool) -> float:
    """Runs once, untimed, what this point needs and no earlier point has
    compiled: the speculative loop (one program per gamma, rule kind and
    sampling settings: a simulated rule's rate is traced), the target-only
    loop (per sampling settings) and the host loop's phases. Returns the
    compile seconds (0 when everything was warm)."""
    kind = engine.is_simulated(p.accept_rule)
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
    if p.auto and p.key not in self.auto_costs and self.cfg.auto_calibrate:
      # each gamma's loop step timed in the loop itself (first prompt group)
      self.auto_costs[p.key] = self.loop.calibrate_chain(
          self.rows(p)[0], self.batch_costs[p.batch], self.auto_set, p.sp, p.accept_rule,
          self.drafter, self.cfg.auto_every)
    return compile_s

  def spec(self, p: Point, loop: str = "device", fixed=None) -> list:
    if p.auto:
      cost = (self.batch_costs[p.batch] if fixed is not None else
              self.auto_costs.get(p.key, self.batch_costs[p.batch]))
      return [self.loop.auto_chain(rows, cost, self.auto_set, p.sp, p.accept_rule,
                                   self.drafter, self.cfg.auto_every, fixed)
              for rows in self.rows(p)]
    return [self.loop.chain(rows, p.gamma, p.sp, p.accept_rule, self.drafter, loop)
            for rows in self.rows(p)]

  def base(self, p: Point) -> list:
    return [self.loop.target_only(rows, p.sp) for rows in self.rows(p)]


def _rep_costs(bench: Bench, p: Point) -> dict[str, float]:
  """The point's costs at its batch, each the median of PROBE_REPS short
  probes: cheap next to the runs, and a single probe is as noisy as the
  machine."""
  probe_t, probe_d = bench.probe(p.batch)
  ts = probe_t.times([1, p.gamma, p.gamma + 1], PROBE_REPS, sp=p.sp)
  return {"t_target": ts[1].median, "t_target_gamma": ts[p.gamma].median,
          "t_verify": ts[p.gamma + 1].median,
          "t_draft": probe_d.times([1], PROBE_REPS, sp=p.sp)[1].median}


def expected_steps(p: Point, st: stats_lib.SpecStats, groups: list[list[list[int]]],
                   n_predict: int) -> float:
  """The tail model's expected loop steps (theory.expected_batch_steps), summed
  over the point's runs: a simulated rule's own law of accepted counts, the
  capped geometric at the measured alpha for the real rule."""
  pmf = engine.accept_pmf(p.accept_rule, p.gamma, st.alpha)
  return sum(theory.expected_batch_steps(pmf, n_predict - 1, len(rows)) for rows in groups)


def batch_predictions(p: Point, st, c: costs.StepCosts, steps: int, carried: int,
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
  speculative generation (batch_prompts' groups of rows; target-only first
  in even repetitions, last in odd ones), then the cost probes at the
  group's batch and gamma, once: the rule changes none of them, so the group
  shares them. Each point pairs them with its own run (its speedup, its
  prediction from the probes taken right after, their ratio, per
  repetition): the machine's drift cancels within a repetition. Reported:
  medians over repetitions. An auto point has no cost prediction.
  """
  if len({group_key(p) for p in ps}) != 1:
    raise ValueError(f"run_group: points of different groups {[p.key for p in ps]}")
  p0, reps_n = ps[0], bench.cfg.reps
  split = bench.cfg.measure_split and not p0.auto
  compile_s = [bench.warm_up(p, split) for p in ps]  # the probes warm up on their first call
  t_accept = [None if p.auto else bench.loop.accept_s(p.gamma, p.sp, p.accept_rule,
                                                      bench.drafter, reps_n, p.batch)
              for p in ps]
  reps: list[list[dict]] = [[] for _ in ps]
  for rep in range(reps_n):
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
    base_s = sum(r.eval_s for r in b) / sum(r.n_decoded for r in b)
    for i, r_i in enumerate(res):
      reps[i].append({"base_s": base_s,
                      "spec_s": sum(r.eval_s for r in r_i) / sum(r.stats.n_kept for r in r_i),
                      **probed})
  return [point_record(bench, p, reps[i], res[i], compile_s[i], t_accept[i], split)
          for i, p in enumerate(ps)]


def point_record(bench: Bench, p: Point, reps: list[dict], res: list, compile_s: float,
                 t_accept: float | None, split: bool) -> Record:
  """One point's record from its repetitions (run_group) and its last runs."""
  cfg = bench.cfg
  pooled = stats_lib.Records.concat([r.records for r in res])
  st = stats_lib.SpecStats.compute(pooled, gamma=max(bench.auto_set) if p.auto else p.gamma,
                                   n_predict=sum(r.stats.n_predict for r in res))
  steps, carried, catchup = costs.loop_steps(res)
  groups = batch_prompts(bench.setup.prompts, p.batch)
  for r in reps:
    r["speedup"] = r["base_s"] / r["spec_s"]
  med = lambda k: statistics.median(r[k] for r in reps)
  common = costs.point_fields(bench, p, reps, compile_s, steps, len(groups))
  if p.auto:
    used = engine.gammas_chosen(res)
    return schema.run_record(
        st, **common, gamma=AUTO, auto_set=list(bench.auto_set), auto_every=cfg.auto_every,
        gammas_used={str(g): used.count(g) for g in bench.auto_set},
        auto_alpha=engine.last_estimates(res),
        auto_step_s={str(g): t for g, t in getattr(bench.auto_costs.get(p.key), "t_step",
                                                   {}).items()})
  exp_steps = expected_steps(p, st, groups, cfg.n_predict)

  def predictions(c: costs.StepCosts) -> dict[str, float]:
    pred = costs.predict(st, c)
    at_b = batch_predictions(p, st, c, steps, carried, catchup, exp_steps)
    pred.update(at_b if p.batch > 1 else {"predicted_tail": at_b["predicted_tail"]})
    return pred

  for r in reps:
    pred = predictions(costs.StepCosts(r["t_target"], r["t_target_gamma"], r["t_verify"],
                                       r["t_draft"], t_accept))
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
      t_target_s_reps=[r["t_target"] for r in reps],
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


def measure_batch_costs(bench: Bench, batches: list[int]) -> dict[int, engine.BatchCosts]:
  """The verify-cost surface and what auto points choose from, at every
  batch (greedy; the accept cost of the sweep's first rule kind)."""
  cfg = bench.cfg
  sp = cfg.sampling(0.0)
  return {b: engine.batch_costs(bench.loop, *bench.probe(b), b, cfg.gammas, sp, cfg.accepts[0],
                                bench.drafter, cfg.reps) for b in batches}


def drafter_benches(setup: Setup, probe_t, gamma_max: int) -> dict[str, Bench]:
  """A Bench per drafter (by spec), the target's cost probes shared by all of
  them, at batch 1 (probe_t) and at every other batch (Bench.targets)."""
  targets: dict = {}
  return {d.spec: Bench(setup, d, probe_t, setup.loop.draft_probe(d, gamma_max, setup.depth),
                        targets=targets)
          for d in setup.drafters}


class GammaRunner:
  """The gamma sweep's part of the harness (harness.Runner)."""
  csv_columns = schema.CSV_COLUMNS

  def check(self, cfg: SweepConfig) -> None:
    for a in cfg.accepts:
      for g in cfg.gammas:
        engine.check_rule(a, g)
    if cfg.row_budgets:  # per-row lengths run chains: every drafter and rule at G
      for d in cfg.drafter_specs:
        for a in cfg.accepts:
          engine.check_rows(engine.rows_spec(max(cfg.gammas), AUTO), d, a)

  def points(self, cfg: SweepConfig, drafters: list[str]) -> list:
    return points.gamma_points(cfg, drafters)

  def record_key(self, rec: Record) -> tuple:
    return points.point_key(rec)

  def extra_slots(self, cfg: SweepConfig) -> int:
    return max(cfg.gammas)

  def measure(self, setup: Setup, todo: list[Point], emit: Emit) -> tuple[dict, list[str]]:
    """Each drafter's cost curve (costs.json), then the points not done, a
    group at a time; costs.json keeps the first drafter's costs at the top
    level and every drafter's under "drafters"."""
    cfg, loop = setup.cfg, setup.loop
    gammas, batches = sorted(cfg.gammas), sorted(cfg.batches)
    probe_t = loop.cost_probe(loop.target, setup.depth)
    benches, curves = drafter_benches(setup, probe_t, max(gammas)), {}
    for d in setup.drafters:
      bench = benches[d.spec]
      curve = dict(costs.measure_curve(probe_t, bench.probe_d, gammas, cfg.reps).to_dict(),
                   drafter=d.spec)
      if len(batches) > 1 or cfg.auto_gamma:  # the cost surface (auto points choose from it)
        bench.batch_costs = measure_batch_costs(bench, batches)
        curve["batches"] = {str(b): c.to_dict() for b, c in bench.batch_costs.items()}
      curves[d.spec] = curve
    first = curves[setup.drafters[0].spec]
    groups: dict[tuple, list[Point]] = {}
    for p in todo:  # in order; a group's points follow one another
      groups.setdefault(group_key(p), []).append(p)
    for group in groups.values():
      if group[0].rows:  # per-row lengths (row_budgets): rows.py measures each point
        for p in group:
          emit(p, rows.run_point(benches[p.drafter], p))
        continue
      for p, rec in zip(group, run_group(benches[group[0].drafter], group)):
        emit(p, rec)
    return dict(first, **({"drafters": curves} if len(curves) > 1 else {})), []

  def point_line(self, rec: Record) -> str:
    eff = f", efficiency {rec['efficiency']:.3f}" if "efficiency" in rec else ""
    return f"speedup {rec['speedup']:.3f}x{eff}"

  def report(self, workdir: str, records: list[Record], cost: dict, setup: Setup,
             notes: list[str]) -> str:
    del notes
    return gamma_report.write_report(workdir, records, cost, setup.env, setup.cfg.n_predict - 1)


RUNNER = GammaRunner()
