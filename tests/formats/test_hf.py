"""HF checkpoints: config mapping, parity with transformers, and bad inputs.

Parity tests build tiny random LlamaForCausalLM models in the test (nothing is
downloaded), save them with `save_pretrained`, load them with `load_hf` and
compare logits over whole sequences. Tests that need torch take the
`transformers` fixture and are skipped without it; the rest run on numpy.
"""

from __future__ import annotations

import json

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from specjax.formats import safetensors_io
from specjax.formats import hf
from specjax.model import kv_cache
from specjax.model import llama as model_lib
from specjax.model.config import RopeScaling, get_preset, preset_names
from specjax.errors import CheckpointError, ConfigError

B, T = 2, 96  # T > original_max_position_embeddings=32: llama3 scaling matters
TOL = 1e-4    # max abs logit difference, f32
LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
          "high_freq_factor": 4.0, "original_max_position_embeddings": 32}
BASE = dict(vocab_size=256, hidden_size=64, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, intermediate_size=128,
            max_position_embeddings=128, rms_norm_eps=1e-5)
CASES = {
    "mha": dict(num_key_value_heads=4),
    "gqa-kv2": dict(num_key_value_heads=2),
    "gqa-kv1": dict(num_key_value_heads=1),
    "theta-1e6": dict(rope_theta=1e6),
    "llama3-scaling": dict(rope_scaling=LLAMA3, rope_theta=10000.0),
    "tied": dict(tie_word_embeddings=True),
    "head-dim-32": dict(head_dim=32),
}


def make_hf_model(transformers, seed=0, **overrides):
  """A tiny random LlamaForCausalLM with non-trivial weights: norm scales
  around 1 but not 1, weights with std 0.1 so logits spread by O(1)."""
  import torch  # pylint: disable=import-outside-toplevel
  torch.manual_seed(seed)
  config = transformers.LlamaConfig(**{**BASE, **overrides},
                                    attn_implementation="eager")
  model = transformers.LlamaForCausalLM(config).eval()
  with torch.no_grad():
    for name, p in model.named_parameters():
      if name.endswith("norm.weight"):
        p.copy_(1.0 + 0.5 * torch.randn_like(p))
      else:
        p.normal_(0.0, 0.1)
  return model


def tokens(seed=0, batch=B, length=T):
  return np.random.RandomState(seed).randint(0, BASE["vocab_size"], (batch, length))


def torch_logits(model, toks) -> np.ndarray:
  import torch  # pylint: disable=import-outside-toplevel
  with torch.no_grad():
    return model(torch.tensor(toks)).logits.float().numpy()


_forward = jax.jit(model_lib.forward, static_argnames="cfg")


def specjax_logits(cfg, params, toks) -> np.ndarray:
  """Logits of a whole sequence through a fresh cache."""
  cache = kv_cache.init_cache(cfg, toks.shape[0], toks.shape[1])
  logits, _ = _forward(params, jnp.asarray(toks), cache, cfg)
  return np.asarray(logits)


def max_diff(a, b) -> float:
  return float(np.max(np.abs(np.asarray(a, np.float32) - np.asarray(b, np.float32))))


def tree_equal(a, b) -> bool:
  eq = lambda x, y: x.dtype == y.dtype and np.array_equal(np.asarray(x), np.asarray(y))
  return (jax.tree_util.tree_structure(a) == jax.tree_util.tree_structure(b)
          and all(jax.tree_util.tree_leaves(jax.tree_util.tree_map(eq, a, b))))


@pytest.fixture
def hf_dir(tmp_path, init_params):
  """A valid HF directory written without torch (tiny preset, f32)."""
  cfg = get_preset("tiny")
  hf.save_hf(tmp_path / "hf", cfg, init_params(cfg, 0))
  return tmp_path / "hf"

# ------------------------------------------------------------ config mapping


@pytest.mark.parametrize("name", preset_names())
def test_config_round_trip(name):
  cfg = get_preset(name)
  # attn_block is how specjax runs attention, not part of a checkpoint: HF
  # configs come back with the default.
  assert hf.config_from_hf(hf.config_to_hf(cfg), name=name) == cfg.replace(attn_block=256)


def test_config_from_transformers5_fields():
  d = {**BASE, "rope_parameters": {**LLAMA3, "rope_theta": 5e5},
       "eos_token_id": [128001, 128009], "bos_token_id": 128000,
       "dtype": "bfloat16", "tie_word_embeddings": True}
  cfg = hf.config_from_hf(d)
  assert cfg.rope_theta == 5e5
  assert cfg.rope_scaling == RopeScaling(8.0, 1.0, 4.0, 32)
  assert (cfg.eos_token_id, cfg.bos_token_id) == (128001, 128000)
  assert (cfg.dtype, cfg.param_dtype) == ("bfloat16", "bfloat16")
  assert cfg.tie_embeddings and cfg.n_kv_heads == 2


def test_config_defaults_kv_heads_to_heads():
  d = {k: v for k, v in BASE.items() if k != "num_key_value_heads"}
  assert hf.config_from_hf(d).n_kv_heads == BASE["num_attention_heads"]


def test_config_rejects_other_rope_scaling():
  d = {**BASE, "rope_scaling": {"type": "linear", "factor": 2.0}}
  with pytest.raises(ConfigError, match="'linear' is not supported"):
    hf.config_from_hf(d, source="x/config.json")


def test_config_missing_fields_named():
  d = {k: v for k, v in BASE.items() if k not in ("hidden_size", "vocab_size")}
  with pytest.raises(ConfigError, match=r"x/config.json.*vocab_size, hidden_size"):
    hf.config_from_hf(d, source="x/config.json")

# ------------------------------------------------------------ conversion


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_state_round_trip_exact(dtype, init_params):
  cfg = get_preset("tiny", dtype)
  params = init_params(cfg, 0)
  state = hf.params_to_hf_state(cfg, params)
  assert state["model.layers.0.self_attn.k_proj.weight"].shape == (
      cfg.n_kv_heads * cfg.d_head, cfg.dim)
  assert tree_equal(hf.hf_state_to_params(cfg, state), params)


def untied(params):
  """Params of a tied-embeddings config made from untied ones (saves a compile)."""
  return {k: v for k, v in params.items() if k != "lm_head"}


def test_tied_state_has_no_lm_head(init_params):
  cfg = get_preset("tiny").replace(tie_embeddings=True)
  state = hf.params_to_hf_state(cfg, untied(init_params(get_preset("tiny"))))
  assert "lm_head.weight" not in state
  assert tree_equal(hf.hf_state_to_params(cfg, state),
                    untied(init_params(get_preset("tiny"))))


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_save_hf_load_hf_exact(tmp_path, dtype, init_params):
  cfg = get_preset("tiny", dtype)
  params = init_params(cfg, 0)
  hf.save_hf(tmp_path, cfg, params)
  cfg2, params2 = hf.load_hf(tmp_path)
  assert cfg2 == cfg.replace(name=tmp_path.name, attn_block=cfg2.attn_block)
  assert tree_equal(params2, params)


def test_raw_safetensors_fallback_bf16(tmp_path):
  """The hand-written reader/writer (used when safetensors' numpy backend
  lacks bf16) agrees with the safetensors library both ways."""
  from safetensors.numpy import load_file  # pylint: disable=import-outside-toplevel
  x = {"a": np.arange(12, dtype=np.float32).reshape(3, 4).astype(ml_dtypes.bfloat16),
       "b": np.linspace(-1, 1, 5, dtype=np.float32)}
  # pylint: disable=protected-access
  safetensors_io.write_raw(tmp_path / "raw.safetensors", x, {"format": "pt"})
  safetensors_io.write_safetensors(tmp_path / "lib.safetensors", x)
  for got in (load_file(str(tmp_path / "raw.safetensors")),
              safetensors_io.read_raw(tmp_path / "lib.safetensors")):
    assert tree_equal(got, x)

def test_load_hf_through_raw_fallback(tmp_path, init_params, monkeypatch):
  """bf16 checkpoints load even where safetensors' numpy backend fails."""
  import safetensors  # pylint: disable=import-outside-toplevel
  cfg = get_preset("tiny", "bf16")
  params = init_params(cfg, 0)
  hf.save_hf(tmp_path, cfg, params)
  def broken(*args, **kwargs):
    raise TypeError("data type 'bfloat16' not understood")
  monkeypatch.setattr(safetensors, "safe_open", broken)
  assert tree_equal(hf.load_hf(tmp_path)[1], params)

# ------------------------------------------------------------ parity with HF


@pytest.mark.parametrize("case", list(CASES))
def test_logits_match_transformers(transformers, tmp_path, case):
  model = make_hf_model(transformers, **CASES[case])
  model.save_pretrained(tmp_path, safe_serialization=True)
  cfg, params = hf.load_hf(tmp_path)
  toks = tokens()
  ref = torch_logits(model, toks)
  assert ref.std() > 0.3, "weights too small for a meaningful comparison"
  assert max_diff(specjax_logits(cfg, params, toks), ref) <= TOL


@pytest.mark.parametrize("case,drop", [
    ("llama3-scaling", dict(rope_scaling=None)),
    ("theta-1e6", dict(rope_theta=10000.0)),
])
def test_rope_variants_matter(transformers, case, drop):
  """The parity cases above are not vacuous: ignoring the RoPE setting
  changes the logits far beyond the tolerance."""
  cfg, params = hf.from_torch_model(make_hf_model(transformers, **CASES[case]))
  toks = tokens()
  assert max_diff(specjax_logits(cfg, params, toks),
                  specjax_logits(cfg.replace(**drop), params, toks)) > 100 * TOL


def test_sharded_checkpoint_loads(transformers, tmp_path):
  model = make_hf_model(transformers)
  model.save_pretrained(tmp_path / "one")
  model.save_pretrained(tmp_path / "sharded", max_shard_size="50KB")
  assert (tmp_path / "sharded" / hf.INDEX_FILE).is_file()
  assert len(list((tmp_path / "sharded").glob("*.safetensors"))) > 1
  _, one = hf.load_hf(tmp_path / "one")
  _, sharded = hf.load_hf(tmp_path / "sharded")
  assert tree_equal(sharded, one)


@pytest.mark.parametrize("case", ["gqa-kv2", "llama3-scaling", "tied"])
def test_to_torch_model_matches_specjax(transformers, case):
  cfg, params = hf.from_torch_model(make_hf_model(transformers, **CASES[case]))
  toks = tokens(1)
  theirs = torch_logits(hf.to_torch_model(cfg, params), toks)
  assert max_diff(theirs, specjax_logits(cfg, params, toks)) <= TOL


def test_from_torch_model_equals_load_hf(transformers, tmp_path):
  model = make_hf_model(transformers, **CASES["llama3-scaling"])
  model.save_pretrained(tmp_path)
  cfg, params = hf.load_hf(tmp_path)
  cfg2, params2 = hf.from_torch_model(model)
  assert cfg2 == cfg.replace(name="torch", attn_block=cfg2.attn_block)
  assert tree_equal(params2, params)


def test_save_hf_loads_in_transformers(transformers, tmp_path, init_params):
  """save_hf writes a directory transformers itself loads, to the same logits."""
  cfg = get_preset("tiny").replace(rope_scaling=RopeScaling(8.0, 1.0, 4.0, 32),
                                   tie_embeddings=True)
  params = untied(init_params(get_preset("tiny"), 0))
  hf.save_hf(tmp_path, cfg, params)
  model = transformers.LlamaForCausalLM.from_pretrained(
      tmp_path, attn_implementation="eager").eval()
  toks = tokens(2)
  assert max_diff(torch_logits(model, toks), specjax_logits(cfg, params, toks)) <= TOL

# ------------------------------------------------------------ bad inputs


def rewrite_weights(directory, edit):
  """Applies edit(state) to the directory's model.safetensors."""
  file = directory / hf.WEIGHTS_FILE
  state = dict(safetensors_io.read_safetensors(file))
  edit(state)
  safetensors_io.write_safetensors(file, state)


def test_missing_directory(tmp_path):
  with pytest.raises(CheckpointError, match="does not exist"):
    hf.load_hf(tmp_path / "nope")


def test_missing_config(hf_dir):
  (hf_dir / "config.json").unlink()
  with pytest.raises(CheckpointError, match="missing config.json"):
    hf.load_hf(hf_dir)


def test_config_without_hidden_size(hf_dir):
  file = hf_dir / "config.json"
  d = json.loads(file.read_text())
  del d["hidden_size"]
  file.write_text(json.dumps(d))
  with pytest.raises(CheckpointError, match=r"config.json.*hidden_size"):
    hf.load_hf(hf_dir)


def test_missing_weights_file(hf_dir):
  (hf_dir / hf.WEIGHTS_FILE).unlink()
  with pytest.raises(CheckpointError, match="missing weights file"):
    hf.load_hf(hf_dir)


def test_missing_tensor(hf_dir):
  rewrite_weights(hf_dir, lambda s: s.pop("model.layers.1.mlp.up_proj.weight"))
  with pytest.raises(CheckpointError,
                     match=r"missing tensor model\.layers\.1\.mlp\.up_proj\.weight"):
    hf.load_hf(hf_dir)


def test_wrong_shape_tensor(hf_dir):
  def edit(state):
    state["model.layers.0.self_attn.k_proj.weight"] = np.zeros((64, 64), np.float32)
  rewrite_weights(hf_dir, edit)
  with pytest.raises(CheckpointError) as e:
    hf.load_hf(hf_dir)
  assert "model.layers.0.self_attn.k_proj.weight" in str(e.value)
  assert "(64, 64), expected (32, 64)" in str(e.value)


def test_unexpected_tensor(hf_dir):
  def edit(state):
    state["model.layers.0.self_attn.q_proj.bias"] = np.zeros(64, np.float32)
    state["model.layers.0.self_attn.rotary_emb.inv_freq"] = np.zeros(8, np.float32)
  rewrite_weights(hf_dir, edit)
  with pytest.raises(CheckpointError) as e:
    hf.load_hf(hf_dir)
  assert "unexpected tensor model.layers.0.self_attn.q_proj.bias;" in str(e.value)
  assert "inv_freq" not in str(e.value)


def test_harmless_extras_ignored(hf_dir):
  def edit(state):
    state["model.layers.0.self_attn.rotary_emb.inv_freq"] = np.zeros(8, np.float32)
  rewrite_weights(hf_dir, edit)
  hf.load_hf(hf_dir)


def test_missing_shard(hf_dir):
  (hf_dir / hf.WEIGHTS_FILE).rename(hf_dir / "model-00001-of-00002.safetensors")
  index = {"weight_map": {"model.embed_tokens.weight": "model-00001-of-00002.safetensors",
                          "lm_head.weight": "model-00002-of-00002.safetensors"}}
  (hf_dir / hf.INDEX_FILE).write_text(json.dumps(index))
  with pytest.raises(CheckpointError,
                     match=r"missing weights file .*model-00002-of-00002\.safetensors"):
    hf.load_hf(hf_dir)


@pytest.mark.parametrize("damage,reason", [
    ("truncate", "tensor data runs past the end of the file"),
    ("garbage", "header runs past the end of the file"),
    ("empty", "file shorter than the 8-byte header size"),
])
def test_corrupt_safetensors(hf_dir, damage, reason):
  file = hf_dir / hf.WEIGHTS_FILE
  data = file.read_bytes()
  file.write_bytes({"truncate": data[:len(data) // 2],
                    "garbage": b"\x13\x37" * 100, "empty": b""}[damage])
  with pytest.raises(CheckpointError) as e:
    hf.load_hf(hf_dir)
  assert str(e.value) == f"corrupt or unreadable safetensors file {file}: {reason}"


def test_unsupported_rope_in_dir(hf_dir):
  file = hf_dir / "config.json"
  d = json.loads(file.read_text())
  d["rope_scaling"] = {"rope_type": "yarn", "factor": 4.0}
  file.write_text(json.dumps(d))
  with pytest.raises(CheckpointError, match="'yarn' is not supported"):
    hf.load_hf(hf_dir)
