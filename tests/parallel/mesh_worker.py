"""Runs the sharding checks on 8 virtual CPU devices and writes a JSON report.

  XLA_FLAGS=--xla_force_host_platform_device_count=8 python tests/mesh_worker.py DIR PART

DIR holds the HF checkpoints `target` and `draft_tp`, and `pad{V}`,
`pad{V}_draft` of vocabularies no model axis divides (written by
tests/test_sharding.py); the report goes to DIR/report_PART.json. PART `a`
runs the split meshes (1,8) and (2,4) and the checks tied to them, PART `b`
the others, the padded saves and mask and the error cases; the padded
vocabularies run on model:8 in `a`, on model:4 in `b`: test_sharding.py runs
both at once (XLA compiles on one core, and compiling is most of the work)
and merges them.
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from specjax.formats import safetensors_io
from specjax.formats import checkpoint
from specjax.formats import gguf as gguf_file
from specjax.formats import gguf_write
from specjax.formats import hf
from specjax.model import llama
from specjax.model import sampling
from specjax.decode import generation
from specjax.parallel import mesh_plan
from specjax.model import sharding
from specjax.decode import speculative
from specjax.model import steps
from specjax.errors import SpecjaxError
from specjax.model.sampling import SamplingParams

# No mesh, the model axis alone, both axes, the data axis alone: a 1x1 mesh
# takes the same NamedSharding path as these (nothing in sharding.py tests
# for size 1) at another 10 compiles.
MESHES = {"a": ("data:1,model:8", "data:2,model:4"),
          "b": (None, "data:8,model:1")}
# gamma 1 beside gamma 4: on the reference and the most split mesh only (a
# sharding bug shows at any gamma; each further mesh is one more compile).
SPEC1_MESHES = (None, "data:1,model:8")
PROMPTS = [[1, 5, 7, 9, 11], [1, 2], [1, 3, 4, 5, 6, 7, 8, 9, 10, 11], [1, 9, 9]]
N_PREDICT = 10
# Padded vocabularies (sharding.pad_vocab) and the meshes each runs on, by
# part: 259 on model:4 and 8 (1 and 5 padded rows; model:2 pads the same 1
# row as model:4), 1001 on model:4 alone (3 rows; once is enough to show 259
# is not a special case, and each further run is two more compiles).
PAD_VOCABS = (259, 1001)
PAD_MESHES = {"a": {"data:1,model:8": (259,)},
              "b": {"data:1,model:4": (259, 1001)}}
PAD_PROMPTS = [[1, 5, 7, 9, 11], [1, 2]]
PAD_N = 8
COLLECTIVES = ("all-reduce", "all-gather", "all-to-all", "collective-permute", "reduce-scatter")
INSTRUCTION = re.compile(r"^\s*(?:ROOT\s+)?%?[^\s=]+\s*=\s*(.*)$")  # name = shape opcode(...)
ARRAY = re.compile(r"\b[a-z][a-z0-9]*\[([^\]]*)\]")                  # f32[4,128] -> '4,128'


def _shape_and_rest(rhs: str) -> tuple[str, str]:
  """An instruction's right-hand side split after its result shape: a tuple
  shape, '(f32[4]{0}, f32[8]{0})', holds spaces and may nest."""
  if not rhs.startswith("("):
    shape, _, rest = rhs.partition(" ")
    return shape, rest
  depth = 0
  for k, ch in enumerate(rhs):
    depth += {"(": 1, ")": -1}.get(ch, 0)
    if depth == 0:
      return rhs[:k + 1], rhs[k + 1:].lstrip()
  return rhs, ""


def collectives(compiled_text: str) -> dict[str, list[int]]:
  """{op: [element count of each result]} of an optimized HLO module, by
  opcode whatever the instruction's name. An all-reduce counts once per
  array it reduces: XLA's all-reduce combiner merges several into one op
  with a tuple result. An async collective counts at its `-start` (its
  `-done` is the same op). The other collectives count once per op, by
  their largest array."""
  out: dict[str, list[int]] = {}
  for line in compiled_text.splitlines():
    m = INSTRUCTION.match(line)
    if not m:
      continue
    shape, rest = _shape_and_rest(m.group(1))
    opcode = re.match(r"[a-z][a-z\-]*(?=\()", rest)
    op = opcode and opcode.group(0).removesuffix("-start")
    if op not in COLLECTIVES:
      continue
    sizes = [int(np.prod([int(d.lstrip("<=")) for d in dims.split(",") if d] or [1]))
             for dims in ARRAY.findall(shape)] or [1]
    out.setdefault(op, []).extend(sizes if op == "all-reduce" else [max(sizes)])
  return out


def combined_all_reduces() -> str:
  """The optimized HLO of two independent row-split products on model:8:
  XLA's CPU pipeline combines their two all-reduces into one tuple op."""
  mesh = sharding.make_mesh("data:1,model:8")
  split = lambda spec, shape: jax.device_put(jnp.ones(shape), NamedSharding(mesh, spec))
  x, w = split(P(None, "model"), (4, 64)), split(P("model", None), (64, 32))
  return jax.jit(lambda x, a, b: (x @ a, x @ b), out_shardings=NamedSharding(mesh, P())
                 ).lower(x, w, w).compile().as_text()


def shard_fractions(tree) -> dict[str, float]:
  """{path: share of the array held by device 0's shard}."""
  flat = jax.tree_util.tree_flatten_with_path(tree)[0]
  return {sharding.path_str(p): x.addressable_shards[0].data.size / x.size for p, x in flat}


def device0_bytes(tree) -> int:
  return sum(x.addressable_shards[0].data.nbytes for x in jax.tree_util.tree_leaves(tree))


def plan_report(tcfg, tparams, target, dcfg, dparams, mesh) -> dict:
  """mesh_plan.plan from shapes next to the bytes really held by device 0."""
  out = {"real": {"target_weight_bytes": device0_bytes(tparams),
                  "target_cache_bytes": device0_bytes(target.new_cache(4, 48)),
                  "draft_weight_bytes_model": device0_bytes(dparams)}}
  for mode in ("model", "replicated"):
    with sharding.use(mesh, mode):
      rec = mesh_plan.plan(tcfg, dcfg, 4, 48, 4, n_predict=N_PREDICT)
    out[mode] = {k: v for k, v in rec.items() if k.endswith("_bytes")}
    out[mode]["spec_loop_argument_bytes"] = rec["programs"]["spec_loop"]["argument_bytes"]
    out[mode]["decode_argument_bytes"] = rec["programs"]["decode"]["argument_bytes"]
  return out


def run_mesh(spec, ck: Path, report: dict) -> dict:
  mesh = None if spec is None else sharding.make_mesh(spec)
  out: dict = {}
  with sharding.use(mesh, "replicated"):
    tcfg, tparams, _ = checkpoint.load_model(str(ck / "target"))
    dcfg, dparams, _ = checkpoint.load_model("tiny-draft", seed=1, role="draft")
    target, draft = steps.Runner(tcfg, tparams), steps.Runner(dcfg, dparams)
    cache = target.new_cache(len(PROMPTS), 48)
    logits, cache = target.prefill(PROMPTS, cache)
    chunk, cache = target.forward(np.arange(20).reshape(4, 5) + 3, cache)
    out["logits"] = np.concatenate([np.asarray(logits)[:, None], np.asarray(chunk)], 1).tolist()
    out["greedy"] = generation.generate(target, PROMPTS, N_PREDICT).tokens
    for g in (1, 4) if spec in SPEC1_MESHES else (4,):
      out[f"spec{g}"] = speculative.generate(target, draft, PROMPTS, N_PREDICT, g).tokens
    hot = SamplingParams(1.0, top_k=20)
    out["sampled"] = generation.generate(target, PROMPTS, N_PREDICT, hot, seed=3).tokens
    out["spec_sampled"] = speculative.generate(target, draft, PROMPTS, N_PREDICT, 4, sp=hot,
                                               seed=3).tokens
    if spec in (None, "data:1,model:8"):
      # the multi-process comparison: speculative.py --seed=3 (draft seed 4), batch 1
      d4 = steps.Runner(*checkpoint.load_model("tiny-draft", seed=4, role="draft")[:2])
      out["script"] = speculative.generate(target, d4, [[1, 5, 7, 9]], 12, 4, sp=hot,
                                           seed=3).tokens[0]
    if spec in (None, "data:2,model:4"):
      # int8 weights, the target's split over the model axis, the draft's
      # replicated, in a greedy speculative run
      qcfg, qparams, _ = checkpoint.load_model(str(ck / "target"), dtype="int8")
      qdraft = steps.Runner(*checkpoint.load_model("tiny-draft", dtype="int8", seed=1,
                                                   role="draft")[:2])
      shares = shard_fractions(qparams)
      out["int8"] = {
          "spec": speculative.generate(steps.Runner(qcfg, qparams), qdraft, PROMPTS, N_PREDICT,
                                       4).tokens,
          "share": {k: shares[f"layers_0/{k}"]
                    for k in ("attn/wq/kernel_q", "attn/wq/kernel_scale", "mlp/w_down/kernel_q")},
          "dtypes": [str(p["layers_0"]["attn"]["wq"]["kernel_q"].dtype)
                     for p in (qparams, qdraft.params)]}
    if spec == "data:1,model:8":
      report["fractions"] = {"params": shard_fractions(tparams),
                             "cache": shard_fractions(cache.k[0]),
                             "draft": shard_fractions(dparams)}
      decode = steps.forward_step.lower(tparams, jnp.zeros((4, 1), jnp.int32), cache,
                                        cfg=tcfg).compile().as_text()
      verify = steps.forward_step.lower(tparams, jnp.zeros((4, 5), jnp.int32), cache,
                                        cfg=tcfg).compile().as_text()
      report["hlo"] = {"decode": collectives(decode), "verify": collectives(verify),
                       "n_layers": tcfg.n_layers,
                       "smallest_weight": min(x.size for x in jax.tree_util.tree_leaves(tparams)
                                              if x.ndim == 2),
                       "cache_shard": int(cache.k[0].size),
                       "combined": collectives(combined_all_reduces())}
      # the draft split over the model axis too
      with sharding.use(mesh, "model"):
        dcfg2, dparams2, _ = checkpoint.load_model(str(ck / "draft_tp"), role="draft")
        d2 = steps.Runner(dcfg2, dparams2)
        report["draft_split"] = {
            "fraction": shard_fractions(dparams2)["layers_0/attn/wq/kernel"],
            "spec4": speculative.generate(target, d2, PROMPTS, N_PREDICT, 4).tokens}
      with sharding.use(mesh):  # the default draft placement, 'auto'
        report["auto"] = {
            name: shard_fractions(checkpoint.load_model(path, role="draft")[1])[
                "layers_0/attn/wq/kernel"]
            for name, path in (("tiny_draft", "tiny-draft"), ("draft_tp", str(ck / "draft_tp")))}
      report["plan"] = plan_report(tcfg, tparams, target, dcfg2, dparams2, mesh)
      # orbax: save sharded, restore on another mesh
      checkpoint.save(ck / "orbax", tcfg, tparams)
    if spec == "data:2,model:4":
      cfg3, params3 = checkpoint.load(ck / "orbax")
      report["orbax"] = {
          "equal": all(bool(jnp.array_equal(a, b)) for a, b in zip(
              jax.tree_util.tree_leaves(params3), jax.tree_util.tree_leaves(tparams))),
          "fraction": shard_fractions(params3)["layers_0/mlp/w_down/kernel"]}
  return out


def slices_read(ck: Path) -> list[list[int]]:
  """Shapes of the blocks read from safetensors while loading on (1, 8)."""
  seen = []
  orig = safetensors_io.SafetensorsState.read_block

  def spy(self, name, index):
    block = orig(self, name, index)
    if name.endswith("q_proj.weight"):
      seen.append(list(block.shape))
    return block
  safetensors_io.SafetensorsState.read_block = spy
  try:
    with sharding.use(sharding.make_mesh("data:1,model:8")):
      checkpoint.load_model(str(ck / "target"))
  finally:
    safetensors_io.SafetensorsState.read_block = orig
  return seen


def errors(ck: Path) -> dict[str, str]:
  out = {}
  cases = {"too_big": lambda: sharding.make_mesh("data:2,model:8"),
           "bad_axis": lambda: sharding.make_mesh("rows:2"),
           "zero": lambda: sharding.make_mesh("model:0"),
           "two_wild": lambda: sharding.make_mesh("data:-1,model:-1")}
  for name, fn in cases.items():
    try:
      fn()
      out[name] = ""
    except SpecjaxError as e:
      out[name] = str(e)
  try:  # tiny-draft: 2 heads, 1 KV head, split over 8
    with sharding.use(sharding.make_mesh("data:1,model:8"), "model"):
      checkpoint.load_model("tiny-draft", role="draft")
    out["indivisible"] = ""
  except SpecjaxError as e:
    out["indivisible"] = str(e)
  return out


def padded_runs(ck: Path, part: str) -> dict:
  """Greedy target-only and speculative tokens of the padded-vocabulary
  models on the part's meshes (the 2-head draft replicated, padded alike),
  and, on model:8, the int8 target's."""
  out = {}
  for spec, vocabs in PAD_MESHES[part].items():
    mesh = sharding.make_mesh(spec)
    for v in vocabs:
      with sharding.use(mesh):  # 'auto': the draft's 1 KV head is not split
        cfg, params, _ = checkpoint.load_model(str(ck / f"pad{v}"))
        dcfg, dparams, _ = checkpoint.load_model(str(ck / f"pad{v}_draft"), role="draft")
        target, draft = steps.Runner(cfg, params), steps.Runner(dcfg, dparams)
        rec = {"padded": [cfg.padded_vocab, dcfg.padded_vocab],
               "embed_fraction": shard_fractions(params)["embed/embedding"],
               "greedy": generation.generate(target, PAD_PROMPTS, PAD_N).tokens,
               "spec": speculative.generate(target, draft, PAD_PROMPTS, PAD_N, 3).tokens}
        if spec == "data:1,model:8" and v == PAD_VOCABS[0]:
          qcfg, qparams, _ = checkpoint.load_model(str(ck / f"pad{v}"), "int8")
          q = steps.Runner(qcfg, qparams)
          rec["int8"] = {"greedy": generation.generate(q, PAD_PROMPTS, PAD_N).tokens,
                         "spec": speculative.generate(q, draft, PAD_PROMPTS, PAD_N, 3).tokens}
      out[f"{v}/{spec}"] = rec
  return out


def int8_reference(ck: Path) -> dict:
  """The int8 run of padded_runs on one device (nothing padded)."""
  v = PAD_VOCABS[0]
  qcfg, qparams, _ = checkpoint.load_model(str(ck / f"pad{v}"), "int8")
  draft = steps.Runner(*checkpoint.load_model(str(ck / f"pad{v}_draft"))[:2])
  q = steps.Runner(qcfg, qparams)
  return {"greedy": generation.generate(q, PAD_PROMPTS, PAD_N).tokens,
          "spec": speculative.generate(q, draft, PAD_PROMPTS, PAD_N, 3).tokens}


def loud_padding(params, v: int):
  """`params` with the padded LM head columns (ids >= v) at +-1000 along
  two random directions: whatever the hidden state, some padded logit is
  far above every real one, so only the mask keeps them out."""
  kernel = np.array(sharding.to_host(params["lm_head"]["kernel"]))  # [E, Vp]
  u = np.random.RandomState(0).randn(2, kernel.shape[0])
  signs = np.array([1, -1] * kernel.shape[1])[:kernel.shape[1] - v]
  kernel[:, v:] = 1000 * (u[np.arange(kernel.shape[1] - v) // 2 % 2].T * signs)
  lm_head = dict(params["lm_head"],
                 kernel=sharding.place(kernel, params["lm_head"]["kernel"].sharding))
  return dict(params, lm_head=lm_head)


def masked_runs(ck: Path) -> dict:
  """On model:8 with loud padded columns (loud_padding): greedy and sampled
  tokens, target-only and speculative, the first step's sampling mass on
  the real and the padded ids and its argmax, then the same first step with
  the mask taken out of the model (the deliberate bug: padded ids win)."""
  v, mesh = PAD_VOCABS[0], sharding.make_mesh("data:1,model:8")
  hot = SamplingParams(1.0)
  out = {}
  with sharding.use(mesh):
    cfg, params, _ = checkpoint.load_model(str(ck / f"pad{v}"))
    dcfg, dparams, _ = checkpoint.load_model(str(ck / f"pad{v}_draft"), role="draft")
    target = steps.Runner(cfg, loud_padding(params, v))
    draft = steps.Runner(dcfg, loud_padding(dparams, v))
    out["greedy"] = generation.generate(target, PAD_PROMPTS, PAD_N).tokens
    out["spec"] = speculative.generate(target, draft, PAD_PROMPTS, PAD_N, 3).tokens
    out["sampled"] = generation.generate(target, PAD_PROMPTS, PAD_N, hot, seed=1).tokens
    out["spec_sampled"] = speculative.generate(target, draft, PAD_PROMPTS, PAD_N, 3,
                                               sp=hot, seed=1).tokens
    cap = generation.plan_capacity(cfg, max(map(len, PAD_PROMPTS)), PAD_N)  # generate's

    def first_step(key: str):  # the prompts' next-token distributions and argmax
      logits = target.prefill(PAD_PROMPTS, target.new_cache(len(PAD_PROMPTS), cap))[0]
      p = np.asarray(sharding.to_host(sampling.probs(logits, hot)), np.float64)  # [B, Vp]
      out[key] = {"real": p[:, :v].sum(-1).tolist(), "padded": p[:, v:].sum(-1).tolist(),
                  "argmax": np.asarray(sharding.to_host(logits)).argmax(-1).tolist()}
    first_step("mass")
    mask = llama.mask_padded_logits
    llama.mask_padded_logits = lambda logits, cfg: logits
    jax.clear_caches()
    try:
      first_step("no_mask")  # the deliberate bug
    finally:
      llama.mask_padded_logits = mask
      jax.clear_caches()
  return out


def padded_saves(ck: Path) -> dict:
  """Saved from model:8 (padded to 264): the shapes in the HF, orbax and
  GGUF files, and what loading them back on model:4 (260) and model:8 gives.
  A 9-token vocabulary on model:8 (16 rows, 2 per device) leaves three
  devices padding only and one half and half."""
  v, out = PAD_VOCABS[0], {}
  with sharding.use(sharding.make_mesh("data:1,model:8")):
    cfg, params, _ = checkpoint.load_model(str(ck / f"pad{v}"))
    hf.save_hf(ck / "pad_saved_hf", cfg, params)
    checkpoint.save(ck / "pad_saved_orbax", cfg, params)
    gguf_write.write_gguf(ck / "pad_saved.gguf", cfg, params)
    files = {"hf": ck / "pad_saved_hf" / hf.WEIGHTS_FILE}
    out["hf_shapes"] = {n: list(safetensors_io.tensor_shape(files["hf"], n))
                        for n in hf.VOCAB_TENSORS}
    out["gguf_shapes"] = {t.name: [int(d) for d in t.shape]
                          for t in gguf_file.open_reader(ck / "pad_saved.gguf").tensors
                          if t.name in ("token_embd.weight", "output.weight")}
    out["orbax_config"] = json.loads((ck / "pad_saved_orbax" / checkpoint.CONFIG_FILE)
                                     .read_text())
    ref = {k: np.asarray(sharding.to_host(x)) for k, x in
           (("embed", params["embed"]["embedding"]), ("head", params["lm_head"]["kernel"]))}
    g = checkpoint.load_model(str(ck / "pad_saved.gguf"))[1]
    out["gguf_equal"] = bool(np.array_equal(np.asarray(g["lm_head"]["kernel"]), ref["head"]))
    tiny = checkpoint.load_model(str(ck / "pad9"))[1]["embed"]["embedding"]
    file9 = safetensors_io.read_tensor(ck / "pad9" / hf.WEIGHTS_FILE, hf.VOCAB_TENSORS[0])
    out["pad9"] = {"shape": list(tiny.shape), "equal": bool(np.array_equal(
        np.asarray(tiny), np.pad(file9, [(0, 7), (0, 0)])))}
  with sharding.use(sharding.make_mesh("data:2,model:4")):
    for name in ("hf", "orbax"):
      rcfg, rparams, _ = checkpoint.load_model(str(ck / f"pad_saved_{name}"))
      embed = np.asarray(rparams["embed"]["embedding"])
      out[name] = {"padded": rcfg.padded_vocab, "shape": list(embed.shape),
                   "equal": bool(np.array_equal(embed[:v], ref["embed"][:v])),
                   "zeros": bool(not embed[v:].any())}
  return out


def main(folder: str, part: str) -> None:
  ck = Path(folder)
  assert jax.device_count() == 8, jax.devices()
  report: dict = {"meshes": {}}
  for spec in MESHES[part]:
    report["meshes"][str(spec)] = run_mesh(spec, ck, report)
  report["pad"] = {"runs": padded_runs(ck, part)}
  if part == "b":
    report["pad"].update(saves=padded_saves(ck), mask=masked_runs(ck))
    report["pad"]["int8_reference"] = int8_reference(ck)
    report["slices"] = slices_read(ck)
    report["errors"] = errors(ck)
  (ck / f"report_{part}.json").write_text(json.dumps(report))


if __name__ == "__main__":
  main(sys.argv[1], sys.argv[2])
