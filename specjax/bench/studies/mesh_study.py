"""experiments/mesh_bench.py's study: the speculative loop with each draft
placement next to target-only decoding on one mesh (`measure_loop`) and the
report of every part (`report`: records in, text out). The T(N) and plan
records come from specjax.parallel.mesh_plan (model_axis_costs, plan), which
the script calls (bench and parallel are independent layers). The report
reads nothing but the records, so it can be rewritten from a --json_out or
--jsonl_out read back.
"""

from __future__ import annotations

import sys
from typing import Any, Sequence

import numpy as np

from specjax import cli
from specjax.bench import tables
from specjax.decode import generation
from specjax.decode import probes
from specjax.decode import plan, speculative
from specjax.formats import checkpoint
from specjax.model import sharding
from specjax.model import steps

GB = 1e9
ACCELERATORS = (("A100/H100 80 GB", 80e9), ("H200 141 GB", 141e9))


def measure_loop(model: str, model_draft: str, dtype: str | None, spec_axis: int,
                 draft_modes: Sequence[str], gamma: int, n_predict: int, reps: int, seed: int,
                 env: dict[str, Any]) -> list[dict[str, Any]]:
  """The speculative loop (rule `always`: every variant runs the same steps)
  with each draft placement vs target-only on data:1,model:spec_axis, the
  repetitions alternating between the variants. One record per variant,
  with its row (prompt ids, tokens, and the target-only tokens)."""
  mesh = sharding.make_mesh(f"data:1,model:{spec_axis}")
  with sharding.use(mesh):
    tcfg, tparams, _ = checkpoint.load_model(model, dtype, seed)
  target = steps.Runner(tcfg, tparams)
  drafts = {}
  for mode in draft_modes:
    with sharding.use(mesh, mode):
      dcfg, dparams, _ = checkpoint.load_model(model_draft, dtype, seed + 1, role="draft")
    plan.check_vocabularies(tcfg, dcfg)
    drafts[mode] = steps.Runner(dcfg, dparams)
  prompt = probes.random_tokens(np.random.RandomState(seed), tcfg.vocab_size,
                               1, 32)[0].tolist()

  def run(mode):
    with sharding.use(mesh, mode or "replicated"):
      if mode is None:
        r = generation.generate(target, [prompt], n_predict)
      else:
        r = speculative.generate(target, drafts[mode], [prompt], n_predict, gamma, rule="always")
    return r.tokens[0], r.eval_s

  variants = [None] + list(drafts)
  tokens = {v: run(v)[0] for v in variants}  # compiles
  times = {v: [] for v in variants}
  for r in range(reps):
    for v in variants:
      times[v].append(run(v)[1])
    print(f"  loop round {r + 1}/{reps}", file=sys.stderr, flush=True)
  same = all(tokens[v] == tokens[variants[1]] for v in variants[1:])
  base = float(np.median(times[None]))
  out = []
  for v in variants:
    t = float(np.median(times[v]))
    out.append({"part": "loop", "target": tcfg.name, "draft": drafts[v].cfg.name if v else None,
                "mesh": f"data:1,model:{spec_axis}", "draft_sharding": v,
                "precision": tcfg.precision, "gamma": gamma, "n_predict": n_predict,
                "rule": "always", "eval_s": t, "ms_per_token": 1e3 * t / n_predict,
                "speedup": base / t, "spec_tokens_identical": same, "times": times[v],
                "rows": cli.row_records([prompt], [tokens[v]], [tokens[None]]), "env": env})
  return out


def _gb(x: float) -> str:
  return f"{x / GB:.2f}"


def report(records: list[dict[str, Any]]) -> str:
  """The T(N) table, the loop table and each plan's bytes per device."""
  lines = []
  cost = [r for r in records if r["part"] == "costs"]
  if cost:
    reps = len(next(iter(cost[0]["times"].values())))
    lines += [f"\nT(N) of {cost[0]['model']} ({cost[0]['precision']}), batch 1, "
              f"{cost[0]['depth']} of {cost[0]['capacity']} slots used, medians of {reps}:",
              tables.markdown_table(
                  ["mesh", "T(1) ms", f"T({cost[0]['gamma'] + 1}) ms", "T(g+1)/T(1)",
                   "T(1) / first mesh"],
                  [[r["mesh"], f"{1e3 * r['t1_s']:.2f}", f"{1e3 * r['tv_s']:.2f}",
                    f"{r['verify_ratio']:.2f}", f"{r['t1_vs_first']:.2f}"] for r in cost])]
  loop = [r for r in records if r["part"] == "loop"]
  if loop:
    d = next(r["draft"] for r in loop if r["draft"])
    lines += [f"\nGeneration of {loop[0]['n_predict']} tokens on {loop[0]['mesh']}: "
              f"{loop[0]['target']} alone and with {d} (gamma {loop[0]['gamma']}, rule always), "
              f"medians of {len(loop[0]['times'])}:",
              tables.markdown_table(
                  ["run", "ms/token", "speedup vs target-only"],
                  [["target only" if r["draft_sharding"] is None
                    else f"draft {r['draft_sharding']}",
                    f"{r['ms_per_token']:.2f}", f"{r['speedup']:.2f}"] for r in loop]),
              f"speculative tokens identical across draft placements: "
              f"{'yes' if loop[-1]['spec_tokens_identical'] else 'NO'}"]
  for r in (r for r in records if r["part"] == "plan"):
    lines.append(f"\nPlan: {r['target']} + {r['draft']} ({r['precision']}) on {r['mesh']}, "
                 f"draft {r['draft_sharding']}, batch {r['batch']}, {r['capacity']} slots; "
                 f"GB per device:")
    rows = [["target weights", _gb(r["target_weight_bytes"])],
            ["target cache", _gb(r["target_cache_bytes"])],
            ["draft weights", _gb(r["draft_weight_bytes"])],
            ["draft cache", _gb(r["draft_cache_bytes"])],
            ["all arguments of the speculative loop (XLA)",
             _gb(r["programs"]["spec_loop"]["argument_bytes"])],
            ["decode-step activations (XLA, f32 twin)", f"{r['act_temp_bytes'] / GB:.4f}"]]
    for name, cap in ACCELERATORS:
      rows.append([f"left of {name}", _gb(cap - r["programs"]["spec_loop"]["argument_bytes"])])
    lines.append(tables.markdown_table(["", "GB"], rows))
    if r["platform"] == "cpu" and r["precision"] != "float32":
      lines.append(f"(XLA:CPU converts bf16 weights to f32 for its matmuls: its temporaries, "
                   f"{_gb(r['programs']['spec_loop']['temp_bytes'])} GB here, are not a GPU's)")
  return "\n".join(lines)
