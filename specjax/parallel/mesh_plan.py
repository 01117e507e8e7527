"""What a sharded run needs on each device, from shapes alone.

`plan` lowers and compiles the decode step, the verify step and (with a
draft) the whole speculative loop for abstract arguments
(`jax.ShapeDtypeStruct`s carrying their NamedShardings), so a 70B target
with a 7B draft on an 8-device mesh can be planned on a laptop: nothing is
allocated. Each program's `memory_analysis()` gives its argument bytes per
device (weights and caches), the bytes it aliases (the donated caches) and
its temporaries. Invariant: the argument bytes equal each device's shards
counted from the shardings (`shard_shape`). XLA:CPU converts bf16 weights to
f32 inside the program, so `plan` also reports the float32 twin's
temporaries (`act_temp_bytes`). The plan of a 70B + 7B pair: docs/mesh.md.
"""

from __future__ import annotations

import math
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

from specjax.decode import acceptance
from specjax.formats import checkpoint
from specjax.decode import probes
from specjax.decode import generation
from specjax.decode import plan as plans
from specjax.model import sharding
from specjax.decode import speculative
from specjax.model import steps
from specjax.model import llama as model_lib
from specjax.model import kv_cache as kvc
from specjax.model.config import ModelConfig
from specjax.model.sampling import SamplingParams
from specjax.workdir import Record



def shard_bytes(tree) -> int:
  """Bytes of the shard one device holds, summed over a tree of abstract
  arrays with shardings (every device holds the same amount here)."""
  total = 0
  for x in jax.tree_util.tree_leaves(tree):
    shape = x.sharding.shard_shape(x.shape)
    total += math.prod(shape) * np.dtype(x.dtype).itemsize
  return total


def abstract_params(cfg: ModelConfig, role: str):
  shapes = jax.eval_shape(lambda: model_lib.init_params(cfg))
  return checkpoint.abstract_params(cfg, sharding.role_shardings(cfg, shapes, role))


def abstract_cache(cfg: ModelConfig, params, batch: int, capacity: int) -> kvc.KVCache:
  """The cache `steps.Runner.new_cache` would allocate, as shapes."""
  cs = sharding.cache_sharding(params, batch)
  rep = sharding.replicated()
  shapes = jax.eval_shape(lambda: kvc.init_cache(cfg, batch, capacity))
  return jax.tree_util.tree_map(
      lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=cs if x.ndim == 4 else rep),
      shapes)


def _abstract(shape, dtype) -> jax.ShapeDtypeStruct:
  return jax.ShapeDtypeStruct(shape, dtype, sharding=sharding.replicated())


def _memory(lowered) -> Record:
  t0 = time.perf_counter()
  compiled = lowered.compile()
  compile_s = time.perf_counter() - t0
  ma = compiled.memory_analysis()
  return {"argument_bytes": int(ma.argument_size_in_bytes),
          "alias_bytes": int(ma.alias_size_in_bytes),
          "temp_bytes": int(ma.temp_size_in_bytes),
          "output_bytes": int(ma.output_size_in_bytes),
          "compile_s": compile_s}


def plan(target: ModelConfig, draft: ModelConfig | None, batch: int, capacity: int,
         gamma: int, n_predict: int = 128) -> Record:
  """Per-device memory of the programs of a run on the active mesh (see the
  module docstring). The mesh and the draft mode are `sharding.activate`'s.
  """
  mesh = sharding.current()
  if mesh is None:
    raise ValueError("plan needs an active mesh (sharding.activate / sharding.use)")
  # as load_model would place them: a vocabulary padded for the model axis
  target = sharding.pad_vocab(target)
  draft = None if draft is None else sharding.pad_vocab(draft)
  tp = abstract_params(target, "target")
  tc = abstract_cache(target, tp, batch, capacity)
  rec: Record = {
      "target": target.name, "draft": draft.name if draft else None,
      "precision": target.precision, "mesh": str(sharding.mesh_shape(mesh)),
      "draft_sharding": sharding.draft_mode(), "batch": batch, "capacity": capacity,
      "gamma": gamma, "platform": jax.devices()[0].platform,
      "target_weight_bytes": shard_bytes(tp), "target_cache_bytes": shard_bytes(tc),
      "programs": {}}
  tokens = lambda n: _abstract((batch, n), jnp.int32)
  rec["programs"]["decode"] = _memory(steps.forward_step.lower(tp, tokens(1), tc, cfg=target))
  rec["programs"]["verify"] = _memory(
      steps.forward_step.lower(tp, tokens(gamma + 1), tc, cfg=target))
  if target.precision != "float32":
    f32 = target.with_dtype("float32")
    tp32 = abstract_params(f32, "target")
    rec["act_temp_bytes"] = _memory(steps.forward_step.lower(
        tp32, tokens(1), abstract_cache(f32, tp32, batch, capacity), cfg=f32))["temp_bytes"]
  else:
    rec["act_temp_bytes"] = rec["programs"]["decode"]["temp_bytes"]
  if draft is not None:
    dp = abstract_params(draft, "draft")
    dc = abstract_cache(draft, dp, batch, capacity)
    rec["draft_split"] = sharding.model_axis_for("draft", draft) > 1
    rec["draft_weight_bytes"] = shard_bytes(dp)
    rec["draft_cache_bytes"] = shard_bytes(dc)
    sc = plans.SpecConfig(target, draft, gamma, SamplingParams())
    state = speculative.SpecState(tcache=tc, dcache=dc, tail=_abstract((batch, 2), jnp.int32),
                                  n=_abstract((batch,), jnp.int32))
    out = _abstract((batch, n_predict + gamma + 1), jnp.int32)
    key = _abstract((2,), jnp.uint32)
    probs = _abstract(acceptance.position_probs(acceptance.parse_rule("always"),
                                                gamma).shape, jnp.float32)
    rec["programs"]["spec_loop"] = _memory(speculative.spec_loop.lower(
        tp, dp, state, out, key, probs, sc=sc, n_predict=n_predict,
        eos_id=generation.NO_EOS if target.eos_token_id is None
        else target.eos_token_id))
  rec["weights_and_caches_bytes"] = (
      rec["target_weight_bytes"] + rec["target_cache_bytes"]
      + rec.get("draft_weight_bytes", 0) + rec.get("draft_cache_bytes", 0))
  return rec


def model_axis_costs(model: str, dtype: str | None, axes, gamma: int, capacity: int,
                     depth: int, reps: int, seed: int = 0) -> list[Record]:
  """T(1) and T(gamma+1) (batch 1, per forward: probes.CostProbe) of `model`
  on meshes data:1,model:M for M in `axes`, repetitions alternating between
  the meshes. One record per mesh; `t1_vs_first` is T(1) over the first mesh's."""
  n = [1, gamma + 1]
  probe_of = {}
  for m in axes:
    mesh = sharding.make_mesh(f"data:1,model:{m}")
    with sharding.use(mesh):
      cfg, params, _ = checkpoint.load_model(model, dtype, seed)
      probe_of[m] = (mesh, probes.CostProbe(steps.Runner(cfg, params), capacity, depth, seed))
      print(f"model:{m}: {cfg.name} loaded, compiling", file=sys.stderr, flush=True)
      probe_of[m][1].times(n, reps=1)  # compile and warm
  times = {m: {k: [] for k in n} for m in axes}
  for r in range(reps):
    for m in axes:
      mesh, probe = probe_of[m]
      with sharding.use(mesh):
        for k, t in probe.times(n, reps=1).items():
          times[m][k].append(t.median)
    print(f"  T(N) round {r + 1}/{reps}", file=sys.stderr, flush=True)
  base = float(np.median(times[axes[0]][1]))
  out = []
  for m in axes:
    cfg = probe_of[m][1].m.cfg
    t1, tv = float(np.median(times[m][1])), float(np.median(times[m][n[1]]))
    out.append({"part": "costs", "model": cfg.name, "mesh": f"data:1,model:{m}",
                "model_axis": m, "precision": cfg.precision, "gamma": gamma,
                "capacity": capacity, "depth": depth, "t1_s": t1, "tv_s": tv,
                "verify_ratio": tv / t1, "t1_vs_first": t1 / base,
                "times": {str(k): v for k, v in times[m].items()}})
  return out
