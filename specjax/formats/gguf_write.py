"""Writing a specjax model as a llama.cpp GGUF file (llama architecture), the
inverse of specjax/formats/gguf.py through the same tensor-name table and
q/k permutation: weights in the model's dtype or any type gguf.quants can
quantize, a placeholder SentencePiece vocabulary (comparisons feed ids).
Used by the llama.cpp backend, gguf_bench and the tests."""

from __future__ import annotations

import os
import re
from pathlib import Path

import numpy as np

from specjax.errors import ConfigError
from specjax.formats import hf
from specjax.formats.gguf import GGUF_LAYER, GGUF_TOP, gguf_permute
from specjax.model.config import ModelConfig


def gguf_tensors(cfg: ModelConfig, params) -> dict[str, np.ndarray]:
  """{GGUF name: array, torch layout} from `hf.params_to_hf_state` (the one
  conversion), renamed, q/k rows permuted for llama.cpp's RoPE."""
  out = {}
  for name, arr in hf.params_to_hf_state(cfg, params).items():
    m = re.fullmatch(r"model\.layers\.(\d+)\.(.+)\.weight", name)
    if not m:
      out[GGUF_TOP[name]] = arr
      continue
    part = m.group(2)
    if part == "self_attn.q_proj":
      arr = gguf_permute(arr, cfg.n_heads)
    elif part == "self_attn.k_proj":
      arr = gguf_permute(arr, cfg.n_kv_heads)
    out[f"blk.{m.group(1)}.{GGUF_LAYER[part]}.weight"] = arr
  return out


def placeholder_vocab(n: int) -> tuple[list[str], list[float], list[int]]:
  """A dummy SentencePiece vocabulary of n tokens (llama.cpp wants one):
  <unk> <s> </s>, the 256 byte tokens when they fit, then placeholders.
  The comparison feeds token ids, so the strings never matter."""
  import gguf  # pylint: disable=import-outside-toplevel
  t = gguf.TokenType
  toks, types = ["<unk>", "<s>", "</s>"], [t.UNKNOWN, t.CONTROL, t.CONTROL]
  if n >= 3 + 256:
    toks += [f"<0x{i:02X}>" for i in range(256)]
    types += [t.BYTE] * 256
  toks += [f"\u2581t{i}" for i in range(len(toks), n)]
  types += [t.NORMAL] * (n - len(types))
  return toks[:n], [0.0] * n, [int(x) for x in types[:n]]


# The `llama.*` metadata of a GGUF file and the ModelConfig field each holds:
# (GGUFWriter method, ModelConfig attribute).
GGUF_CONFIG = (
    ("add_context_length", "max_seq_len"), ("add_embedding_length", "dim"),
    ("add_block_count", "n_layers"), ("add_feed_forward_length", "ffn_dim"),
    ("add_head_count", "n_heads"), ("add_head_count_kv", "n_kv_heads"),
    ("add_key_length", "d_head"), ("add_value_length", "d_head"),
    ("add_rope_dimension_count", "d_head"), ("add_layer_norm_rms_eps", "norm_eps"),
    ("add_rope_freq_base", "rope_theta"), ("add_vocab_size", "vocab_size"),
)


def write_gguf(path: str | os.PathLike, cfg: ModelConfig, params,
               tensor_type: str | None = None) -> Path:
  """Writes `params` as a llama.cpp GGUF file (llama architecture): weights
  in cfg.param_dtype (norms f32, as llama.cpp's converter keeps them).

  Args:
    tensor_type: a gguf type name for the 2-D weights instead ('Q8_0',
      'Q4_0', ...: any type gguf.quants can quantize), by gguf.quants.quantize.
  Raises:
    ConfigError: a feature this writer does not map (llama3 RoPE scaling),
      or a type gguf cannot quantize.
  """
  import gguf  # pylint: disable=import-outside-toplevel
  if cfg.rope_scaling is not None:
    raise ConfigError(f"{cfg.name}: write_gguf does not map llama3 RoPE scaling")
  qtype = None
  if tensor_type is not None:
    try:
      qtype = gguf.GGMLQuantizationType[tensor_type.upper()]
    except KeyError:
      raise ConfigError(f"unknown GGUF tensor type {tensor_type!r}") from None
  path = Path(path)
  path.parent.mkdir(parents=True, exist_ok=True)
  w = gguf.GGUFWriter(str(path), "llama")
  w.add_name(cfg.name)
  for method, field in GGUF_CONFIG:
    getattr(w, method)(getattr(cfg, field))
  if qtype is None:
    w.add_file_type({"float32": gguf.LlamaFileType.ALL_F32,
                     "float16": gguf.LlamaFileType.MOSTLY_F16,
                     "bfloat16": gguf.LlamaFileType.MOSTLY_BF16}[cfg.param_dtype])
  toks, scores, types = placeholder_vocab(cfg.vocab_size)
  w.add_tokenizer_model("llama")
  w.add_token_list(toks)
  w.add_token_scores(scores)
  w.add_token_types(types)
  w.add_unk_token_id(0)
  w.add_bos_token_id(1 if cfg.bos_token_id is None else cfg.bos_token_id)
  w.add_eos_token_id(2 if cfg.eos_token_id is None else cfg.eos_token_id)
  for name, arr in gguf_tensors(cfg, params).items():
    if arr.ndim == 1 or (qtype is None and cfg.param_dtype == "float32"):
      w.add_tensor(name, np.asarray(arr, np.float32))
    elif qtype is None and cfg.param_dtype == "float16":
      w.add_tensor(name, np.asarray(arr, np.float16))
    else:  # bf16 or a quantized type: raw bytes, laid out by gguf's quantize
      q = qtype if qtype is not None else gguf.GGMLQuantizationType.BF16
      try:
        raw = gguf.quants.quantize(np.asarray(arr, np.float32), q)
      except (NotImplementedError, gguf.quants.QuantError) as e:
        raise ConfigError(f"{name}: {e}") from None
      w.add_tensor(name, raw, raw_dtype=q)
  w.write_header_to_file()
  w.write_kv_data_to_file()
  w.write_tensors_to_file()
  w.close()
  return path
