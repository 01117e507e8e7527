"""experiments/gpu_check.py's parts: each a runner that measures and returns
its records (appending them to gpu_check.jsonl as they finish) and a section
of gpu_summary.md written from those records and the part's settings alone.
The parts and their goals are described in the script's docstring.
"""

from __future__ import annotations

import os
import time
from typing import Any, Callable

import jax.numpy as jnp

from specjax import workdir as wd
from specjax.bench import tables
from specjax.bench.studies import llama_bench as bench
from specjax.bench.studies import loop_overhead
from specjax.bench.studies import roofline
from specjax.bench.studies.batch_scaling_report import FLAT_LIMIT, scaling_report
from specjax.bench.sweep import batch_report, gamma, harness, outputs
from specjax.bench.sweep import taskbench_report, taskbench_run
from specjax.errors import OutputError
from specjax.formats import checkpoint
from specjax.model import config
from specjax.model import steps

Records = list[dict[str, Any]]


class Out:
  """gpu_check.jsonl, appended as each record is finished. A workdir that
  holds a finished check is refused unless `overwrite`, which moves its
  outputs aside (nothing is lost)."""
  FILES = ("gpu_check.jsonl", "gpu_summary.md")

  def __init__(self, workdir: str, overwrite: bool = False):
    self.path, self.overwrite = os.path.join(workdir, self.FILES[0]), overwrite
    if wd.read_jsonl(self.path) and not overwrite:
      raise OutputError(f"{workdir} holds a GPU check's records ({self.path}): pass "
                        "--overwrite to move them aside, or another --workdir")
    os.makedirs(workdir, exist_ok=True)
    if overwrite:
      outputs.move_aside(workdir, self.FILES)
    open(self.path, "w").close()  # pylint: disable=consider-using-with
    self.env = wd.environment()

  def __call__(self, part: str, rec: dict) -> None:
    wd.append_jsonl(self.path, [{"part": part, **rec, "env": self.env}])


def run_parts(parts: list[tuple[str, Callable[[], list[str]]]], skip: set[str],
              lines: list[str], summary: str, machine: str) -> str:
  """Runs each (name, part) not in `skip` in turn, each returning its summary
  section; rewrites `summary` after every part (a run cut short keeps what
  finished) and returns the final text. A part that raises is one FAILED
  line in its section and the parts after it still run: on a device lease a
  jax version's API or the memory of one part must not cost the others."""
  lines, t0 = list(lines), time.perf_counter()
  for name, part in parts:
    if name in skip:
      continue
    t = time.perf_counter()
    try:
      section = part()
    except Exception as e:  # pylint: disable=broad-except
      first = (str(e).splitlines() or [""])[0][:300]
      section = [f"## {name}", "", f"FAILED: {type(e).__name__}: {first}"]
      print(f"{name} FAILED: {type(e).__name__}: {first}", flush=True)
    lines += section + ["", f"({name}: {time.perf_counter() - t:.0f} s)", ""]
    print(f"{name} done ({time.perf_counter() - t0:.0f} s)", flush=True)
    _write(summary, lines + [f"{machine} So far {time.perf_counter() - t0:.0f} s."])
  return _write(summary, lines + [f"{machine} Total {time.perf_counter() - t0:.0f} s."])


def _write(path: str, lines: list[str]) -> str:
  text = "\n".join(lines) + "\n"
  with open(path, "w") as f:
    f.write(text)
  return text


# ---------------------------------------------------------------- peaks


def peaks_run(smoke: bool, reps: int, out: Callable[[str, dict], None]) -> dict[str, Any]:
  """The device's measured ceilings (roofline.measure_peaks, bf16 on a GPU)."""
  n, mib, dtype = (256, 8, "float32") if smoke else (8192, 2048, "bfloat16")
  rec = {"n": n, "read_mib": mib, "dtype": dtype,
         **roofline.measure_peaks(reps=reps, n=n, read_mib=mib, dtype=dtype)}
  out("peaks", rec)
  return rec


def peaks_section(rec: dict[str, Any]) -> list[str]:
  n, mib, dtype = rec["n"], rec["read_mib"], rec["dtype"]
  item = jnp.dtype(dtype).itemsize  # bytes per weight
  ridge = rec["peak_gflops"] * item / (2 * rec["read_gbs"])
  return ["## Measured ceilings", "",
          f"{dtype} {n}^3 product: {rec['peak_gflops'] / 1e3:.1f} TFLOP/s; summing "
          f"{mib} MiB: {rec['read_gbs']:.0f} GB/s. Ridge point for {item}-byte weights at "
          f"batch 1: N = {ridge:.0f} tokens per forward (below it the weights' read sets "
          f"the time: T(N)/T(1) can stay near 1)."]


# ---------------------------------------------------------------- decode and verify cost


def bench_run(models, dtype, n_prompt, n_gen, depth, reps, out) -> Records:
  return bench.run_bench(models, [dtype], n_prompt=n_prompt, n_gen=n_gen, n_depth=depth,
                         reps=reps, on_record=lambda r: out("bench", r))


def bench_section(records: Records, models, dtype, n_prompt, n_gen, depth, bandwidth,
                  measured_gbs=None) -> list[str]:
  """tg speed, the roofline share (against the datasheet and the measured
  read bandwidth), T(N)/T(1), where the flat region ends, the FLOP rate."""
  lines = ["## Decode and verify cost (batch 1, depth %d)" % depth, "",
           "| model | tg t/s | ms/token | roofline | measured read | " + " | ".join(
               f"T({n})/T(1)" for n in n_prompt[1:]) + " | leaves flat at N | TFLOP/s at N=%d |"
           % max(n_prompt), "|---" * (7 + len(n_prompt) - 1) + "|"]
  for spec in models:
    cfg = config.get_preset(spec, dtype)
    rs = [r for r in records if r["model"] == cfg.name]
    tg = next(r for r in rs if r["kind"] == "tg")
    pp = {r["n_tokens"]: r for r in rs if r["kind"] == "pp"}
    ratio = {n: r["verify_ratio"] for n, r in pp.items()}
    step_s = tg["median_s"] / tg["n_tokens"]
    slots = roofline.attended_slots(config.for_backend(cfg, tg["backend"]), tg["capacity"],
                                    depth + n_gen)  # the kind it ran with (a GPU's: masked)
    roof = (roofline.roofline_fraction(cfg, tg["size_bytes"], slots, step_s, bandwidth)
            if bandwidth else None)
    leave, _ = scaling_report({n: r["median_s"] for n, r in pp.items()})
    n_max = max(pp)
    tflops = 2 * tg["n_params"] * n_max / pp[n_max]["median_s"] / 1e12
    share = (roofline.roofline_fraction(cfg, tg["size_bytes"], slots, step_s, measured_gbs)
             if measured_gbs else None)
    measured = f"{100 * share:.0f}%" if measured_gbs else "-"
    lines.append(f"| {spec} | {1 / step_s:.1f} | {1e3 * step_s:.2f} | "
                 + (f"{100 * roof:.0f}% of {bandwidth:.0f} GB/s" if roof else "bandwidth unknown")
                 + " | " + measured
                 + " | " + " | ".join(f"{ratio.get(n, float('nan')):.2f}" for n in n_prompt[1:])
                 + f" | {leave or '-'} | {tflops:.1f} |")
  lines += ["", f"Leaves flat at N: the smallest N with T(N)/T(1) > {FLAT_LIMIT} (- if none). "
            "TFLOP/s: 2 x params x N / T(N) at the largest N; past the ridge point the "
            "verify is compute-bound and T(N) grows with N. Measured read: the roofline "
            "share against the read bandwidth measured in the first part."]
  return lines


# ---------------------------------------------------------------- attention


def attention_run(spec, dtype, points, n_gen, reps, out) -> Records:
  cfg, params, _ = checkpoint.load_model(spec, dtype=dtype)
  return bench.attention_scaling(steps.Runner(cfg, params), points, n_gen, reps,
                                 on_record=lambda r: out("attention", r))


def attention_section(rs: Records, spec, points) -> list[str]:
  precision = rs[0]["dtype"]  # the model's precision (tables.model_info)
  ms = {(r["capacity"], r["n_depth"], r["variant"]): r["ms_per_token"] for r in rs}
  (c_lo, d_lo), (c_hi, _) = points[0], points[1]
  ratio = ms[(c_hi, d_lo, "blocked")] / ms[(c_lo, d_lo, "blocked")]
  return [f"## Attention over the used length ({spec}, {precision})", "",
          bench.attention_table(rs), "",
          f"Blocked, {d_lo} used: capacity {c_hi} costs {ratio:.2f}x capacity {c_lo} "
          f"(goal <= 1.1)."]


# ---------------------------------------------------------------- the sweeps


def sweep_run(cfg, workdir: str, name: str, overwrite: bool = False) -> Records:
  """The gamma sweep of cfg (a SweepConfig) into workdir/name (its own
  results.jsonl; a finished one moved aside with `overwrite`)."""
  return harness.run(gamma.RUNNER, cfg, os.path.join(workdir, name), overwrite=overwrite,
                     progress=False)


def sweep_section(points: Records, cfg) -> list[str]:
  lines = [f"## Speedup, {cfg.draft} draft / {cfg.target} target ({cfg.dtype or 'own dtype'}, "
           "random weights)", "",
           "| gamma | accept rule | speedup | T(g+1)/T(1) | Leviathan | measured-cost | efficiency |",
           "|---" * 7 + "|"]
  for r in sorted(points, key=lambda r: (r["accept_rule"], r["gamma"])):
    lines.append(f"| {r['gamma']} | {r['accept_rule']} | {r['speedup']:.2f}x | "
                 f"{r['verify_ratio']:.2f} | {r['predicted_leviathan']:.2f}x | "
                 f"{r['predicted_measured_cost']:.2f}x | {r['efficiency']:.2f} |")
  return lines


def batch_section(points: Records, cfg) -> list[str]:
  lines = [f"## Batch > 1: {cfg.draft} draft / {cfg.target} target ({cfg.dtype or 'own dtype'})",
           "", "| batch | gamma | accept rule | speedup | loop steps (measured / tail model) | "
           "T(B,g+1)/T(B,1) | predicted |", "|---" * 7 + "|"]
  for r in sorted(points, key=lambda r: (r["accept_rule"], r["gamma"], r["batch"])):
    lines.append(f"| {r['batch']} | {r['gamma']} | {r['accept_rule']} | {r['speedup']:.2f}x | "
                 f"{r['steps_measured']:.1f} / {r['steps_predicted']:.1f} | "
                 f"{r['verify_ratio']:.2f} | {r['predicted_tail']:.2f}x |")
  lines.append("")
  for g in sorted({r["gamma"] for r in points}):
    for rule in sorted({r["accept_rule"] for r in points}):
      xs = [(r["batch"], r["speedup"]) for r in points
            if r["gamma"] == g and r["accept_rule"] == rule]
      b = batch_report.crossover(xs)
      lines.append(f"Crossover, gamma {g}, {rule}: "
                   + (f"batch {b}" if b else f"none up to batch {max(x for x, _ in xs)}") + ".")
  return lines


def lever_sweep_run(script: str, lever: str, workdir: str, parts: tuple[str, ...],
                    args: list[str]) -> Records:
  """The sweep under `lever` (model/levers.py): the GPU check's `script`
  again, in a process started under the lever's XLA_FLAGS (XLA reads them
  once, at its start), running the sweep part alone into workdir; its
  points."""
  import subprocess  # pylint: disable=import-outside-toplevel
  import sys  # pylint: disable=import-outside-toplevel
  from specjax.model import levers  # pylint: disable=import-outside-toplevel
  flags = " ".join(x for x in (os.environ.get("XLA_FLAGS", ""), levers.parse(lever).xla_flags())
                   if x)
  skip = ",".join(p for p in parts if p != "sweep")
  proc = subprocess.run([sys.executable, script, f"--lever={lever}", f"--workdir={workdir}",
                         f"--skip={skip}", *args], env={**os.environ, "XLA_FLAGS": flags},
                        capture_output=True, text=True, check=False)
  if proc.returncode:
    last = (proc.stderr.strip().splitlines() or ["no output"])[-1]
    raise RuntimeError(f"the sweep under --lever={lever} failed: {last[:300]}")
  return wd.read_jsonl(os.path.join(workdir, "sweep", "results.jsonl"))


# ---------------------------------------------------------------- loop overhead


def overhead_run(target, draft, dtype, gamma, reps, out) -> dict[str, Any]:
  tcfg, tparams, _ = checkpoint.load_model(target, dtype=dtype)
  dcfg, dparams, _ = checkpoint.load_model(draft, dtype=dtype, seed=1, role="draft")
  prompt = list(range(3, 35))
  rec = loop_overhead.loop_overhead(steps.Runner(tcfg, tparams), steps.Runner(dcfg, dparams), prompt,
                            gamma, n_steps=8, reps=reps)
  out("overhead", rec)
  return rec


def overhead_section(rec: dict[str, Any], target, draft, gamma) -> list[str]:
  return [f"## Device-loop overhead ({target} / {draft}, gamma {gamma})", "",
          f"Loop {1e3 * rec['loop_step_s']:.3f} ms/step, its phases alone "
          f"{1e3 * rec['phases_step_s']:.3f} ms/step: overhead "
          f"{100 * rec['overhead_share']:.2f} % (goal <= 2 %)."]


# ---------------------------------------------------------------- tensor parallelism


def mesh_section(recs: Records, model: str, reps: int, n_devices: int,
                 backend: str) -> list[str]:
  """T(1), T(5) on data:1,model:M (mesh_plan.model_axis_costs' records; none
  with one device)."""
  lines = [f"## Tensor parallelism over the local devices ({n_devices})", ""]
  if n_devices < 2:
    return lines + [f"One {backend} device: the model-axis figures need several "
                    "(experiments/mesh_bench.py measures them on virtual CPU devices)."]
  return lines + [f"{model} ({recs[0]['precision']}), batch 1, 128 of 256 slots used, medians "
                  f"of {reps}:", "", tables.markdown_table(
                      ["mesh", "T(1) ms", "T(5) ms", "T(5)/T(1)", "T(1) vs model:1"],
                      [[r["mesh"], f"{1e3 * r['t1_s']:.2f}", f"{1e3 * r['tv_s']:.2f}",
                        f"{r['verify_ratio']:.2f}", f"{r['t1_vs_first']:.2f}"] for r in recs])]



# ---------------------------------------------------------------- tree verify cost


def trees_run(spec, dtype, batches, sizes, depth, reps, out) -> Records:
  """T(B, 1 + N) of the tree verify (bench/studies/tree_verify_cost.XlaTreeProbe)
  for Sequoia's best trees of `sizes` nodes (depth <= 8, model.tree's
  default p) and chain:1 (T(B, 2), the reference), at every batch."""
  from specjax.bench.studies import tree_verify_cost as tvc  # pylint: disable=import-outside-toplevel
  from specjax.model import tree as trees  # pylint: disable=import-outside-toplevel
  cfg, params, _ = checkpoint.load_model(spec, dtype=dtype)
  m = steps.Runner(cfg, params)
  tl = [trees.chain(1)] + [trees.sequoia(n, 8) for n in sizes]
  cap = depth + max(t.block_size for t in tl)
  recs = []
  for b in batches:
    for r in tvc.surface(lambda bb: tvc.XlaTreeProbe(m, bb, cap, depth), [b], tl, reps):
      rec = {"model": cfg.name, "dtype": cfg.precision, "depth": depth, **r}
      out("trees", rec)
      recs.append(rec)
  return recs


def trees_section(rs: Records, spec, sizes) -> list[str]:
  """T(B, 1 + N) / T(B, 2) per batch and tree size: where the tree verify
  stops being flat (on a GPU: near B (1 + N) ~ the ridge point)."""
  lines = [f"## Tree verify cost T(B, N) ({spec}, {rs[0]['dtype'] if rs else '-'}, tree mask)",
           "", "| B | T(B, 2) ms | " + " | ".join(f"N={n}" for n in sizes)
           + " | tokens per verify at N=%d |" % max(sizes), "|---" * (3 + len(sizes)) + "|"]
  for b in sorted({r["batch"] for r in rs}):
    at = {r["nodes"]: r["seconds"] for r in rs if r["batch"] == b}
    lines.append(f"| {b} | {1e3 * at[1]:.2f} | " + " | ".join(
        f"{at[n] / at[1]:.2f}" for n in sizes) + f" | {b * (1 + max(sizes))} |")
  lines += ["", "Each cell: T(B, 1 + N) / T(B, 2) (one verify of a Sequoia tree of N nodes "
            "over chain:1's verify at the same batch). A tree pays while this stays near 1; "
            "the study's crossover batch (bench/sweep/tree_report.py) is where it stops."]
  return lines


# ---------------------------------------------------------------- the task suite


def taskbench_available(cfg) -> tuple[Any, list[str]]:
  """cfg without the drafters and tree rows whose trained draft is not
  there (an EAGLE head, the draft model: still being trained, or not
  shipped with this checkout), and one line per row left out, so that the
  rest of the suite runs."""
  from specjax.drafters import eagle, eagle3, registry  # pylint: disable=import-outside-toplevel
  from specjax.errors import SpecjaxError  # pylint: disable=import-outside-toplevel
  missing: dict[str, str] = {}

  def ok(spec: str) -> bool:
    if spec not in missing:
      try:
        d = registry.parse(spec)
        if isinstance(d, eagle.EagleDrafter):
          eagle.load_eagle(d.path)
        elif isinstance(d, eagle3.Eagle3Drafter):
          eagle3.load_head3(d.path)
        elif d.needs_draft_model:
          checkpoint.load_model(cfg.draft, dtype=cfg.dtype, role="draft")
      except SpecjaxError as e:
        missing[spec] = str(e).splitlines()[0][:200]
    return spec not in missing

  sub = cfg.replace(drafters=tuple(s for s in cfg.drafters if ok(s)),
                    taskbench_trees=tuple(r for r in cfg.taskbench_trees
                                          if ok(r.rpartition("@")[0])))
  dropped = [f"{spec}: left out ({why})" for spec, why in missing.items()]
  return sub, dropped


# The head issue 38 trains (drafters/eagle3.py), and its CPU-sized dynamic tree.
NEW_HEAD, NEW_HEAD_TREE = "eagle3:smollm2-eagle3", "dynamic:4,4,16"


def with_new_head(cfg):
  """cfg (taskbench_quick) plus the new head's rows: a chain and its
  dynamic tree (left out with one line while the head is not shipped)."""
  return cfg.replace(drafters=cfg.drafters + (NEW_HEAD,),
                     taskbench_trees=cfg.taskbench_trees + (f"{NEW_HEAD}@{NEW_HEAD_TREE}",))


def taskbench_part_run(cfg, workdir: str, name: str = "taskbench",
                       overwrite: bool = False) -> tuple[Records, list[str]]:
  """The task suite (bench/sweep/taskbench_run.run_taskbench) of cfg into
  workdir/name, without the drafters whose trained draft is missing
  (taskbench_available); (records, the lines saying what was left out)."""
  sub, dropped = taskbench_available(cfg)
  if not sub.drafters and not sub.taskbench_trees:
    return [], dropped + ["no drafter left to run"]
  return taskbench_run.run_taskbench(sub, os.path.join(workdir, name), overwrite=overwrite,
                                     progress=False), dropped


def taskbench_section(records: Records, cfg, dropped: list[str], note: str = "") -> list[str]:
  """The suite's leaderboard and goals (bench/sweep/taskbench_report.py) from the records."""
  lines = [f"## Task suite ({cfg.target}, {cfg.taskbench_prompts or 'all'} "
           f"prompt(s) per category, {cfg.n_predict} tokens, real acceptance)", ""]
  lines += [note, ""] if note else []
  lines += [f"- {d}" for d in dropped] + ([""] if dropped else [])
  if not records:
    return lines + ["No point ran."]
  lines += [taskbench_report.PUBLISHED + ".", "", taskbench_report.leaderboard(records)]
  return lines + taskbench_report.goals_lines(taskbench_report.goals(records))
