"""gpu_check's levers part (issue 38, part 6): the draft's and the target's
decode ms/token under each lever (model/levers.py: XLA's command buffers,
the draft's layers scanned, an attention kind), and c = T_draft / T_target
under the same lever, the number that bounds a speculative speedup.

Each cost is the device loop's (generation.decode_loop, n steps in one
program, as a draft's gamma steps run inside the speculative loop), lowered
once and compiled with the lever's compile options, so every lever is
measured in one process. The best lever (smallest c) then runs the 7B/160m
sweep (experiments/gpu_check.py starts it under the lever's XLA_FLAGS).
Goals on the H200: c <= 0.08 for llama-160m against llama-7b, the target's
decode >= 80 % of its roofline.
"""

from __future__ import annotations

import time
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from specjax.bench import tables
from specjax.bench.studies import roofline
from specjax.decode import generation, probes
from specjax.formats import checkpoint
from specjax.metrics import timing
from specjax.model import kv_cache as kvc
from specjax.model import levers as levers_lib
from specjax.model import llama
from specjax.model import steps
from specjax.model.sampling import SamplingParams

Records = list[dict[str, Any]]
C_GOAL, ROOFLINE_GOAL = 0.08, 0.80


def decode_cost(cfg, params, options: dict, capacity: int, depth: int, n_gen: int,
                reps: int) -> dict[str, Any]:
  """ms/token of n_gen greedy decode steps on the device loop from a cache
  holding `depth` random tokens, the loop compiled with `options`."""
  runner = steps.Runner(cfg, params)
  cache = probes.filled_cache(runner, 1, capacity, depth, np.random.RandomState(0))
  logits, key = jnp.zeros((1, cfg.padded_vocab), jnp.float32), jax.random.PRNGKey(0)
  kw = dict(cfg=cfg, sp=SamplingParams(), n_predict=n_gen + 1, eos_id=-1)  # never stops
  t0 = time.perf_counter()
  loop = generation.decode_loop.lower(params, logits, cache, key, **kw).compile(
      compiler_options=options)
  compile_s, holder = time.perf_counter() - t0, [cache]

  def run():  # the cache is donated, its lengths too: a fresh array each time
    at = jnp.full((1,), depth, jnp.int32)
    out, holder[0] = loop(params, logits, kvc.rollback(holder[0], at), key)
    return out

  t = timing.measure(run, reps=reps)
  return {"ms_per_token": 1e3 * t.median / n_gen, "compile_s": compile_s,
          "times_s": t.times}


def measure_or_error(*args) -> dict[str, Any]:
  """decode_cost, or {"error": its first line} when the lever fails there (a
  cuDNN kernel that refuses a shape, an XLA flag this jax lacks): one
  lever's failure must not cost the others' figures on a device lease."""
  try:
    return decode_cost(*args)
  except Exception as e:  # pylint: disable=broad-except
    return {"error": f"{type(e).__name__}: {(str(e).splitlines() or [''])[0][:200]}"}


def lever_costs(draft: str, target: str, dtype: str, names: Sequence[str], capacity: int,
                depth: int, n_gen: int, reps: int,
                out: Callable[[dict], None] = lambda r: None) -> Records:
  """One record per (lever, role): the model's ms/token under the lever
  (a role whose config and options another lever already measured reuses
  that figure), with what the lever set."""
  models = {role: checkpoint.load_model(spec, dtype=dtype, role=role)[:2]
            for role, spec in (("draft", draft), ("target", target))}
  seen, recs = {}, []
  for name in names:
    lever = levers_lib.parse(name)
    for role, (cfg0, params) in models.items():
      cfg, options = lever.model_config(cfg0, role), lever.compiler_options()
      key = (role, cfg, tuple(sorted(options.items())))
      if key not in seen:
        seen[key] = measure_or_error(cfg, params, options, capacity, depth, n_gen, reps)
      rec = {"lever": name, "role": role, **tables.model_info(cfg, params),
             "attention": cfg.attention, "scan_layers": cfg.scan_layers,
             "command_buffers": lever.command_buffers, "capacity": capacity, "depth": depth,
             "n_gen": n_gen, "step_bytes": roofline.decode_bytes(
                 cfg, llama.param_bytes(params),
                 roofline.attended_slots(cfg, capacity, depth + n_gen)),
             **seen[key]}
      out(rec)
      recs.append(rec)
  return recs


def c_by_lever(recs: Records) -> dict[str, float]:
  """c = T_draft(1) / T_target(1) per lever, both under it (a lever that
  failed for either model has none)."""
  ms = {(r["lever"], r["role"]): r.get("ms_per_token") for r in recs}
  return {lv: ms[(lv, "draft")] / ms[(lv, "target")]
          for lv in dict.fromkeys(r["lever"] for r in recs)
          if ms[(lv, "draft")] and ms[(lv, "target")]}


def best_lever(recs: Records) -> str | None:
  """The lever with the smallest c (None if every lever failed)."""
  c = c_by_lever(recs)
  return min(c, key=c.get) if c else None


def levers_section(recs: Records, draft: str, target: str, bandwidth: float | None
                   ) -> list[str]:
  """The table (ms/token of both, c, the target's roofline share; a failed
  lever's error), and the goals, from the records alone."""
  by = {(r["lever"], r["role"]): r for r in recs}
  c = c_by_lever(recs)
  lines = [f"## Levers: {draft} draft / {target} target ({recs[0]['dtype']}, decode loop, "
           f"{recs[0]['depth']} of {recs[0]['capacity']} slots used)", "",
           "| lever | attention (draft) | draft ms/token | target ms/token | c | "
           "target roofline | compile s (draft / target) |", "|---" * 7 + "|"]
  for lever in dict.fromkeys(r["lever"] for r in recs):
    d, t = by[(lever, "draft")], by[(lever, "target")]
    kind = f"{d['attention']}{' scan' if d['scan_layers'] else ''}"
    if lever not in c:
      lines.append(f"| {lever} | {kind} | failed: {d.get('error') or t.get('error')} |")
      continue
    roof = (f"{100 * t['step_bytes'] / (t['ms_per_token'] / 1e3) / (bandwidth * 1e9):.0f}%"
            if bandwidth else "-")
    lines.append(f"| {lever} | {kind} | {d['ms_per_token']:.3f} | {t['ms_per_token']:.3f} | "
                 f"{c[lever]:.3f} | {roof} | {d['compile_s']:.1f} / {t['compile_s']:.1f} |")
  best = best_lever(recs)
  if best is None:
    return lines + ["", "Every lever failed."]
  ratio = by[(best, "draft")]["n_params"] / by[(best, "target")]["n_params"]
  return lines + ["", f"Best lever: {best}, c = {c[best]:.3f} (goal <= {C_GOAL}; the "
                  f"parameter ratio is {ratio:.3f}). Roofline: the target's bytes per step "
                  f"(weights + attended cache) / its time, against "
                  f"{bandwidth or 'an unknown'} GB/s (goal >= {100 * ROOFLINE_GOAL:.0f} %)."]
