"""Per-row lengths in the gamma sweep (issue 40): a point per row budget,
gamma spelled --gamma=auto:rows,max=G[,budget=N|auto] (G = max(gammas)),
next to the fixed gammas and auto at every (drafter, batch, temperature).
Measured as gamma.run_group measures a chain: target-only and the per-row
run alternate over repetitions (medians of identical work), nothing may
compile inside a timed repetition. The record keeps the spec and its budget,
per row the fitted alpha and the mean length given and proposed, and the
per-row theory beside the measurement (decode/rows_theory.py: tokens per
step measured, the allocator's prediction, the oracle bound, the uniform
split of the same budget). A fixed budget N also gets the measured-cost
prediction: step = G T_draft(1) + T_packed(B, N) + T_accept(B), the packed
verify probed after every repetition (engine.PackedProbe), and the speedup
each theory's tokens per step would give at that step; budget=auto, from
its steps' calibrated T(N_t) (`auto_prediction`). docs/sweep.md.
"""

from __future__ import annotations

import statistics

import numpy as np

from specjax.bench.sweep import costs, engine
from specjax.bench.sweep.config import AUTO
from specjax.errors import SpecjaxError
from specjax.metrics import schema, stats as stats_lib
from specjax.metrics.timing import CompileWatch
from specjax.workdir import Record

PROBE_REPS = 3  # probe repetitions per sweep repetition (as gamma.PROBE_REPS)
THEORIES = ("predicted", "oracle", "uniform")  # rows_theory.RowsTheory's model columns


def runs(bench, p) -> list:
  """The point's per-row runs, one per group of rows (batch_prompts)."""
  return [bench.loop.per_row(rows, p.gamma, p.sp, p.accept_rule, bench.drafter,
                             bench.cfg.auto_every, bench.auto_costs.get(p.key))
          for rows in bench.rows(p)]


def warm_up(bench, p) -> float:
  """Compiles, untimed, what the point needs and no earlier point compiled
  (budget=auto: every candidate's chunk program, then its T(N) calibrated
  in the loop); returns the compile seconds."""
  kind = engine.is_simulated(p.accept_rule)
  compile_s = 0.0
  if ("base", p.batch, p.sp) not in bench.compiled:
    compile_s += sum(r.compile_s for r in bench.base(p))
    bench.compiled.add(("base", p.batch, p.sp))
  if ("rows", p.batch, p.gamma, kind, p.sp) in bench.compiled:
    return compile_s
  if engine.parse_rows(p.gamma)[1] == AUTO:
    first = bench.rows(p)[0]
    args = (first, p.gamma, p.sp, p.accept_rule, bench.drafter, bench.cfg.auto_every)
    compile_s += bench.loop.warm_rows(*args)
    bench.auto_costs[p.key] = bench.loop.calibrate_rows(*args)
  compile_s += sum(r.compile_s for r in runs(bench, p))  # every prefill bucket, the chooser
  bench.compiled.add(("rows", p.batch, p.gamma, kind, p.sp))
  return compile_s


def packed_probe(bench, batch: int, gamma_max: int):
  if (batch, gamma_max) not in bench.packed:
    bench.packed[batch, gamma_max] = bench.loop.packed_probe(bench.setup.depth, batch, gamma_max)
  return bench.packed[batch, gamma_max]


def rep_costs(bench, p, gamma_max: int, budget: int) -> dict[str, float]:
  """T_target(B, 1), T_draft(1) and T_packed(B, N), each the median of
  PROBE_REPS short probes taken right after the repetition's runs."""
  probe_t, probe_d = bench.probe(p.batch)
  return {"t_target": probe_t.times([1], PROBE_REPS, sp=p.sp)[1].median,
          "t_draft": probe_d.times([1], PROBE_REPS, sp=p.sp)[1].median,
          "t_packed": packed_probe(bench, p.batch, gamma_max).times(
              [budget], PROBE_REPS)[budget].median}


def run_point(bench, p) -> Record:
  """Measures one per-row point (module docstring); its record."""
  cfg = bench.cfg
  gamma_max, budget = engine.parse_rows(p.gamma)
  n = None if budget == AUTO else engine.rows_budget(p.gamma, p.batch)
  compile_s = warm_up(bench, p)
  t_accept = None if n is None else bench.loop.accept_s(gamma_max, p.sp, p.accept_rule,
                                                         bench.drafter, cfg.reps, p.batch)
  reps = []
  for rep in range(cfg.reps):
    with CompileWatch() as cw:
      first = rep % 2 == 0
      b = bench.base(p) if first else None
      res = runs(bench, p)
      if not first:
        b = bench.base(p)
    if cw.count:
      raise SpecjaxError(f"{cw.count} compilation(s) inside timed repetition {rep} of {p.key} "
                         f"({dict(cw.names)}): shapes changed between runs")
    base_s = sum(r.eval_s for r in b) / sum(r.n_decoded for r in b)
    spec_s = sum(r.eval_s for r in res) / sum(r.stats.n_kept for r in res)
    reps.append({"base_s": base_s, "spec_s": spec_s, "speedup": base_s / spec_s,
                 **({} if n is None else rep_costs(bench, p, gamma_max, n))})
  return point_record(bench, p, reps, res, compile_s, t_accept, n)


def budgets_run(bench, p, res) -> list:
  """Per run: its budget N (fixed), or each loop step's (budget=auto)."""
  plan = bench.loop.rows_plan(p.gamma, p.sp, p.accept_rule, bench.drafter, p.batch)
  if plan.auto:
    return [[plan.configs[k].budget for k in r.chosen] for r in res]
  return [engine.rows_budget(p.gamma, len(r.tokens)) for r in res]


def theory_fields(bench, p, res, gamma_max: int) -> dict:
  """The per-row theory (rows_theory.compare per run; tokens per step
  averaged over the runs' loop steps) and each row's own numbers."""
  ts = [engine.rows_theory_of(r, n, gamma_max, len(r.tokens))
        for r, n in zip(res, budgets_run(bench, p, res))]
  steps = sum(t.steps for t in ts)
  mean = lambda f: sum(getattr(t, f) * t.steps for t in ts) / max(steps, 1)
  theory = {f: mean(f) for f in ("budget", "rows", "drafts", "measured", "kept", *THEORIES)}
  theory.update(steps=steps, alpha=[a for t in ts for a in t.alpha])
  per_row = {"row_given": [], "row_proposed": [], "row_accepted": []}
  for r in res:
    rec = r.records
    for row in range(len(r.tokens)):
      sel = rec.row == row
      for k, v in (("row_given", rec.n_drafted), ("row_proposed", rec.proposed),
                   ("row_accepted", rec.n_acc)):
        per_row[k].append(float(np.mean(v[sel])) if sel.any() else 0.0)
  return {"rows_theory": theory, **per_row}


def auto_prediction(tokens: float, spent_s: float, base_s: float) -> float:
  """budget=auto's speedup had its runs emitted `tokens` (kept, or a theory's)
  in spent_s, the sum of its loop steps' calibrated T(N), against
  target-only at base_s seconds a token."""
  return base_s * tokens / spent_s if spent_s else 0.0


def point_record(bench, p, reps: list[dict], res: list, compile_s: float,
                 t_accept: float | None, n: int | None) -> Record:
  """One per-row point's record from its repetitions and its last runs."""
  cfg = bench.cfg
  gamma_max, budget = engine.parse_rows(p.gamma)
  pooled = stats_lib.Records.concat([r.records for r in res])
  st = stats_lib.SpecStats.compute(pooled, gamma=gamma_max,
                                   n_predict=sum(r.stats.n_predict for r in res))
  steps, carried, catchup = costs.loop_steps(res)
  med = lambda k: statistics.median(r[k] for r in reps)
  common = dict(costs.point_fields(bench, p, reps, compile_s, steps, len(res)),
                gamma=p.gamma, gamma_max=gamma_max, budget=budget if n is None else n,
                **theory_fields(bench, p, res, gamma_max))
  if n is None:
    used = [k for r in budgets_run(bench, p, res) for k in r]
    plan = bench.loop.rows_plan(p.gamma, p.sp, p.accept_rule, bench.drafter, p.batch)
    step_s = {plan.configs[k].budget: t for k, t in bench.auto_costs.get(p.key, {}).items()}
    spent = sum(step_s[b] for b in used)
    for r in reps:
      r["efficiency"] = r["speedup"] / auto_prediction(st.n_kept, spent, r["base_s"])
    pred = {k: auto_prediction(common["rows_theory"][k] * len(used), spent, med("base_s"))
            for k in THEORIES}
    return schema.run_record(
        st, **common, auto_every=cfg.auto_every,
        budgets_used={str(c.budget): used.count(c.budget) for c in plan.configs.values()},
        rows_step_s={str(b): t for b, t in step_s.items()},
        predicted_step_s=spent / max(len(used), 1),
        predicted_measured_cost=auto_prediction(st.n_kept, spent, med("base_s")),
        predicted_rows=pred, efficiency=med("efficiency"),
        efficiency_reps=[r["efficiency"] for r in reps])
  kept = st.n_kept / carried if carried else 0.0  # tokens kept per row-step

  def predict(r: dict) -> dict[str, float]:
    step = (gamma_max + catchup / max(steps, 1)) * r["t_draft"] + r["t_packed"] + t_accept
    at = lambda tokens_per_row: tokens_per_row * r["t_target"] / step
    return {"step": step, "measured_cost": at(kept),
            **{k: at(common["rows_theory"][k] / p.batch) for k in THEORIES}}

  for r in reps:
    r["efficiency"] = r["speedup"] / predict(r)["measured_cost"]
  pred = predict({k: med(k) for k in ("t_target", "t_draft", "t_packed")})
  return schema.run_record(
      st, **common, t_target_s=med("t_target"), t_draft_s=med("t_draft"),
      t_packed_s=med("t_packed"), t_accept_s=t_accept,
      t_target_s_reps=[r["t_target"] for r in reps], c=med("t_draft") / med("t_target"),
      predicted_step_s=pred["step"], predicted_measured_cost=pred["measured_cost"],
      predicted_rows={k: pred[k] for k in THEORIES},
      efficiency=med("efficiency"), efficiency_reps=[r["efficiency"] for r in reps])
