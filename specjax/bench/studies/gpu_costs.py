"""experiments/gpu_check.py's cost-curve parts at llama-7b shapes (random
weights), each a runner (records into gpu_check.jsonl) and a section of
gpu_summary.md from those records:
- packed (issue 40): T_packed(B, N) against T_rect(B, gamma + 1) and the
  rectangle of the same N (packed_verify_cost.py); goal: within 10 % of the
  latter. B = 1, 16, 64: a prefill and 6 verifies compiled a batch, ~6 s
  each on an H200 (docs/results.md): about 2 device minutes.
- surface (issue 39): T(B, N, context) of the target and the streaming
  draft in XLA (cost_surface.py; a point past the device's memory refused
  in one line), its fit and the speedup predicted along the batch under the
  simulated `bernoulli:alpha` at the draft's alpha on SmolLM2
  (cost_surface_report.py). Of 512, 16 K, 32 K x 1, 8, 32, 4 points fit an
  H100 and 5 an H200, ~5 compiles each: about 2 minutes (H100), 2.5 (H200).
  Goal: at long context the speedup rises with the batch.
"""

from __future__ import annotations

import os
from typing import Any, Callable, Sequence

from specjax import workdir as wd
from specjax.bench import tables
from specjax.bench.studies import cost_surface as cs
from specjax.bench.studies import cost_surface_report as report
from specjax.bench.studies import packed_verify_cost as pvc
from specjax.bench.sweep import outputs
from specjax.drafters import registry
from specjax.errors import SpecjaxError
from specjax.formats import checkpoint
from specjax.model import config
from specjax.model import steps

Records = list[dict[str, Any]]
Out = Callable[[str, dict], None]
SAME_TOKENS_GOAL = 0.10  # |T_packed(B, N) / T_rect(B, N / B) - 1|, issue 40's goal
# streaming:256,4's acceptance on SmolLM2, the long suite's 2 K summary at
# T = 0 (docs/long_context.md): the rate of the simulated bernoulli rule
SMOLLM2_ALPHA = 0.829
SURFACE_DRAFTER = "streaming:256,4"

# ---------------------------------------------------------------- packed verify


def packed_sizes(batch: int, gamma: int) -> list[int]:
  """Three block sizes of B rows: a tail each (N = B, a decode step), half
  the drafts (ragged: the widest rows first) and all of them (B (gamma + 1));
  three rectangles to compile, not gamma + 1 (a 7B shape takes seconds)."""
  return sorted({batch, batch * (1 + gamma // 2), batch * (gamma + 1)})


def packed_run(spec: str, dtype: str, batches: Sequence[int], gamma: int, depth: int,
               reps: int, out: Out, sizes=packed_sizes) -> Records:
  """packed_verify_cost.packed_cost at `sizes`, each record tagged with the
  model and appended as part `packed`."""
  cfg, params, _ = checkpoint.load_model(spec, dtype=dtype)
  recs = pvc.packed_cost(steps.Runner(cfg, params), batches, gamma, depth, reps,
                         log=lambda line: print("  " + line, flush=True), sizes=sizes)
  recs = [{"model": cfg.name, "dtype": cfg.precision, **r} for r in recs]
  for r in recs:
    out("packed", r)
  return recs


def packed_section(recs: Records, spec: str) -> list[str]:
  """T_packed, the full rectangle and the rectangle of the same token count
  (ms, and the ratios), and how many points meet the goal."""
  if not recs:
    return ["## Packed verify cost", "", "No point ran."]
  gamma = recs[0]["gamma"]
  ms = lambda s: "-" if s is None else f"{1e3 * s:.2f}"
  ratio = lambda x: "-" if x is None else f"{x:.2f}"
  rows = [[r["batch"], r["n_tokens"], ms(r["t_packed_s"]), ms(r["t_rect_full_s"]),
           ratio(r["ratio_full"]), ms(r["t_rect_same_s"]), ratio(r["ratio_same"])]
          for r in recs]
  same = [r["ratio_same"] for r in recs if r["ratio_same"] is not None]
  met = sum(abs(x - 1) <= SAME_TOKENS_GOAL for x in same)
  return [f"## Packed verify cost T_packed(B, N) ({spec}, {recs[0]['dtype']}, depth "
          f"{recs[0]['depth']}, gamma {gamma})", "",
          tables.markdown_table(["B", "N", "T_packed ms", f"T_rect(B, {gamma + 1}) ms", "ratio",
                                 "T_rect(B, N/B) ms", "ratio"], rows), "",
          f"N tokens in one packed block (rows ragged: the widest first) against every row "
          f"verifying gamma + 1 and against the rectangle of the same N. Within "
          f"{100 * SAME_TOKENS_GOAL:.0f} % of the same-N rectangle at {met} of {len(same)} "
          f"points (goal: all; docs/packed_verify.md)."]

# ---------------------------------------------------------------- cost surface


def surface_settings(spec: str, dtype: str, contexts: Sequence[int], batches: Sequence[int],
                     gamma: int, reps: int, drafter: str = SURFACE_DRAFTER,
                     k: int = cs.Settings.k) -> cs.Settings:
  """XLA alone (the device's engine), the target at N = 1 and gamma + 1."""
  return cs.Settings(model=spec, dtype=dtype, contexts=tuple(contexts), batches=tuple(batches),
                     ns=(1, gamma + 1), drafters=(registry.parse(drafter).spec,),
                     engines=("xla",), gamma=gamma, reps=reps, k=k)


def surface_run(s: cs.Settings, work: str, out: Out, env: wd.Record, predict: Sequence[int],
                alpha: float = SMOLLM2_ALPHA, overwrite: bool = False) -> Records:
  """cost_surface.run of s into `work` (one with `overwrite` moved aside
  first), every record appended as part `surface` (refused points too), and
  the surface's own report there (cost_surface_report.write: its plot)."""
  if overwrite and os.path.isdir(work):
    outputs.move_aside(work, (wd.RESULTS, cs.SETTINGS, wd.SUMMARY, "crossover.json"))
  cfg, params, _ = checkpoint.load_model(s.model, dtype=s.dtype)
  recs = cs.run(work, s, steps.Runner(cfg, params), None,
                log=lambda line: print("  " + line, flush=True))
  for r in recs:
    out("surface", r)
  if cs.measured(recs):
    report.write(work, recs, cfg, draft_configs(cfg, s), s, [alpha], predict, env)
  return recs


def draft_configs(cfg, s: cs.Settings) -> dict:
  return {d: registry.parse(d).for_target(cfg).draft_config(cfg, None) for d in s.drafters}


def surface_section(recs: Records, s: cs.Settings, predict: Sequence[int],
                    alpha: float = SMOLLM2_ALPHA,
                    contexts: Sequence[int] | None = None) -> list[str]:
  """The measured table, the refused points, the fit and the predicted
  speedup along the batch at `bernoulli:alpha`, per context (`contexts`:
  the measured ones by default; the fit predicts any)."""
  cfg = config.get_preset(s.model, s.dtype)
  lines = [f"## Cost surface T(B, N, context) ({s.model}, {s.dtype}, XLA, "
           f"{', '.join(s.drafters)} draft)", ""]
  refused = [f"- {r['refused']}" for r in recs if "refused" in r]
  lines += ["Refused before running:", "", *refused, ""] if refused else []
  if not cs.measured(recs):
    return lines + ["No point ran."]
  lines += [report.surface_table(recs), ""]
  try:
    models = report.fits(recs, "xla")
  except SpecjaxError as e:
    return lines + [f"Not fitted: {e}."]
  cross = report.crossovers(models, cfg, draft_configs(cfg, s), contexts or s.contexts, [alpha],
                            s.gamma, predict)
  return lines + [report.fit_table({"xla": models}, recs), "",
                  f"Predicted speedup along the batch, gamma {s.gamma}, `bernoulli:{alpha}` "
                  f"(the geometric law the acceptance simulation draws from; {alpha}: "
                  f"{SURFACE_DRAFTER}'s alpha on SmolLM2 at 2 K):", "",
                  report.crossover_table(cross, "xla"), "",
                  "Goal (issue 39): at long context the speedup rises with the batch (a turn "
                  "at a small batch) where at short context it falls; docs/long_context.md."]
