"""Sharded runs: what a model axis costs per step, which draft placement is
faster, and what a 70B target with a 7B draft needs per device.

  python experiments/mesh_bench.py                      # 8 CPU devices, ~6 min on 2 cores
  python experiments/mesh_bench.py --parts=plan --plan_mesh=data:1,model:8

Part `measure` (repetitions alternating between the variants): T(1) and
T(gamma+1) of --model on data:1,model:M for each M in --model_axes
(probes.CostProbe); the speculative loop (rule `always`) on
data:1,model:--spec_axis with the draft replicated and split, next to
target-only on the same mesh; ms per token, tokens checked identical. On the
CPU the devices are virtual (--host_devices) and share the cores: the
figures measure what the collectives and the split cost, not a speedup.

Part `plan`: `mesh_plan.plan` compiles the decode step, the verify step and
the speculative loop of --plan_model / --plan_model_draft from shapes alone
on --plan_mesh and reports the bytes per device for each --draft_modes,
against an 80 GB A100/H100 and a 141 GB H200. The figures: docs/mesh.md.
The loop part and the report: specjax.bench.studies.mesh_study.
"""

import os
import sys

_HOST = [a.split("=", 1)[1] for a in sys.argv if a.startswith("--host_devices=")]
if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
  os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                             f" --xla_force_host_platform_device_count={_HOST[-1] if _HOST else 8}")

# pylint: disable=wrong-import-position
from absl import flags

from specjax import cli
from specjax import workdir
from specjax.bench.studies import mesh_study
from specjax.bench import tables
from specjax.model import sharding
from specjax.parallel import mesh_plan
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
_PLAN_MODEL = flags.DEFINE_string("plan_model", "llama-2-70b", "Target preset planned from shapes.")
_PLAN_MODEL_DRAFT = flags.DEFINE_string("plan_model_draft", "llama-2-7b",
                                        "Draft preset planned with it.")
_PLAN_MESH = flags.DEFINE_string("plan_mesh", "data:1,model:8", "Mesh of the plan.")
_PLAN_DTYPE = flags.DEFINE_string("plan_dtype", "bfloat16", "Dtype of the plan.")
_PLAN_CAPACITY = flags.DEFINE_integer("plan_capacity", 4096, "Cache slots of the plan.",
                                      lower_bound=16)
_PLAN_BATCH = flags.DEFINE_integer("plan_batch", 1, "Batch of the plan.", lower_bound=1)
_OUT = cli.RecordFlags("record")


def measure_costs(env) -> list[dict]:
  axes = tables.parse_ints(_AXES.value, "--model_axes")
  return [{**r, "env": env} for r in mesh_plan.model_axis_costs(
      _MODEL.value, _DTYPE.value, axes, _GAMMA.value, _CAPACITY.value, _DEPTH.value,
      _REPS.value, _SEED.value)]


def measure_loop(env) -> list[dict]:
  return mesh_study.measure_loop(_MODEL.value, _MODEL_DRAFT.value, _DTYPE.value,
                                 _SPEC_AXIS.value, _DRAFT_MODES.value, _GAMMA.value,
                                 _N_PREDICT.value, _REPS.value, _SEED.value, env)


def plan(env) -> list[dict]:
  mesh = sharding.make_mesh(_PLAN_MESH.value)
  tcfg = get_preset(_PLAN_MODEL.value, _PLAN_DTYPE.value)
  dcfg = get_preset(_PLAN_MODEL_DRAFT.value, _PLAN_DTYPE.value)
  out = []
  for mode in _DRAFT_MODES.value:
    print(f"plan: compiling {tcfg.name} + {dcfg.name} on {_PLAN_MESH.value}, draft {mode}",
          file=sys.stderr, flush=True)
    with sharding.use(mesh, mode):
      rec = mesh_plan.plan(tcfg, dcfg, _PLAN_BATCH.value, _PLAN_CAPACITY.value, _GAMMA.value)
    out.append({"part": "plan", **rec, "env": env})
  return out


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
  print(mesh_study.report(records))
  _OUT.finish(records)


if __name__ == "__main__":
  cli.run(main)
