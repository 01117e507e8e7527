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
import jax.numpy as jnp
import ml_dtypes
import numpy as np

from specjax.model import llama as model_lib
from specjax.model import sharding
from specjax.model.config import INT8, ModelConfig, RopeScaling, canonical_dtype, canonical_precision
from specjax.errors import CheckpointError, ConfigError

CONFIG_FILE = "config.json"
WEIGHTS_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"

_REQUIRED = ("vocab_size", "hidden_size", "num_hidden_layers",
             "num_attention_heads", "intermediate_size")
# Tensors some checkpoints carry that hold nothing the model needs.
_HARMLESS = re.compile(r"(^|\.)rotary_emb\.inv_freq$")

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
  missing = [n for n in expected if n not in state]
  if missing:
    raise CheckpointError(f"{source}: missing tensor {names_list(missing)}")
  harmless = lambda n: (_HARMLESS.search(n) is not None
                        or (cfg.tie_embeddings and n == "lm_head.weight"))
  extra = sorted(n for n in set(state) - set(expected) if not harmless(n))
  if extra:
    raise CheckpointError(f"{source}: unexpected tensor {names_list(extra)}; "
                          f"not a LLaMA checkpoint matching its config")


def params_to_hf_state(cfg: ModelConfig, params) -> dict[str, np.ndarray]:
  """Params -> {HF name: numpy array in torch layout}, in the params' dtype.

  With tied embeddings there is no `lm_head.weight` (as in HF's own files).

  Raises:
    ConfigError: quantized (int8) params, which have no HF layout.
  """
  if cfg.quant:
    raise ConfigError(f"{cfg.name}: {cfg.quant} params have no HF / GGUF / torch "
                      f"layout; convert or compare the float model")
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
  """{HF name: array} -> the `params` tree of `Llama(cfg)`, in cfg.param_dtype.

  Args:
    cfg: the model config the tensors must match.
    state: numpy (or numpy-convertible) arrays in torch layout.
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
  params: dict[str, Any] = {}
  for t in tensors:
    shape = (state.shape(t.hf_name) if hasattr(state, "shape")
             else tuple(np.shape(state[t.hf_name])))
    if tuple(shape) != t.hf_shape:
      raise CheckpointError(f"{source}: tensor {t.hf_name} has shape "
                            f"{tuple(shape)}, expected {t.hf_shape}")
    node = params
    for key in t.path[:-1]:
      node = node.setdefault(key, {})
    if shardings is None:
      arr = np.asarray(state[t.hf_name])
      node[t.path[-1]] = jnp.asarray(arr.T if t.transpose else arr,
                                     dtype=cfg.jnp_param_dtype)
      continue
    sh = shardings
    for key in t.path:
      sh = sh[key]
    node[t.path[-1]] = _sharded_tensor(state, t, sh, cfg.jnp_param_dtype)
  return params


def _sharded_tensor(state, t, sharding, dtype):
  """One param as a global array, each device's block read on its own."""
  def read(index):  # index in specjax's layout; the file is in torch's
    hf_index = tuple(reversed(index)) if t.transpose else tuple(index)
    if hasattr(state, "read_block"):
      block = state.read_block(t.hf_name, hf_index)
    else:
      block = np.asarray(state[t.hf_name])[hf_index]
    return block.T if t.transpose else block
  shape = tuple(reversed(t.hf_shape)) if t.transpose else t.hf_shape
  return jax.make_array_from_callback(
      shape, sharding, lambda idx: np.asarray(read(idx)).astype(dtype))

# ---------------------------------------------------------------- safetensors

# safetensors dtype names; BF16 through ml_dtypes, which plain numpy lacks.
_ST_DTYPES = {"F64": np.float64, "F32": np.float32, "F16": np.float16,
              "BF16": ml_dtypes.bfloat16, "I64": np.int64, "I32": np.int32,
              "I16": np.int16, "I8": np.int8, "U8": np.uint8, "BOOL": np.bool_}
_ST_NAMES = {np.dtype(v): k for k, v in _ST_DTYPES.items()}


def _raw_header(file: Path) -> tuple[np.ndarray, int, dict[str, Any]]:
  """(memory-mapped bytes, data offset, header) of a safetensors file, parsed
  by hand: 8-byte little-endian header size, JSON header, then the data."""
  if file.stat().st_size < 8:
    raise ValueError("file shorter than the 8-byte header size")
  data = np.memmap(file, dtype=np.uint8, mode="r")
  n = int.from_bytes(data[:8].tobytes(), "little")
  if 8 + n > data.size:
    raise ValueError("header runs past the end of the file")
  header = json.loads(data[8:8 + n].tobytes())
  header.pop("__metadata__", None)
  if max((i["data_offsets"][1] for i in header.values()), default=0) > data.size - 8 - n:
    raise ValueError("tensor data runs past the end of the file")
  return data, 8 + n, header


def _read_raw(file: Path, names=None) -> dict[str, np.ndarray]:
  """Tensors `names` (default: all) of a safetensors file, parsed by hand: the
  fallback for safetensors versions whose numpy backend cannot do bf16."""
  data, base, header = _raw_header(file)
  out = {}
  for name in header if names is None else names:
    start, end = (base + o for o in header[name]["data_offsets"])
    dt = np.dtype(_ST_DTYPES[header[name]["dtype"]])
    out[name] = np.array(data[start:end].view(dt).reshape(header[name]["shape"]))
  return out


def _write_raw(file: Path, tensors: dict[str, np.ndarray],
               metadata: dict[str, str]) -> None:
  """Writes a safetensors file by hand (the fallback of `write_safetensors`)."""
  header: dict[str, Any] = {"__metadata__": metadata}
  offset = 0
  for name, arr in tensors.items():
    header[name] = {"dtype": _ST_NAMES[arr.dtype], "shape": list(arr.shape),
                    "data_offsets": [offset, offset + arr.nbytes]}
    offset += arr.nbytes
  blob = json.dumps(header, separators=(",", ":")).encode()
  blob += b" " * (-len(blob) % 8)  # the data starts 8-byte aligned
  with open(file, "wb") as fh:
    fh.write(len(blob).to_bytes(8, "little"))
    fh.write(blob)
    for arr in tensors.values():
      fh.write(np.ascontiguousarray(arr).tobytes())


def _corrupt(file: Path, e: Exception) -> CheckpointError:
  """The error for a file neither safetensors nor the hand parser can read;
  the hand parser's reason is the plainer one."""
  msg = (str(e).strip().splitlines() or [repr(e)])[0]
  return CheckpointError(f"corrupt or unreadable safetensors file {file}: {msg}")


def _tensor_names(file: Path) -> list[str]:
  from safetensors import safe_open  # pylint: disable=import-outside-toplevel
  if not file.is_file():
    raise CheckpointError(f"missing weights file {file}")
  try:
    with safe_open(str(file), framework="np") as fh:
      return list(fh.keys())
  except Exception as first:  # pylint: disable=broad-except
    try:
      return list(_raw_header(file)[2])
    except Exception as e:  # pylint: disable=broad-except
      raise _corrupt(file, e) from first


def _read_tensor(file: Path, name: str) -> np.ndarray:
  from safetensors import safe_open  # pylint: disable=import-outside-toplevel
  try:
    with safe_open(str(file), framework="np") as fh:
      return fh.get_tensor(name)
  except Exception as first:  # pylint: disable=broad-except
    try:
      return _read_raw(file, [name])[name]
    except Exception as e:  # pylint: disable=broad-except
      raise _corrupt(file, e) from first


def _tensor_shape(file: Path, name: str) -> tuple[int, ...]:
  from safetensors import safe_open  # pylint: disable=import-outside-toplevel
  try:
    with safe_open(str(file), framework="np") as fh:
      return tuple(fh.get_slice(name).get_shape())
  except Exception as first:  # pylint: disable=broad-except
    try:
      return tuple(_raw_header(file)[2][name]["shape"])
    except Exception as e:  # pylint: disable=broad-except
      raise _corrupt(file, e) from first


def _read_block(file: Path, name: str, index: tuple) -> np.ndarray:
  """tensor[index] through safe_open(...).get_slice (only that block is read);
  the hand parser's memory map where the numpy backend lacks the dtype."""
  from safetensors import safe_open  # pylint: disable=import-outside-toplevel
  try:
    with safe_open(str(file), framework="np") as fh:
      return fh.get_slice(name)[index]
  except Exception as first:  # pylint: disable=broad-except
    try:
      data, base, header = _raw_header(file)
      info = header[name]
      start, end = (base + o for o in info["data_offsets"])
      view = data[start:end].view(np.dtype(_ST_DTYPES[info["dtype"]]))
      return np.array(view.reshape(info["shape"])[index])
    except Exception as e:  # pylint: disable=broad-except
      raise _corrupt(file, e) from first


class SafetensorsState(Mapping):
  """{HF name: numpy array} over safetensors files, each tensor read when it is
  accessed: loading then holds the params plus one tensor, not two copies of
  the model. bf16 comes as ml_dtypes.bfloat16.

  Raises:
    CheckpointError: a file is missing, truncated or not safetensors.
  """

  def __init__(self, files):
    self._file = {name: Path(f) for f in files for name in _tensor_names(Path(f))}

  def __getitem__(self, name: str) -> np.ndarray:
    return _read_tensor(self._file[name], name)

  def shape(self, name: str) -> tuple[int, ...]:
    """The tensor's shape, from the file header (nothing read)."""
    return _tensor_shape(self._file[name], name)

  def read_block(self, name: str, index: tuple) -> np.ndarray:
    """tensor[index] (a tuple of slices), reading only that block."""
    return _read_block(self._file[name], name, index)

  def __iter__(self):
    return iter(self._file)

  def __len__(self) -> int:
    return len(self._file)


def read_safetensors(file: str | os.PathLike) -> dict[str, np.ndarray]:
  """All tensors of one safetensors file as numpy arrays (bf16 via ml_dtypes)."""
  return dict(SafetensorsState([file]))


def write_safetensors(file: str | os.PathLike,
                      tensors: dict[str, np.ndarray]) -> None:
  """Writes numpy tensors (bf16 included) with HF's `format: pt` metadata,
  which transformers' from_pretrained requires."""
  import safetensors.numpy  # pylint: disable=import-outside-toplevel
  metadata = {"format": "pt"}
  try:
    safetensors.numpy.save_file(tensors, str(file), metadata=metadata)
  except Exception:  # pylint: disable=broad-except
    _write_raw(Path(file), tensors, metadata)

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
    dtype: compute and param dtype; default: the checkpoint's torch_dtype.
    role: 'target' or 'draft': the placement on the active mesh
      (sharding.role_shardings); each process reads only its devices' slices.
  Returns:
    (cfg, params) with params in cfg.param_dtype.
  Raises:
    CheckpointError: one line naming what is missing, mis-shaped or corrupt.
  """
  if dtype and canonical_precision(dtype) == INT8:
    raise ConfigError("load_hf loads float weights; int8 goes through "
                      "checkpoint.load_model(..., dtype='int8')")
  path = Path(path)
  cfg = read_hf_config(path, dtype)
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
