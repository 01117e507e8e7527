"""HuggingFace LLaMA checkpoints <-> specjax params.

An HF directory holds `config.json` and `model.safetensors` (or shards listed
in `model.safetensors.index.json`). Loading needs only numpy and safetensors;
torch is imported lazily, by `to_torch_model` / `from_torch_model` alone.

One conversion pair, `params_to_hf_state` / `hf_state_to_params`, maps HF
tensor names in torch layout ([out, in] Linear weights) to the linen `params`
tree ([in, out] kernels); loading, saving and the torch comparison all use it,
so a mapping bug cannot hide in one path only. RoPE uses HF's rotate_half
convention, so q/k weights need no permutation.
"""

from __future__ import annotations

import json
import os
import re
import shutil
from collections.abc import Mapping
from pathlib import Path
from typing import Any, NamedTuple

import jax
import numpy as np
from absl import logging

from specjax.model import llama as model_lib
from specjax.model import sharding
from specjax.model.config import INT8, ModelConfig, RopeScaling, canonical_dtype
from specjax.errors import CheckpointError, ConfigError
from specjax.formats import convert
from specjax.formats.safetensors_io import SafetensorsState, write_safetensors

CONFIG_FILE = "config.json"
WEIGHTS_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"

_REQUIRED = ("vocab_size", "hidden_size", "num_hidden_layers",
             "num_attention_heads", "intermediate_size")
# Tensors some checkpoints carry that hold nothing the model needs.
_HARMLESS = re.compile(r"(^|\.)rotary_emb\.inv_freq$")
# The tensors whose rows (torch layout) are the vocabulary: padded to
# cfg.padded_vocab on load, the padding stripped on save (llama.strip_vocab).
VOCAB_TENSORS = ("model.embed_tokens.weight", "lm_head.weight")

# ---------------------------------------------------------------- config


def _first(x):
  """HF allows a list of ids (several eos tokens); specjax keeps the first."""
  if isinstance(x, (list, tuple)):
    return int(x[0]) if x else None
  return None if x is None else int(x)


def _rope_from_hf(d: dict, source: str) -> tuple[float, RopeScaling | None]:
  """(rope_theta, scaling) from transformers 4 (`rope_theta`, `rope_scaling`)
  or transformers 5 (`rope_parameters`) fields."""
  params = d.get("rope_parameters") or {}
  legacy = d.get("rope_scaling") or {}
  theta = float(params.get("rope_theta", d.get("rope_theta", 10000.0)))
  scaling = params if ("rope_type" in params or "type" in params) else legacy
  kind = scaling.get("rope_type", scaling.get("type", "default"))
  if kind == "default":
    return theta, None
  if kind != "llama3":
    raise ConfigError(f"{source}: rope scaling type {kind!r} is not supported "
                      f"(only 'default' and 'llama3')")
  keys = ("factor", "low_freq_factor", "high_freq_factor",
          "original_max_position_embeddings")
  missing = [k for k in keys if k not in scaling]
  if missing:
    raise ConfigError(f"{source}: llama3 rope scaling lacks {', '.join(missing)}")
  return theta, RopeScaling(
      factor=float(scaling["factor"]),
      low_freq_factor=float(scaling["low_freq_factor"]),
      high_freq_factor=float(scaling["high_freq_factor"]),
      original_max_position=int(scaling["original_max_position_embeddings"]))


def _check_architecture(d: dict, source: str) -> None:
  """Rejects LLaMA variants whose weights would load but compute differently."""
  if d.get("hidden_act", "silu") != "silu":
    raise ConfigError(f"{source}: hidden_act {d['hidden_act']!r} is not "
                      f"supported (only 'silu')")
  for field in ("attention_bias", "mlp_bias"):
    if d.get(field):
      raise ConfigError(f"{source}: {field}=true is not supported")


def config_from_hf(d: dict[str, Any], name: str = "hf",
                   source: str = CONFIG_FILE) -> ModelConfig:
  """Maps an HF LlamaConfig dict (transformers 4 or 5) to a ModelConfig.

  Args:
    d: the parsed config.json.
    name: the ModelConfig name.
    source: the file the dict came from, named in error messages.
  Raises:
    ConfigError: a required field is missing or a feature is unsupported.
  """
  missing = [k for k in _REQUIRED if d.get(k) is None]
  if missing:
    raise ConfigError(f"{source}: missing required field(s) {', '.join(missing)}")
  _check_architecture(d, source)
  theta, scaling = _rope_from_hf(d, source)
  heads, dim = int(d["num_attention_heads"]), int(d["hidden_size"])
  head_dim = d.get("head_dim")
  dtype = canonical_dtype(d.get("dtype") or d.get("torch_dtype") or "float32")
  return ModelConfig(
      name=name, vocab_size=int(d["vocab_size"]), dim=dim,
      n_layers=int(d["num_hidden_layers"]), n_heads=heads,
      n_kv_heads=int(d.get("num_key_value_heads") or heads),
      ffn_dim=int(d["intermediate_size"]),
      norm_eps=float(d.get("rms_norm_eps", 1e-6)),
      rope_theta=theta, rope_scaling=scaling,
      max_seq_len=int(d.get("max_position_embeddings", 2048)),
      tie_embeddings=bool(d.get("tie_word_embeddings", False)),
      # Keep None when implied, so loaded configs compare equal to presets.
      head_dim=None if head_dim in (None, dim // heads) else int(head_dim),
      dtype=dtype, param_dtype=dtype,
      bos_token_id=_first(d.get("bos_token_id")),
      eos_token_id=_first(d.get("eos_token_id")))


def config_to_hf(cfg: ModelConfig) -> dict[str, Any]:
  """The HF config.json dict for `cfg`.

  RoPE goes in the transformers-4 fields (`rope_theta`, `rope_scaling`),
  which transformers 5 also reads.
  """
  rs = cfg.rope_scaling
  return {
      "architectures": ["LlamaForCausalLM"], "model_type": "llama",
      "vocab_size": cfg.vocab_size, "hidden_size": cfg.dim,
      "num_hidden_layers": cfg.n_layers, "num_attention_heads": cfg.n_heads,
      "num_key_value_heads": cfg.n_kv_heads, "intermediate_size": cfg.ffn_dim,
      "head_dim": cfg.d_head, "hidden_act": "silu", "rms_norm_eps": cfg.norm_eps,
      "rope_theta": cfg.rope_theta,
      "rope_scaling": None if rs is None else {
          "rope_type": "llama3", "factor": rs.factor,
          "low_freq_factor": rs.low_freq_factor,
          "high_freq_factor": rs.high_freq_factor,
          "original_max_position_embeddings": rs.original_max_position},
      "max_position_embeddings": cfg.max_seq_len,
      "tie_word_embeddings": cfg.tie_embeddings,
      "attention_bias": False, "mlp_bias": False,
      "bos_token_id": cfg.bos_token_id, "eos_token_id": cfg.eos_token_id,
      "torch_dtype": cfg.param_dtype,
  }

# ---------------------------------------------------------------- tensor map


class _Tensor(NamedTuple):
  hf_name: str
  path: tuple[str, ...]    # into the params tree
  transpose: bool          # torch Linear [out, in] vs linen kernel [in, out]
  hf_shape: tuple[int, ...]


def tensor_map(cfg: ModelConfig) -> list[_Tensor]:
  """Every weight of `cfg`: HF name, params path, layout and HF shape."""
  e, v, f = cfg.dim, cfg.vocab_size, cfg.ffn_dim
  hd, kd = cfg.n_heads * cfg.d_head, cfg.n_kv_heads * cfg.d_head
  out = [_Tensor("model.embed_tokens.weight", ("embed", "embedding"), False, (v, e))]
  for i in range(cfg.n_layers):
    hf, sj = f"model.layers.{i}.", f"layers_{i}"
    out += [
        _Tensor(hf + "input_layernorm.weight", (sj, "attn_norm", "scale"), False, (e,)),
        _Tensor(hf + "self_attn.q_proj.weight", (sj, "attn", "wq", "kernel"), True, (hd, e)),
        _Tensor(hf + "self_attn.k_proj.weight", (sj, "attn", "wk", "kernel"), True, (kd, e)),
        _Tensor(hf + "self_attn.v_proj.weight", (sj, "attn", "wv", "kernel"), True, (kd, e)),
        _Tensor(hf + "self_attn.o_proj.weight", (sj, "attn", "wo", "kernel"), True, (e, hd)),
        _Tensor(hf + "post_attention_layernorm.weight", (sj, "mlp_norm", "scale"), False, (e,)),
        _Tensor(hf + "mlp.gate_proj.weight", (sj, "mlp", "w_gate", "kernel"), True, (f, e)),
        _Tensor(hf + "mlp.up_proj.weight", (sj, "mlp", "w_up", "kernel"), True, (f, e)),
        _Tensor(hf + "mlp.down_proj.weight", (sj, "mlp", "w_down", "kernel"), True, (e, f)),
    ]
  out.append(_Tensor("model.norm.weight", ("final_norm", "scale"), False, (e,)))
  if not cfg.tie_embeddings:
    out.append(_Tensor("lm_head.weight", ("lm_head", "kernel"), True, (v, e)))
  return out


def names_list(names: list[str], limit: int = 3) -> str:
  shown = ", ".join(names[:limit])
  return shown + (f" (and {len(names) - limit} more)" if len(names) > limit else "")


def _check_names(cfg: ModelConfig, expected: list[str], state: Mapping,
                 source: str):
  """Raises CheckpointError for missing or unexpected tensors."""
  names = set(state)  # not `n in state`: a Mapping's __contains__ reads the tensor
  missing = [n for n in expected if n not in names]
  if missing:
    raise CheckpointError(f"{source}: missing tensor {names_list(missing)}")
  harmless = lambda n: (_HARMLESS.search(n) is not None
                        or (cfg.tie_embeddings and n == "lm_head.weight"))
  extra = sorted(n for n in names - set(expected) if not harmless(n))
  if extra:
    raise CheckpointError(f"{source}: unexpected tensor {names_list(extra)}; "
                          f"not a LLaMA checkpoint matching its config")


def params_to_hf_state(cfg: ModelConfig, params) -> dict[str, np.ndarray]:
  """Params -> {HF name: numpy array in torch layout}, in the params' dtype.

  With tied embeddings there is no `lm_head.weight` (as in HF's own files).
  A padded vocabulary (ModelConfig.padded_vocab) is cut back to vocab_size.

  Raises:
    ConfigError: quantized (int8) params, which have no HF layout.
  """
  if cfg.quant:
    raise ConfigError(f"{cfg.name}: {cfg.quant} params have no HF / GGUF / torch "
                      f"layout; convert or compare the float model")
  cfg, params = model_lib.strip_vocab(cfg, params)
  state = {}
  for t in tensor_map(cfg):
    node = params
    for key in t.path:
      node = node[key]
    arr = np.asarray(node)
    state[t.hf_name] = np.ascontiguousarray(arr.T if t.transpose else arr)
  return state


def hf_state_to_params(cfg: ModelConfig, state: Mapping[str, Any],
                       source: str = "HF state", shardings=None):
  """{HF name: array} -> the `params` tree of `Llama(cfg)`, in cfg.param_dtype;
  with cfg.quant int8, every projection kernel quantized per channel.

  Built leaf by leaf (formats/convert.py): each tensor read a block of rows
  at a time into the target dtype (int8: quantized as read), put on device
  and its host copy dropped before the next; the float32 model is never held.
  The state holds cfg.vocab_size rows of the vocabulary tensors; with a
  padded vocabulary (ModelConfig.padded_vocab) the params get zero rows
  past them.

  Args:
    cfg: the model config the tensors must match.
    state: numpy (or numpy-convertible) arrays in torch layout, or a lazy
      Mapping with `shape`, `read_block` (and `release`) like SafetensorsState.
    source: named in error messages (a file or directory).
    shardings: a params tree of NamedShardings (sharding.role_shardings).
      Then each device's block is read on its own (`state.read_block` when
      the state has it, e.g. SafetensorsState: only that slice is read from
      the file), and no process holds more than its own shards.
  Raises:
    CheckpointError: a tensor is missing, unexpected or of the wrong shape.
  """
  tensors = tensor_map(cfg)
  _check_names(cfg, [t.hf_name for t in tensors], state, source)
  dtype = np.dtype(cfg.jnp_param_dtype)
  params: dict[str, Any] = {}
  for t in tensors:
    shape = (state.shape(t.hf_name) if hasattr(state, "shape")
             else tuple(np.shape(state[t.hf_name])))
    if tuple(shape) != t.hf_shape:
      raise CheckpointError(f"{source}: tensor {t.hf_name} has shape "
                            f"{tuple(shape)}, expected {t.hf_shape}")
    node, sh = params, shardings
    for key in t.path[:-1]:
      node = node.setdefault(key, {})
      sh = None if sh is None else sh[key]
    pad = cfg.padded_vocab - cfg.vocab_size if t.hf_name in VOCAB_TENSORS else 0
    # Every transposed tensor is a projection kernel: the ones int8 quantizes.
    quantize = cfg.quant == INT8 and t.transpose
    node.update(convert.tensor_leaves(state, t, pad, dtype, quantize, sh))
  return params

# ---------------------------------------------------------------- directories


def _weight_files(path: Path) -> list[Path]:
  """The safetensors file(s) of an HF directory, single or sharded."""
  if (path / WEIGHTS_FILE).is_file():
    return [path / WEIGHTS_FILE]
  index = path / INDEX_FILE
  if index.is_file():
    try:
      weight_map = json.loads(index.read_text())["weight_map"]
    except (ValueError, KeyError, TypeError) as e:
      raise CheckpointError(f"corrupt index {index}: {e!r}") from e
    return [path / f for f in sorted(set(weight_map.values()))]
  hint = (" (found PyTorch .bin weights; re-save them with "
          "save_pretrained(safe_serialization=True))"
          if list(path.glob("*.bin")) else "")
  raise CheckpointError(f"missing weights file: {path} has neither "
                        f"{WEIGHTS_FILE} nor {INDEX_FILE}{hint}")


def read_hf_config(path: str | os.PathLike, dtype: str | None = None) -> ModelConfig:
  """The ModelConfig of an HF directory (config.json only, no weights)."""
  path = Path(path)
  if not path.is_dir():
    raise CheckpointError(f"HF checkpoint directory {path} does not exist")
  file = path / CONFIG_FILE
  if not file.is_file():
    raise CheckpointError(f"missing {CONFIG_FILE} in {path}")
  try:
    d = json.loads(file.read_text())
    if not isinstance(d, dict):
      raise ConfigError(f"{file}: not a JSON object")
    cfg = config_from_hf(d, name=path.name, source=str(file))
  except ValueError as e:  # ConfigError, or JSONDecodeError
    msg = str(e) if str(e).startswith(str(file)) else f"{file}: {e}"
    raise CheckpointError(msg) from e
  return cfg.with_dtype(dtype) if dtype else cfg


def load_hf(path: str | os.PathLike, dtype: str | None = None, role: str = "target"):
  """Loads an HF LLaMA directory without torch.

  Args:
    path: directory with config.json and model.safetensors (or shards).
    dtype: compute and param dtype; default (logged): the checkpoint's
      torch_dtype; 'int8' quantizes each projection as it is read (quant.py).
    role: 'target' or 'draft': the placement on the active mesh
      (sharding.role_shardings); each process reads only its devices' slices.
  Returns:
    (cfg, params) with params in cfg.param_dtype; on a mesh whose model
    axis does not divide the vocabulary, padded (sharding.pad_vocab).
  Raises:
    CheckpointError: one line naming what is missing, mis-shaped or corrupt.
  """
  path = Path(path)
  cfg = sharding.pad_vocab(read_hf_config(path, dtype))
  if not dtype:
    logging.info("%s: %s weights (torch_dtype) -> %s (pass --dtype to choose)",
                 path, cfg.param_dtype, cfg.precision)
  state = SafetensorsState(_weight_files(path))
  shardings = None
  if sharding.current() is not None:
    shapes = jax.eval_shape(lambda: model_lib.init_params(cfg))
    shardings = sharding.role_shardings(cfg, shapes, role)
  return cfg, hf_state_to_params(cfg, state, source=str(path), shardings=shardings)


def save_hf(path: str | os.PathLike, cfg: ModelConfig, params,
            tokenizer_json: str | os.PathLike | None = None) -> Path:
  """Writes an HF directory (config.json + model.safetensors) without torch.

  Args:
    tokenizer_json: a tokenizer.json file to copy alongside, if any.
  Returns:
    the directory.
  """
  path = Path(path)
  path.mkdir(parents=True, exist_ok=True)
  (path / CONFIG_FILE).write_text(json.dumps(config_to_hf(cfg), indent=2) + "\n")
  write_safetensors(path / WEIGHTS_FILE, params_to_hf_state(cfg, params))
  if tokenizer_json is not None:
    shutil.copyfile(tokenizer_json, path / "tokenizer.json")
  return path

# ---------------------------------------------------------------- torch


def _torch_dtype(name: str):
  import torch  # pylint: disable=import-outside-toplevel
  return {"float32": torch.float32, "bfloat16": torch.bfloat16,
          "float16": torch.float16}[canonical_dtype(name)]


def to_torch_model(cfg: ModelConfig, params):
  """A transformers LlamaForCausalLM (eager attention, eval mode) holding
  `params`, in the torch dtype of cfg.param_dtype. Imports torch lazily."""
  import torch  # pylint: disable=import-outside-toplevel
  import transformers  # pylint: disable=import-outside-toplevel
  hf_cfg = transformers.LlamaConfig(**config_to_hf(cfg))
  hf_cfg._attn_implementation = "eager"
  dtype = _torch_dtype(cfg.param_dtype)
  # Built under the target default dtype, as from_pretrained does, so RoPE's
  # inv_freq buffer stays f32 (model.to(bf16) would round it).
  old = torch.get_default_dtype()
  torch.set_default_dtype(dtype)
  try:
    model = transformers.LlamaForCausalLM(hf_cfg)
  finally:
    torch.set_default_dtype(old)
  state = params_to_hf_state(cfg, params)
  if cfg.tie_embeddings:
    state["lm_head.weight"] = state["model.embed_tokens.weight"]
  tensors = {k: torch.from_numpy(np.array(v, np.float32)).to(dtype)
             for k, v in state.items()}
  model.load_state_dict(tensors, strict=True)
  return model.eval()


def from_torch_model(model) -> tuple[ModelConfig, Any]:
  """(cfg, params) of a transformers LlamaForCausalLM, in its weights' dtype."""
  import torch  # pylint: disable=import-outside-toplevel
  dtype = str(next(model.parameters()).dtype).removeprefix("torch.")
  cfg = config_from_hf(model.config.to_dict(), name="torch").with_dtype(dtype)
  np_dtype = np.dtype(cfg.jnp_param_dtype)
  state = {k: v.detach().to(torch.float32).cpu().numpy().astype(np_dtype)
           for k, v in model.state_dict().items()}
  return cfg, hf_state_to_params(cfg, state, source="torch model")
