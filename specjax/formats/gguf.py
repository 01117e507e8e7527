"""GGUF files (llama.cpp's format, quantized ones too): the reader.

The file is read with the `gguf` package's GGUFReader, which memory-maps
it. Here: the GGUF tensor-name table (also written by gguf_write), the
reader, the metadata (`field`, `read_config`), and `dequantize`: every
tensor type the package can dequantize (F32, F16, BF16, the Q4/Q5/Q8 block
types, the K-quants, the IQ types, ...) by `gguf.quants.dequantize` (the
package's vectorised NumPy code) to float32.

The weights are loaded by gguf_weights.py (`load_gguf`), the tokenizer is
built by gguf_tokenizer.py.
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any

import numpy as np

from specjax.model.config import ModelConfig, RopeScaling
from specjax.errors import CheckpointError, ConfigError
from specjax.model.layers import rope_inv_freq

SUFFIX = ".gguf"
# llama.cpp's precomputed LLaMA-3 RoPE factors; read into cfg.rope_scaling.
ROPE_FREQS = "rope_freqs.weight"


# ---------------------------------------------------------------- names
# The one table of GGUF tensor names, read here and written by gguf_write.


def gguf_permute(w: np.ndarray, n_head: int) -> np.ndarray:
  """q/k rows from HF's rotate-half RoPE layout to llama.cpp's interleaved
  one: HF's convert script's `permute` (w [n_head * D, E])."""
  return (w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:])
          .swapaxes(1, 2).reshape(w.shape))


GGUF_TOP = {"model.embed_tokens.weight": "token_embd.weight",
             "model.norm.weight": "output_norm.weight",
             "lm_head.weight": "output.weight"}
GGUF_LAYER = {"input_layernorm": "attn_norm", "self_attn.q_proj": "attn_q",
               "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
               "self_attn.o_proj": "attn_output",
               "post_attention_layernorm": "ffn_norm",
               "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
               "mlp.down_proj": "ffn_down"}



def is_gguf_file(path: str | os.PathLike) -> bool:
  """True if `path` is an existing file named *.gguf."""
  path = Path(path)
  return path.suffix.lower() == SUFFIX and path.is_file()


def _first_line(e: Exception) -> str:
  return (str(e).strip().splitlines() or [repr(e)])[0][:300]


def _reader_class():
  """gguf.GGUFReader reading through a plain ndarray view of its memory map.

  The reader slices its np.memmap once per metadata value; the memmap
  subclass costs a Python call per slice, which made parsing a 32k-token
  vocabulary about half of a llama-160m Q8_0 load. Same bytes, same views
  of the same map, without the subclass (this overrides the reader's `_get`).
  """
  import gguf  # pylint: disable=import-outside-toplevel

  class Reader(gguf.GGUFReader):
    def _get(self, offset, dtype, count=1, override_order=None):
      plain = self.__dict__.get("_plain")
      if plain is None:
        plain = self.__dict__["_plain"] = self.data.view(np.ndarray)
      count, dtype = int(count), np.dtype(dtype)
      arr = plain[offset:offset + dtype.itemsize * count].view(dtype)[:count]
      order = self.byte_order if override_order is None else override_order
      return arr.view(arr.dtype.newbyteorder(order))
  return Reader


def open_reader(path: str | os.PathLike):
  """A GGUFReader over `path` (memory-mapped).

  Raises:
    CheckpointError: missing, not GGUF, truncated or otherwise unreadable.
  """
  import gguf  # pylint: disable=import-outside-toplevel
  path = Path(path)
  if not path.is_file():
    raise CheckpointError(f"GGUF file {path} does not exist")
  with open(path, "rb") as fh:
    if fh.read(4) != b"GGUF":
      raise CheckpointError(f"not a GGUF file: {path} does not start with the GGUF magic")
  try:
    reader = _reader_class()(str(path))
  except Exception:  # pylint: disable=broad-except
    try:  # the package's own reader, in case its internals changed; its reason
      reader = gguf.GGUFReader(str(path))
    except Exception as e:  # pylint: disable=broad-except
      raise CheckpointError(f"truncated or corrupt GGUF file {path}: "
                            f"{_first_line(e)}") from None
  size = path.stat().st_size
  for t in reader.tensors:
    if t.data_offset + t.n_bytes > size or t.data.nbytes != t.n_bytes:
      raise CheckpointError(f"truncated GGUF file {path}: tensor {t.name} runs "
                            f"past the end of the file ({size} bytes)")
  return reader

# ---------------------------------------------------------------- metadata


def field(reader, key: str, default: Any = None) -> Any:
  """A metadata value: int / float / bool / str, or a list of them."""
  import gguf  # pylint: disable=import-outside-toplevel
  f = reader.get_field(key)
  if f is None:
    return default
  vt = gguf.GGUFValueType
  as_str = lambda part: bytes(part).decode("utf-8", errors="replace")
  if f.types[0] == vt.ARRAY:
    if f.types[-1] == vt.STRING:
      return [as_str(f.parts[i]) for i in f.data]
    return [v for i in f.data for v in f.parts[i].tolist()]
  if f.types[0] == vt.STRING:
    return as_str(f.parts[f.data[0]])
  return f.parts[f.data[0]].tolist()[0]


def _float(x) -> float:
  """A float32 metadata value as the decimal it was written from (1e-05,
  not 9.99999974e-06), so configs compare equal to their source."""
  return float(str(np.float32(x)))


def _tensor(reader, name: str):
  for t in reader.tensors:
    if t.name == name:
      return t
  return None


def shape_of(t) -> tuple[int, ...]:
  """A tensor's logical shape in NumPy order (ggml stores it reversed)."""
  return tuple(int(d) for d in reversed(t.shape.tolist()))


def _rope_scaling(reader, source: str, theta: float, d_head: int) -> RopeScaling | None:
  """LLaMA-3 scaling from llama.cpp's `rope_freqs.weight` (the factors its
  converter precomputes); other scaling types are refused."""
  kind = field(reader, "llama.rope.scaling.type", "none")
  if kind not in ("none", None):
    raise ConfigError(f"{source}: rope scaling type {kind!r} is not supported")
  t = _tensor(reader, ROPE_FREQS)
  if t is None:
    return None
  factors = np.asarray(dequantize(t), np.float64).reshape(-1)
  orig = int(field(reader, "llama.rope.scaling.original_context_length", 8192))
  guess = RopeScaling(float(factors.max()), 1.0, 4.0, orig)
  probe = ModelConfig("probe", 1, d_head, 1, 1, 1, 1, head_dim=d_head, rope_theta=theta)
  base = rope_inv_freq(probe)
  want = base / rope_inv_freq(probe.replace(rope_scaling=guess))
  if factors.shape != want.shape or not np.allclose(factors, want, rtol=1e-4):
    raise ConfigError(f"{source}: {ROPE_FREQS} is not LLaMA-3 scaling with low/high "
                      f"frequency factors 1/4 and original context {orig}")
  return guess


def read_config(reader, source: str, name: str = "gguf") -> ModelConfig:
  """The ModelConfig of a GGUF file, from its `llama.*` keys and shapes.

  Raises:
    CheckpointError: not a llama file, or a required key or tensor is missing.
    ConfigError: an unsupported feature (partial RoPE, rope scaling type).
  """
  arch = field(reader, "general.architecture")
  if arch != "llama":
    raise CheckpointError(f"{source}: architecture {arch!r} is not supported "
                          f"(only 'llama')")
  need = {k: field(reader, f"llama.{k}") for k in (
      "block_count", "embedding_length", "attention.head_count", "feed_forward_length")}
  missing = [f"llama.{k}" for k, v in need.items() if v is None]
  embd = _tensor(reader, "token_embd.weight")
  if embd is None:
    missing.append("tensor token_embd.weight")
  if missing:
    raise CheckpointError(f"{source}: missing {', '.join(missing)}")
  dim, heads = int(need["embedding_length"]), int(need["attention.head_count"])
  d_head = int(field(reader, "llama.attention.key_length", dim // heads))
  rot = int(field(reader, "llama.rope.dimension_count", d_head))
  if rot != d_head:
    raise ConfigError(f"{source}: partial RoPE (rope.dimension_count {rot} < "
                      f"head size {d_head}) is not supported")
  theta = _float(field(reader, "llama.rope.freq_base", 10000.0))
  tokens = field(reader, "tokenizer.ggml.tokens") or []
  vocab = shape_of(embd)[0]
  if len(tokens) > vocab:
    raise CheckpointError(f"{source}: {len(tokens)} tokens but token_embd.weight "
                          f"has only {vocab} rows")
  opt = lambda key: None if field(reader, key) is None else int(field(reader, key))
  return ModelConfig(
      name=name, vocab_size=vocab, dim=dim, n_layers=int(need["block_count"]),
      n_heads=heads, n_kv_heads=int(field(reader, "llama.attention.head_count_kv", heads)),
      ffn_dim=int(need["feed_forward_length"]),
      norm_eps=_float(field(reader, "llama.attention.layer_norm_rms_epsilon", 1e-5)),
      rope_theta=theta, rope_scaling=_rope_scaling(reader, source, theta, d_head),
      max_seq_len=int(field(reader, "llama.context_length", 2048)),
      tie_embeddings=_tensor(reader, "output.weight") is None,
      head_dim=None if d_head == dim // heads else d_head,
      bos_token_id=opt("tokenizer.ggml.bos_token_id"),
      eos_token_id=opt("tokenizer.ggml.eos_token_id"))

# ---------------------------------------------------------------- tensors


def dequantize(t, rows=slice(None)) -> np.ndarray:
  """Rows `rows` of GGUF tensor `t` as float32, by gguf.quants.dequantize
  (a quantized row is whole blocks, so a row range dequantizes alone)."""
  import gguf  # pylint: disable=import-outside-toplevel
  # A plain ndarray view of the memory map: numpy's memmap subclass costs a
  # Python call on every intermediate view gguf.quants makes (about 40% of a
  # Q8_0 load).
  data = t.data.view(np.ndarray)
  data = data if data.ndim else data.reshape(1)
  return np.asarray(gguf.quants.dequantize(data[rows], t.tensor_type), np.float32)


def check_type(t, source: str) -> None:
  """Raises CheckpointError if gguf cannot dequantize tensor `t`'s type."""
  try:
    dequantize(t, slice(0, 1))
  except NotImplementedError:
    raise CheckpointError(f"{source}: tensor {t.name} has type {t.tensor_type.name}, "
                          f"which the gguf package cannot dequantize") from None


def gguf_name(hf_name: str) -> str:
  """The GGUF tensor name of an HF tensor name."""
  m = re.fullmatch(r"model\.layers\.(\d+)\.(.+)\.weight", hf_name)
  if not m:
    return GGUF_TOP[hf_name]
  return f"blk.{m.group(1)}.{GGUF_LAYER[m.group(2)]}.weight"
