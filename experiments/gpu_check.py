"""The GPU check: the one prepared script for a machine with a GPU (no network;
about 15 minutes on an H200 before issue 38's parts: bench 226 s, sweep 298 s,
attention 33 s, overhead 39 s, docs/results.md; a device call is at most 10
minutes: BUILD.md gives the --skip of issue 38's run).

  pip install --no-deps -e . && python experiments/gpu_check.py --workdir=/tmp/specjax_gpu

Parts (--skip leaves some out): peaks (the GPU's ceilings), bench (decode
and verify cost, llama-160m and llama-7b shapes, bf16, T(N)/T(1) to N = 64),
attention (over the used length), sweep (configs/sweep_gamma.py:gpu, the
7B / 160m pair), batch (configs/sweep_gamma.py:gpu_batch: the crossover
batch), overhead (the device loop's), trees (the tree verify T(B, N)), mesh
(several local GPUs), taskbench (configs/sweep_gamma.py:taskbench_quick on
SmolLM2-135M-Instruct plus the new EAGLE-3 head's rows, one line each while
it is missing), levers (draft and target ms/token and c under each of
model/levers.py's levers) and lever_sweep (the sweep's largest gamma under
the best lever, in a process started under its XLA_FLAGS), packed (the
packed verify's T(B, N), llama-7b) and surface (T(B, N, context), llama-7b
and the streaming draft; ~2 device minutes each). They run in ORDER, so
that a run cut short keeps the ones the README quotes; a part that fails is
one FAILED line and the rest still run. Writes gpu_summary.md (rewritten
after every part) and gpu_check.jsonl (one record per measurement, with the
environment) to --workdir. `--smoke`: the same path on tiny models on any
backend (the tests use it). What each part measures: docs/results.md, "On a
GPU"; the runners and sections: specjax.bench.studies.gpu_study, gpu_costs.
"""

import os
import sys

import jax
from absl import flags

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from configs import sweep_gamma  # noqa: E402
from specjax import cli
from specjax import workdir as wd
from specjax.bench.studies import draft_levers
from specjax.bench.studies import gpu_costs
from specjax.bench.studies import gpu_study as gs
from specjax.bench.studies import roofline
from specjax.bench.sweep.config import SweepConfig
from specjax.errors import SpecjaxError
from specjax.model import config
from specjax.model import sharding
from specjax.parallel import mesh_plan

_WORKDIR = flags.DEFINE_string("workdir", "/tmp/specjax_gpu", "Output folder.")
_OVERWRITE = flags.DEFINE_bool("overwrite", False, "A workdir that holds a check: move its "
                               "outputs aside (replaced-STAMP/) and run again.")
_SMOKE = flags.DEFINE_bool("smoke", False, "Tiny models on any backend: checks the script only.")
_BANDWIDTH = flags.DEFINE_float("bandwidth_gbs", None, "Peak memory bandwidth (GB/s); default: "
                                "looked up from the device kind.", lower_bound=1.0)
_REPS = flags.DEFINE_integer("reps", 5, "Benchmark repetitions.", lower_bound=1)
_TREES = flags.DEFINE_multi_string("taskbench_tree", None, "A tree row of the task suite "
                                   "(DRAFTER@TREE; repeat the flag); default: taskbench_quick's.")
_SWEEP_GAMMA = flags.DEFINE_multi_integer("sweep_gamma", None, "The sweep part's gammas "
                                           "(repeat the flag); default: the config's.",
                                           lower_bound=1)
_SKIP = flags.DEFINE_list("skip", [], "Parts to leave out: peaks, bench, attention, sweep, batch, "
                         "overhead, trees, mesh, taskbench, levers, lever_sweep, packed, "
                         "surface.")


# The order the parts run in: the cost curves, the task suite and the levers first.
ORDER = ("peaks", "bench", "taskbench", "levers", "sweep", "lever_sweep", "trees", "attention",
         "batch", "overhead", "mesh", "packed", "surface")
# The levers measured (model/levers.py; 'default' is the backend's attention).
LEVERS = ("default", "blocked", "fused", "draft_scan", "command_buffers", "all")
# the surface part's predicted speedups (from its fit: contexts not measured too)
PREDICT_BATCHES, PREDICT_CONTEXTS = (1, 2, 4, 8, 16, 32), (512, 2048, 4096, 8192, 16384, 32768)


def levers_part(scfg, names, point, reps, out, bandwidth, measured: dict) -> list[str]:
  """The draft's and the target's ms/token and c under each lever; the
  best one is kept (`measured`) for the lever_sweep part."""
  recs = draft_levers.lever_costs(scfg.draft, scfg.target, scfg.dtype, names, *point, reps,
                                  out=lambda r: out("levers", r))
  measured["best_lever"] = draft_levers.best_lever(recs)
  return draft_levers.levers_section(recs, scfg.draft, scfg.target, bandwidth)


def lever_sweep_part(scfg, measured: dict, args: list[str], smoke: bool) -> list[str]:
  """The sweep under the best lever of the levers part, the default
  included (--smoke: under 'all', so that the path runs whatever the CPU
  measured)."""
  if "best_lever" not in measured:
    return ["## Speedup under the best lever", "", "The levers part did not run."]
  best = "all" if smoke else measured["best_lever"] or "default"
  points = gs.lever_sweep_run(os.path.abspath(__file__), best,
                              os.path.join(_WORKDIR.value, "lever_sweep"), ORDER, args)
  section = gs.sweep_section(points, scfg)
  return [section[0] + f", under lever {best}"] + section[1:]


def peaks_part(smoke: bool, reps: int, out, measured: dict) -> list[str]:
  """The device's measured ceilings; the bench part reports its roofline
  share against them too (`measured`)."""
  rec = gs.peaks_run(smoke, reps, out)
  measured.update(rec)
  return gs.peaks_section(rec)


def mesh_part(model, dtype, reps, out) -> list[str]:
  """T(1), T(5) on data:1,model:M over the local devices (M = 1, 2, 4, 8)."""
  n = jax.local_device_count()
  recs = []
  if n >= 2:
    cfg = config.get_preset(model)
    axes = [m for m in (1, 2, 4, 8) if m <= n and sharding.divides(cfg, m)]
    recs = mesh_plan.model_axis_costs(model, dtype, axes, 4, 256, 128, reps)
    for r in recs:
      out("mesh", r)
  return gs.mesh_section(recs, model, reps, n, jax.default_backend())


def taskbench_part(cfg, workdir: str, out, note: str) -> list[str]:
  """The task suite's quick config; a target that cannot be loaded (the
  smollm2 package not installed) is one line in the summary, not the end of
  the check."""
  try:
    records, dropped = gs.taskbench_part_run(cfg, workdir, overwrite=out.overwrite)
  except SpecjaxError as e:
    records, dropped = [], [f"not run: {str(e).splitlines()[0][:300]}"]
  for r in records:
    out("taskbench", {k: v for k, v in r.items() if k != "env"})
  return gs.taskbench_section(records, cfg, dropped, note)


def main(argv):
  del argv
  dev = jax.devices()[0]
  if not _SMOKE.value and jax.default_backend() != "gpu":
    raise SpecjaxError(f"JAX does not see a GPU (backend {jax.default_backend()!r}, devices "
                       f"{jax.devices()}); see BUILD.md, or pass --smoke")
  print(f"backend {jax.default_backend()}, device {dev.device_kind}, jax {jax.__version__}",
        flush=True)
  out, reps, skip = gs.Out(_WORKDIR.value, _OVERWRITE.value), _REPS.value, set(_SKIP.value)
  scfg, bcfg = sweep_gamma.get_config("gpu"), sweep_gamma.get_config("gpu_batch")
  tcfg, tnote = sweep_gamma.get_config("taskbench_quick"), ""
  if _TREES.value:
    tcfg.taskbench_trees = tuple(_TREES.value)
  if _SMOKE.value:
    bcfg.target, bcfg.draft, bcfg.dtype = "tiny", "tiny-draft", "float32"
    # batch 2 alone: batch 1 runs in the sweep part (each batch is a set of compiles)
    bcfg.batches, bcfg.gammas, bcfg.n_predict, bcfg.ctx_size, bcfg.reps = (2,), (2,), 8, 48, 1
    scfg.target, scfg.draft, scfg.dtype = "tiny", "tiny-draft", "float32"
    scfg.gammas, scfg.n_predict, scfg.ctx_size, scfg.reps = (2,), 8, 48, 1  # one group
    scfg.accepts = ("bernoulli:0.8", "always")
    # one model, two batch sizes, two capacities, one tree size: each part's
    # code path once, at the fewest compiled shapes (the suite runs this)
    models, n_prompt, n_gen, depth = ["tiny"], [1, 2], 4, 8
    attn_model, attn_points, attn_gen = "tiny", [(32, 8), (128, 8)], 4
    tree_model, tree_batches, tree_sizes = "tiny", (1, 2), (4,)
    tcfg.target, tcfg.chat, tcfg.prompt_tokens = "tiny", False, "1,5,9,200,3,7,7,7,7,7"
    tcfg.drafters, tcfg.taskbench_trees, tcfg.taskbench = ("ngram",), (), ("math",)
    tcfg.n_predict, tcfg.ctx_size = 8, 48
    tnote = ("Smoke: the tiny target (random weights), the n-gram drafter, one category; "
             "the real part runs configs/sweep_gamma.py:taskbench_quick.")
    lever_names, lever_point = ("default", "all"), (48, 8, 4)
    # one ragged block (3 + 1 tokens); two surface points at one batch and
    # capacity (one set of compiles; too few to fit: tests/bench/test_gpu_costs.py
    # gives the sections a fitted surface)
    packed_model, packed_batches, packed_gamma = "tiny", (2,), 2
    packed_sizes = lambda batch, gamma: [batch * (1 + gamma // 2)]
    surface = gpu_costs.surface_settings("tiny", "float32", (16, 24), (2,), 2, 1,
                                         "streaming:8,2", k=1)
  else:
    models, n_prompt, n_gen, depth = ["llama-160m", "llama-7b"], [1, 2, 4, 8, 16, 32, 64], 64, 128
    attn_model, attn_points, attn_gen = "llama-160m", [(256, 128), (4096, 128), (4096, 2000)], 32
    tree_model, tree_batches, tree_sizes = "llama-7b", (1, 4, 16, 32), (4, 8, 16, 32, 64)
    lever_names, lever_point = LEVERS, (512, 128, 64)  # capacity, depth, steps timed
    packed_model, packed_batches, packed_gamma = "llama-7b", (1, 16, 64), 4
    packed_sizes = gpu_costs.packed_sizes
    surface = gpu_costs.surface_settings("llama-7b", scfg.dtype, (512, 16384, 32768),
                                         (1, 8, 32), 4, min(reps, 3))
  if _SWEEP_GAMMA.value:
    scfg.gammas = tuple(_SWEEP_GAMMA.value)
  scfg, bcfg, tcfg = (SweepConfig.from_mapping(c) for c in (scfg, bcfg, tcfg))
  if not _SMOKE.value:
    tcfg = gs.with_new_head(tcfg)
  child = ([f"--reps={reps}", f"--sweep_gamma={max(scfg.gammas)}"]  # one group: minutes less
           + ["--smoke"] * _SMOKE.value + ["--overwrite"] * _OVERWRITE.value)
  bandwidth = _BANDWIDTH.value or roofline.device_bandwidth_gbs(dev.device_kind)
  lines = [f"# GPU check: {dev.device_kind}", ""]
  measured = {}  # filled by the peaks part
  gamma = 4 if not _SMOKE.value else 2
  parts = [
      ("peaks", lambda: peaks_part(_SMOKE.value, reps, out, measured)),
      ("bench", lambda: gs.bench_section(
          gs.bench_run(models, scfg.dtype, n_prompt, n_gen, depth, reps, out), models,
          scfg.dtype, n_prompt, n_gen, depth, bandwidth, measured.get("read_gbs"))),
      ("attention", lambda: gs.attention_section(
          gs.attention_run(attn_model, scfg.dtype, attn_points, attn_gen, reps, out),
          attn_model, attn_points)),
      ("sweep", lambda: gs.sweep_section(gs.sweep_run(scfg, _WORKDIR.value, "sweep",
                                                      _OVERWRITE.value), scfg)),
      ("batch", lambda: gs.batch_section(gs.sweep_run(bcfg, _WORKDIR.value, "sweep_batch",
                                                      _OVERWRITE.value),
                                         bcfg)),
      ("overhead", lambda: gs.overhead_section(
          gs.overhead_run(scfg.target, scfg.draft, scfg.dtype, gamma, reps, out), scfg.target,
          scfg.draft, gamma)),
      ("trees", lambda: gs.trees_section(
          gs.trees_run(tree_model, scfg.dtype, tree_batches, tree_sizes, depth, reps, out),
          tree_model, tree_sizes)),
      ("mesh", lambda: mesh_part("tiny" if _SMOKE.value else "llama-7b", scfg.dtype, reps,
                                 out)),
      ("taskbench", lambda: taskbench_part(tcfg, _WORKDIR.value, out, tnote)),
      ("levers", lambda: levers_part(scfg, lever_names, lever_point, reps, out, bandwidth,
                                     measured)),
      ("lever_sweep", lambda: lever_sweep_part(scfg, measured, child, _SMOKE.value)),
      ("packed", lambda: gpu_costs.packed_section(gpu_costs.packed_run(
          packed_model, scfg.dtype, packed_batches, packed_gamma, depth, reps, out,
          packed_sizes), packed_model)),
      ("surface", lambda: gpu_costs.surface_section(gpu_costs.surface_run(
          surface, os.path.join(_WORKDIR.value, "surface"), out, out.env, PREDICT_BATCHES,
          overwrite=_OVERWRITE.value), surface, PREDICT_BATCHES,
          contexts=None if _SMOKE.value else PREDICT_CONTEXTS)),
  ]
  # The parts the README quotes first, so that a run cut short (a device lease is
  # minutes) still has them; the summary is rewritten after every part.
  parts = sorted(parts, key=lambda p: ORDER.index(p[0]))
  summary = os.path.join(_WORKDIR.value, "gpu_summary.md")
  text = gs.run_parts(parts, skip, lines, summary, f"Machine: {wd.machine_line(out.env)}.")
  print(text)
  print(f"wrote {summary} and {out.path}")


if __name__ == "__main__":
  cli.run(main)
