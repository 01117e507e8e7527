"""Sharding over a jax Mesh: the same tokens on every mesh, 1/M of every
split weight and of the cache per device, the Megatron collective count, and
two processes joined by jax.distributed giving one process's tokens; a
vocabulary the model axis does not divide padded, masked and stripped on save.

The 8-device checks run in two concurrent subprocesses (tests/mesh_worker.py:
XLA's device count is fixed when jax starts); these tests read their merged
report.
"""

import json
import os
import subprocess
import sys

import numpy as np
import pytest

import mesh_worker
from specjax.formats import hf
from specjax.model import llama as model
from specjax.model import sharding
from specjax.model.config import ModelConfig, get_preset
from specjax.errors import ConfigError

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))  # the repository (tests/parallel/../..)
EIGHT = "--xla_force_host_platform_device_count=8"
# GQA (16 query heads over 8 KV heads); every split size divisible by 8.
TARGET = ModelConfig("tp-target", vocab_size=256, dim=128, n_layers=2, n_heads=16,
                     n_kv_heads=8, ffn_dim=256, max_seq_len=128, attn_block=8)
DRAFT_TP = ModelConfig("tp-draft", vocab_size=256, dim=64, n_layers=1, n_heads=8,
                       n_kv_heads=8, ffn_dim=128, max_seq_len=128, attn_block=8)


def pad_target(v: int) -> ModelConfig:
  """A target of vocabulary v (no model axis > 1 divides 259, 1001 or 9)."""
  return ModelConfig(f"pad{v}", vocab_size=v, dim=64, n_layers=1, n_heads=8, n_kv_heads=8,
                     ffn_dim=128, max_seq_len=128, attn_block=8)


def pad_draft(v: int) -> ModelConfig:
  """Its draft: 1 KV head, so replicated ('auto') on every mesh, padded alike."""
  return ModelConfig(f"pad{v}-draft", vocab_size=v, dim=32, n_layers=1, n_heads=2,
                     n_kv_heads=1, ffn_dim=64, max_seq_len=128, attn_block=8)


def _env(devices: int) -> dict:
  env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=ROOT)
  env["XLA_FLAGS"] = " ".join([env.get("XLA_FLAGS", ""),  # conftest's flags, and the count
                              f"--xla_force_host_platform_device_count={devices}"]).strip()
  return env


def host_params(cfg: ModelConfig, seed: int):
  """Parameters for `cfg` drawn on the host like model.init_params's
  (normal(0.02) weights, unit norm scales), without its one compile per
  config (seven configs here: ~8 s of the setup)."""
  import jax  # pylint: disable=import-outside-toplevel
  rng = np.random.RandomState(seed)
  draw = lambda path, x: (np.ones(x.shape, x.dtype) if sharding.path_str(path).endswith("scale")
                          else (0.02 * rng.standard_normal(x.shape)).astype(x.dtype))
  return jax.tree_util.tree_map_with_path(draw, jax.eval_shape(lambda: model.init_params(cfg)))


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
  folder = tmp_path_factory.mktemp("mesh")
  hf.save_hf(folder / "target", TARGET, host_params(TARGET, 0))
  hf.save_hf(folder / "draft_tp", DRAFT_TP, host_params(DRAFT_TP, 2))
  for v in mesh_worker.PAD_VOCABS:
    hf.save_hf(folder / f"pad{v}", pad_target(v), host_params(pad_target(v), 5))
    hf.save_hf(folder / f"pad{v}_draft", pad_draft(v), host_params(pad_draft(v), 6))
  hf.save_hf(folder / "pad9", pad_target(9), host_params(pad_target(9), 7))
  return folder


@pytest.fixture(scope="module")
def report(ckpts):
  procs = [subprocess.Popen([sys.executable, os.path.join(HERE, "mesh_worker.py"), str(ckpts),
                             part], env=_env(8), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True) for part in "ab"]
  try:
    errs = [p.communicate(timeout=600)[1] for p in procs]
  finally:
    for p in procs:
      p.kill()
  for p, err in zip(procs, errs):
    assert p.returncode == 0, err[-3000:]
  report = {"meshes": {}, "pad": {"runs": {}}}
  for part in "ab":
    got = json.loads((ckpts / f"report_{part}.json").read_text())
    report["meshes"].update(got.pop("meshes"))
    pad = got.pop("pad")
    report["pad"]["runs"].update(pad.pop("runs"))
    report["pad"].update(pad)
    report.update(got)
  return report


def test_logits_agree_on_every_mesh(report):
  ref = np.array(report["meshes"]["None"]["logits"])
  for spec, out in report["meshes"].items():
    np.testing.assert_allclose(np.array(out["logits"]), ref, atol=2e-5, rtol=1e-5,
                               err_msg=f"mesh {spec}")


@pytest.mark.parametrize("what", ["greedy", "spec1", "spec4", "sampled", "spec_sampled",
                                  "script"])
def test_tokens_identical_on_every_mesh(report, what):
  ref = report["meshes"]["None"][what]
  checked = [spec for spec, out in report["meshes"].items() if what in out]
  assert len(checked) >= (2 if what in ("script", "spec1") else 4), checked
  for spec in checked:
    assert report["meshes"][spec][what] == ref, f"{what} on mesh {spec}"


def test_greedy_speculative_equals_target_only_on_meshes(report):
  for spec, out in report["meshes"].items():
    assert out.get("spec1", out["greedy"]) == out["greedy"] == out["spec4"], spec


def test_each_device_holds_its_share(report):
  frac = report["fractions"]
  for name, f in frac["params"].items():
    want = 1.0 if name.endswith("norm/scale") else 1 / 8
    assert f == pytest.approx(want), name
  assert frac["cache"] == {"": pytest.approx(1 / 8)}
  assert set(frac["draft"].values()) == {1.0}  # replicated by default
  assert report["draft_split"]["fraction"] == pytest.approx(1 / 8)


def test_draft_split_over_model_axis_gives_the_same_tokens(report):
  assert report["draft_split"]["spec4"] == report["meshes"]["None"]["greedy"]


def test_decode_step_has_two_all_reduces_per_layer_and_no_gathers(report):
  hlo = report["hlo"]
  for step in ("decode", "verify"):
    ops = hlo[step]
    # two per layer (after o and after down) and one for the vocab-split embedding
    assert len(ops.get("all-reduce", [])) <= 2 * hlo["n_layers"] + 1, (step, ops)
    assert len(ops.get("all-reduce", [])) >= 2 * hlo["n_layers"], (step, ops)
    # anything gathered is smaller than any weight and than a cache shard
    limit = min(hlo["smallest_weight"], hlo["cache_shard"])
    for op in ("all-gather", "all-to-all", "collective-permute"):
      assert all(n < limit for n in ops.get(op, [])), (step, op, ops)


def test_combined_all_reduces_count_once_per_array(report):
  """Two independent row-split products on model:8: XLA's CPU pipeline
  combines their all-reduces into one op with a tuple result, and
  mesh_worker.collectives counts both (the regex before it counted none;
  tests/parallel/test_mesh_paths.py has the HLO forms one by one)."""
  assert report["hlo"]["combined"] == {"all-reduce": [4 * 32, 4 * 32]}


def test_int8_speculative_tokens_on_a_mesh_equal_one_devices(report):
  """int8 target and draft, greedy speculative, on data:2,model:4 (the
  target's int8 kernels and scales split 4 ways, the draft replicated): the
  single-device int8 tokens, which are not the float ones (int8 really ran).
  Checked by hand: the int8 kernels' PARAM_SPECS rules set to P() fail the
  shares here; a mesh load that fell back to float fails the last check."""
  ref, got = report["meshes"]["None"]["int8"], report["meshes"]["data:2,model:4"]["int8"]
  assert got["spec"] == ref["spec"]
  assert got["dtypes"] == ref["dtypes"] == ["int8", "int8"]
  assert set(ref["share"].values()) == {1.0}
  assert got["share"] == {k: pytest.approx(1 / 4) for k in got["share"]}
  assert got["spec"] != report["meshes"]["None"]["spec4"]


def test_auto_draft_is_split_when_it_divides_and_replicated_otherwise(report):
  assert report["auto"] == {"draft_tp": 1 / 8, "tiny_draft": 1.0}


def test_memory_plan_from_shapes_matches_the_arrays(report):
  plan = report["plan"]
  real, split, rep = plan["real"], plan["model"], plan["replicated"]
  # counted from shardings alone = what device 0 really holds
  assert split["target_weight_bytes"] == real["target_weight_bytes"]
  assert split["target_cache_bytes"] == real["target_cache_bytes"]
  assert split["draft_weight_bytes"] == real["draft_weight_bytes_model"]
  # a replicated draft costs ~8x its split on every device (norms aside)
  assert 7.5 < rep["draft_weight_bytes"] / split["draft_weight_bytes"] <= 8
  assert rep["draft_cache_bytes"] > 7 * split["draft_cache_bytes"]
  # what XLA says the compiled programs take per device: the same bytes,
  # plus the few small arguments (tokens, lengths, key)
  for p in (split, rep):
    assert 0 <= p["spec_loop_argument_bytes"] - p["weights_and_caches_bytes"] < 4096
    assert 0 <= p["decode_argument_bytes"] - p["target_weight_bytes"] - p["target_cache_bytes"] < 64


def test_checkpoint_reads_only_each_devices_slice(report):
  # q_proj [H*D, E] = [128, 128] split on its rows (specjax's columns) over 8
  assert report["slices"] and all(s == [16, 128] for s in report["slices"]), report["slices"]


def test_orbax_restores_sharded_on_another_mesh(report):
  assert report["orbax"]["equal"]
  assert report["orbax"]["fraction"] == pytest.approx(1 / 4)


def test_bad_meshes_are_one_clear_line(report):
  err = report["errors"]
  assert "needs 16 devices" in err["too_big"] and "8 are available" in err["too_big"]
  assert "rows:2" in err["bad_axis"]
  assert "must be positive" in err["zero"]
  assert "only one axis" in err["two_wild"]
  assert "n_heads=2" in err["indivisible"] and "n_kv_heads=1" in err["indivisible"]
  assert all("\n" not in e for e in err.values())


def test_parse_mesh():
  assert sharding.parse_mesh("model:-1", 8) == sharding.MeshShape(1, 8)
  assert sharding.parse_mesh("data:2,model:-1", 8) == sharding.MeshShape(2, 4)
  assert sharding.parse_mesh("data:4", 8) == sharding.MeshShape(4, 1)
  with pytest.raises(ConfigError, match="do not split evenly"):
    sharding.parse_mesh("data:3,model:-1", 8)
  with pytest.raises(ConfigError, match="integer"):
    sharding.parse_mesh("model:x", 8)


def test_partition_table_covers_every_param():
  import jax  # pylint: disable=import-outside-toplevel
  for cfg in (get_preset("tiny"), get_preset("tiny").__class__(
      **{**get_preset("tiny").__dict__, "tie_embeddings": True})):
    shapes = jax.eval_shape(lambda c=cfg: model.init_params(c))
    flat = jax.tree_util.tree_flatten_with_path(shapes)[0]
    for path, x in flat:
      spec = sharding.param_spec(sharding.path_str(path))
      assert len(spec) in (0, x.ndim), (path, spec)


def test_script_rejects_bad_mesh_in_one_line():
  proc = subprocess.run([sys.executable, os.path.join(ROOT, "experiments", "generate.py"),
                         "--model=tiny", "--mesh=data:2,model:8", "--n_predict=2"],
                        env=_env(8), capture_output=True, text=True, timeout=120)
  assert proc.returncode == 1
  lines = proc.stderr.strip().splitlines()
  assert len(lines) == 1 and "needs 16 devices" in lines[0], proc.stderr


def test_two_processes_give_one_process_tokens(report, ckpts, tmp_path):
  """2 processes x 4 devices (jax.distributed, gloo) == 1 process x 8 devices."""
  out = tmp_path / "two.json"
  cmd = [sys.executable, "-m", "specjax.parallel.launch", "--num_processes=2",
         "--devices_per_process=4", "--timeout=240", "--",
         os.path.join(ROOT, "experiments", "speculative.py"),
         f"--model={ckpts / 'target'}", "--model_draft=tiny-draft", "--seed=3",
         "--prompt_tokens=1,5,7,9", "--n_predict=12", "--draft=4", "--temp=1", "--top_k=20",
         "--reps=1", "--nobaseline", "--mesh=data:1,model:8", f"--json_out={out}"]
  env = _env(4)
  proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
  assert proc.returncode == 0, proc.stderr[-3000:]
  got = json.loads(out.read_text())
  assert got["env"]["n_processes"] == 2 and got["env"]["mesh"] == "data:1,model:8"
  assert got["tokens"] == report["meshes"]["data:1,model:8"]["script"]


# ------------------------------------------------------- padded vocabularies


@pytest.fixture(scope="module")
def hf_greedy(ckpts):
  """transformers' LlamaForCausalLM greedy tokens (float32, no cache: the
  whole sequence each step) for mesh_worker.PAD_PROMPTS, by vocabulary."""
  import torch  # pylint: disable=import-outside-toplevel
  out = {}
  for v in mesh_worker.PAD_VOCABS:
    m = hf.to_torch_model(*hf.load_hf(ckpts / f"pad{v}"))
    rows = []
    for prompt in mesh_worker.PAD_PROMPTS:
      ids = list(prompt)
      with torch.no_grad():
        for _ in range(mesh_worker.PAD_N):
          ids.append(int(torch.argmax(m(torch.tensor([ids])).logits[0, -1])))
      rows.append(ids[len(prompt):])
    out[v] = rows
  return out


def test_padded_vocabulary_gives_transformers_greedy_tokens(report, hf_greedy):
  runs = report["pad"]["runs"]
  want = {f"{v}/{spec}" for part in mesh_worker.PAD_MESHES.values()
          for spec, vocabs in part.items() for v in vocabs}
  assert set(runs) == want  # every vocabulary run, and model:4 and 8 each padded
  assert {k.split("/")[0] for k in runs} == set(map(str, mesh_worker.PAD_VOCABS))
  assert {k.split("/")[1] for k in runs} == {f"data:1,model:{m}" for m in (4, 8)}
  for key, run in runs.items():
    v, m = int(key.split("/")[0]), int(key.split(":")[-1])
    padded = -(-v // m) * m
    assert run["padded"] == [padded, padded], (v, m)  # the draft padded like the target
    assert run["embed_fraction"] == pytest.approx(1 / m)
    assert run["greedy"] == hf_greedy[v], (v, m)
    assert run["spec"] == hf_greedy[v], (v, m)


def test_padded_vocabulary_int8_gives_the_single_device_tokens(report):
  run, ref = report["pad"]["runs"]["259/data:1,model:8"]["int8"], report["pad"]["int8_reference"]
  assert run == ref
  assert ref["spec"] == ref["greedy"]


def test_padded_ids_are_never_drawn(report, hf_greedy):
  """Padded LM head columns far above every real one (loud_padding) change
  no token: greedy and sampled, target-only and speculative, every id < V,
  and the sampling distribution has all its mass on the real ids."""
  v, got = mesh_worker.PAD_VOCABS[0], report["pad"]["mask"]
  assert got["greedy"] == got["spec"] == hf_greedy[v]
  for what in ("sampled", "spec_sampled"):
    assert all(0 <= t < v for row in got[what] for t in row), (what, got[what])
  assert_masked(got["mass"], v)


def assert_masked(first: dict, v: int) -> None:
  """The first step's distributions put all their mass on the real ids."""
  assert first["real"] == pytest.approx([1.0, 1.0], abs=1e-6), first
  assert first["padded"] == [0.0, 0.0], first
  assert all(0 <= t < v for t in first["argmax"]), first


def test_padded_ids_win_without_the_mask(report):
  """The deliberate bug (llama.mask_padded_logits a no-op) fails the check
  above: the loud padded columns take the mass and the argmax."""
  v, got = mesh_worker.PAD_VOCABS[0], report["pad"]["mask"]["no_mask"]
  with pytest.raises(AssertionError):
    assert_masked(got, v)
  assert all(t >= v for t in got["argmax"]), got


def test_saves_strip_the_padding(report):
  """Saved from model:8 (264 rows): 259 in the HF, orbax and GGUF files;
  loaded back on model:4 as 260 rows, the real ones equal, the rest zeros."""
  got, v, e = report["pad"]["saves"], 259, 64
  assert got["hf_shapes"] == {name: [v, e] for name in hf.VOCAB_TENSORS}
  assert sorted(map(sorted, got["gguf_shapes"].values())) == [[e, v], [e, v]]
  assert got["orbax_config"]["vocab_size"] == v and got["orbax_config"]["vocab_multiple"] == 1
  assert got["gguf_equal"]
  for name in ("hf", "orbax"):
    assert got[name] == {"padded": 260, "shape": [260, e], "equal": True, "zeros": True}, name
  assert got["pad9"] == {"shape": [16, e], "equal": True}  # 3 of 8 devices: padding only
