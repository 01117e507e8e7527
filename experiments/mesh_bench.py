"""Sharded runs: what a model axis costs per step, which draft placement is
faster, and what a 70B target with a 7B draft needs per device.

  python experiments/mesh_bench.py                      # 8 CPU devices, ~6 min on 2 cores
  python experiments/mesh_bench.py --parts=plan --plan_mesh=data:1,model:8

Part `measure` (one run, repetitions alternating between the variants):
  * T(1) and T(gamma+1) of --model on meshes data:1,model:M for each M in
    --model_axes (per forward, k forwards per jitted loop: probes.CostProbe);
  * the whole speculative loop (rule `always`, so every variant runs the same
    steps) on data:1,model:--spec_axis with the draft replicated on every
    device and split over the model axis, next to target-only decoding on the
    same mesh; ms per generated token, tokens checked identical.
On the CPU the devices are virtual (--host_devices, set before JAX starts)
and share the machine's cores: the model axis cannot make a step faster
here, so these figures measure what the collectives and the split cost, not
a speedup. On a GPU node the same command runs over the real GPUs.

Part `plan`: `mesh_plan.plan` compiles the decode step, the verify step and
the speculative loop of --plan_target / --plan_draft from shapes alone on
--plan_mesh and reports the bytes per device (weights, caches, temporaries)
for each --draft_modes, against the memory of an 80 GB A100/H100 and a 141 GB
H200.
"""

import os
import sys

_HOST = [a.split("=", 1)[1] for a in sys.argv if a.startswith("--host_devices=")]
if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
  os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                             f" --xla_force_host_platform_device_count={_HOST[-1] if _HOST else 8}")

# pylint: disable=wrong-import-position
import numpy as np
from absl import flags

from specjax.bench import tables
from specjax.formats import checkpoint
from specjax import cli
from specjax.decode import probes
from specjax.decode import generation
from specjax.parallel import mesh_plan
from specjax.model import sharding
from specjax.decode import speculative
from specjax.model import steps
from specjax import workdir
from specjax.model.config import get_preset
from specjax.errors import ConfigError

_MODEL = flags.DEFINE_string("model", "cpu-target", "Target: preset, HF or orbax directory.")
_MODEL_DRAFT = flags.DEFINE_string("model_draft", "cpu-draft", "Draft: preset, HF or orbax directory.")
_DTYPE = flags.DEFINE_string("dtype", None, "Compute dtype of both; default: the models' own.")
_PARTS = flags.DEFINE_list("parts", ["measure", "plan"], "measure, plan or both.")
flags.DEFINE_integer("host_devices", 8, "CPU only: virtual devices (read before JAX starts).",
                     lower_bound=1)
_AXES = flags.DEFINE_list("model_axes", ["1", "2", "4"], "Model-axis sizes of the T(N) part.")
_SPEC_AXIS = flags.DEFINE_integer("spec_axis", 4, "Model axis of the speculative-loop part.",
                                  lower_bound=1)
_DRAFT_MODES = flags.DEFINE_list("draft_modes", ["replicated", "model"],
                                 "Draft placements to compare (--draft_sharding values).")
_GAMMA = flags.DEFINE_integer("gamma", 4, "Draft length.", lower_bound=1, upper_bound=64)
_DEPTH = flags.DEFINE_integer("depth", 128, "Tokens in the cache during T(N).", lower_bound=0)
_CAPACITY = flags.DEFINE_integer("capacity", 256, "Cache slots during T(N).", lower_bound=16)
_N_PREDICT = flags.DEFINE_integer("n_predict", 64, "Tokens per speculative run.", lower_bound=2)
_REPS = flags.DEFINE_integer("reps", 5, "Timed repetitions of each variant (alternating).",
                             lower_bound=1)
_SEED = flags.DEFINE_integer("seed", 0, "Random-init seed of presets and prompt.")
_PLAN_TARGET = flags.DEFINE_string("plan_target", "llama-2-70b", "Preset planned from shapes.")
_PLAN_DRAFT = flags.DEFINE_string("plan_draft", "llama-2-7b", "Draft preset planned with it.")
_PLAN_MESH = flags.DEFINE_string("plan_mesh", "data:1,model:8", "Mesh of the plan.")
_PLAN_DTYPE = flags.DEFINE_string("plan_dtype", "bfloat16", "Dtype of the plan.")
_PLAN_CAPACITY = flags.DEFINE_integer("plan_capacity", 4096, "Cache slots of the plan.",
                                      lower_bound=16)
_PLAN_BATCH = flags.DEFINE_integer("plan_batch", 1, "Batch of the plan.", lower_bound=1)
_OUT = cli.RecordFlags("record")

GB = 1e9
ACCELERATORS = (("A100/H100 80 GB", 80e9), ("H200 141 GB", 141e9))


def _mesh(model_axis: int):
  return sharding.make_mesh(f"data:1,model:{model_axis}")


def measure_costs(env) -> list[dict]:
  axes = tables.parse_ints(_AXES.value, "--model_axes")
  return [{**r, "env": env} for r in mesh_plan.model_axis_costs(
      _MODEL.value, _DTYPE.value, axes, _GAMMA.value, _CAPACITY.value, _DEPTH.value,
      _REPS.value, _SEED.value)]


def measure_loop(env) -> list[dict]:
  """Speculative loop with each draft placement vs target-only, one mesh."""
  mesh = _mesh(_SPEC_AXIS.value)
  with sharding.use(mesh):
    tcfg, tparams, _ = checkpoint.load_model(_MODEL.value, _DTYPE.value, _SEED.value)
  target = steps.Runner(tcfg, tparams)
  drafts = {}
  for mode in _DRAFT_MODES.value:
    with sharding.use(mesh, mode):
      dcfg, dparams, _ = checkpoint.load_model(_MODEL_DRAFT.value, _DTYPE.value,
                                               _SEED.value + 1, role="draft")
    speculative.check_vocabularies(tcfg, dcfg)
    drafts[mode] = steps.Runner(dcfg, dparams)
  prompt = probes.random_tokens(np.random.RandomState(_SEED.value), tcfg.vocab_size,
                               1, 32)[0].tolist()
  g, n_pred = _GAMMA.value, _N_PREDICT.value

  def run(mode):
    with sharding.use(mesh, mode or "replicated"):
      if mode is None:
        r = generation.generate(target, [prompt], n_pred)
      else:
        r = speculative.generate(target, drafts[mode], [prompt], n_pred, g, rule="always")
    return r.tokens[0], r.eval_s

  variants = [None] + list(drafts)
  tokens = {v: run(v)[0] for v in variants}  # compiles
  times = {v: [] for v in variants}
  for r in range(_REPS.value):
    for v in variants:
      times[v].append(run(v)[1])
    print(f"  loop round {r + 1}/{_REPS.value}", file=sys.stderr, flush=True)
  same = all(tokens[v] == tokens[variants[1]] for v in variants[1:])
  base = float(np.median(times[None]))
  out = []
  for v in variants:
    t = float(np.median(times[v]))
    out.append({"part": "loop", "target": tcfg.name, "draft": drafts[v].cfg.name if v else None,
                "mesh": f"data:1,model:{_SPEC_AXIS.value}", "draft_sharding": v,
                "precision": tcfg.precision, "gamma": g, "n_predict": n_pred, "rule": "always",
                "eval_s": t, "ms_per_token": 1e3 * t / n_pred, "speedup": base / t,
                "spec_tokens_identical": same, "times": times[v], "env": env})
  return out


def plan(env) -> list[dict]:
  mesh = sharding.make_mesh(_PLAN_MESH.value)
  tcfg = get_preset(_PLAN_TARGET.value, _PLAN_DTYPE.value)
  dcfg = get_preset(_PLAN_DRAFT.value, _PLAN_DTYPE.value)
  out = []
  for mode in _DRAFT_MODES.value:
    print(f"plan: compiling {tcfg.name} + {dcfg.name} on {_PLAN_MESH.value}, draft {mode}",
          file=sys.stderr, flush=True)
    with sharding.use(mesh, mode):
      rec = mesh_plan.plan(tcfg, dcfg, _PLAN_BATCH.value, _PLAN_CAPACITY.value, _GAMMA.value)
    out.append({"part": "plan", **rec, "env": env})
  return out


def _gb(x: float) -> str:
  return f"{x / GB:.2f}"


def report(records: list[dict]) -> None:
  cost = [r for r in records if r["part"] == "costs"]
  if cost:
    print(f"\nT(N) of {cost[0]['model']} ({cost[0]['precision']}), batch 1, "
          f"{_DEPTH.value} of {_CAPACITY.value} slots used, medians of {_REPS.value}:")
    print(tables.markdown_table(
        ["mesh", "T(1) ms", f"T({cost[0]['gamma'] + 1}) ms", "T(g+1)/T(1)", "T(1) / first mesh"],
        [[r["mesh"], f"{1e3 * r['t1_s']:.2f}", f"{1e3 * r['tv_s']:.2f}",
          f"{r['verify_ratio']:.2f}", f"{r['t1_vs_first']:.2f}"] for r in cost]))
  loop = [r for r in records if r["part"] == "loop"]
  if loop:
    d = next(r["draft"] for r in loop if r["draft"])
    print(f"\nGeneration of {loop[0]['n_predict']} tokens on {loop[0]['mesh']}: "
          f"{loop[0]['target']} alone and with {d} (gamma {loop[0]['gamma']}, rule always), "
          f"medians of {_REPS.value}:")
    print(tables.markdown_table(
        ["run", "ms/token", "speedup vs target-only"],
        [["target only" if r["draft_sharding"] is None else f"draft {r['draft_sharding']}",
          f"{r['ms_per_token']:.2f}", f"{r['speedup']:.2f}"] for r in loop]))
    print(f"speculative tokens identical across draft placements: "
          f"{'yes' if loop[-1]['spec_tokens_identical'] else 'NO'}")
  for r in (r for r in records if r["part"] == "plan"):
    print(f"\nPlan: {r['target']} + {r['draft']} ({r['precision']}) on {r['mesh']}, draft "
          f"{r['draft_sharding']}, batch {r['batch']}, {r['capacity']} slots; GB per device:")
    rows = [["target weights", _gb(r["target_weight_bytes"])],
            ["target cache", _gb(r["target_cache_bytes"])],
            ["draft weights", _gb(r["draft_weight_bytes"])],
            ["draft cache", _gb(r["draft_cache_bytes"])],
            ["all arguments of the speculative loop (XLA)",
             _gb(r["programs"]["spec_loop"]["argument_bytes"])],
            ["decode-step activations (XLA, f32 twin)", f"{r['act_temp_bytes'] / GB:.4f}"]]
    for name, cap in ACCELERATORS:
      rows.append([f"left of {name}", _gb(cap - r["programs"]["spec_loop"]["argument_bytes"])])
    print(tables.markdown_table(["", "GB"], rows))
    if r["platform"] == "cpu" and r["precision"] != "float32":
      print(f"(XLA:CPU converts bf16 weights to f32 for its matmuls: its temporaries, "
            f"{_gb(r['programs']['spec_loop']['temp_bytes'])} GB here, are not a GPU's)")


def main(argv):
  del argv
  bad = set(_PARTS.value) - {"measure", "plan"}
  if bad:
    raise ConfigError(f"--parts: unknown {', '.join(sorted(bad))} (measure, plan)")
  for mode in _DRAFT_MODES.value:
    if mode not in sharding.DRAFT_MODES:
      raise ConfigError(f"--draft_modes: {mode!r} is not one of {', '.join(sharding.DRAFT_MODES)}")
  env = workdir.environment()
  on_record = _OUT.on_record(lambda r: f"{r['part']}: {r.get('mesh')} done")
  records = []
  if "measure" in _PARTS.value:
    for r in measure_costs(env) + measure_loop(env):
      on_record(r)
      records.append(r)
  if "plan" in _PARTS.value:
    for r in plan(env):
      on_record(r)
      records.append(r)
  report(records)
  _OUT.finish(records)


if __name__ == "__main__":
  cli.run(main)
