"""GGUF checkpoints (llama.cpp's format, quantized ones too) -> specjax.

    cfg, params, tokenizer = load_gguf("model.Q8_0.gguf")

The file is read with the `gguf` package's GGUFReader, which memory-maps
it: a tensor's bytes are read when that tensor is converted. Every tensor
type the package can dequantize (F32, F16, BF16, the Q4/Q5/Q8 block types,
the K-quants, the IQ types, ...) is dequantized by `gguf.quants.dequantize`
(the package's vectorised NumPy code) to float32, then cast to the compute
dtype. The tensors go through `hf.hf_state_to_params`, the one conversion
table, under their HF names: a `GGUFState` maps HF names to GGUF tensors
and undoes llama.cpp's Q/K row permutation (the inverse of
`gguf_permute`).

On a mesh (sharding.role_shardings) each device's block is built on its
own: the rows a device needs (torch layout: output rows) are read and
dequantized alone, quantized rows being whole blocks; a block split on the
input columns dequantizes the rows and keeps its columns, so o/down under
tensor parallelism dequantize their whole tensor on every host.

The tokenizer comes from the `tokenizer.ggml.*` metadata (`gguf_tokenizer`).
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import jax
import numpy as np
from absl import logging

from specjax.formats import hf, pretokenizers
from specjax.model import llama as model_lib
from specjax.model import quant
from specjax.model import sharding
from specjax.model.config import INT8, ModelConfig, RopeScaling, canonical_precision
from specjax.errors import CheckpointError, ConfigError, TokenizerError
from specjax.formats.tokenizer import Tokenizer
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


def _shape(t) -> tuple[int, ...]:
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
  vocab = _shape(embd)[0]
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


class GGUFState(Mapping):
  """{HF name: float32 array in torch layout} over a GGUF file's tensors,
  each dequantized when read, q/k rows put back in HF's rotate-half order."""

  def __init__(self, reader, cfg: ModelConfig, source: str):
    self.cfg, self.source = cfg, source
    by_name = {t.name: t for t in reader.tensors if t.name != ROPE_FREQS}
    wanted = {gguf_name(t.hf_name): t.hf_name for t in hf.tensor_map(cfg)}
    missing = [g for g in wanted if g not in by_name]
    if missing:
      raise CheckpointError(f"{source}: missing tensor {hf.names_list(missing)}")
    extra = sorted(set(by_name) - set(wanted))
    if extra:
      raise CheckpointError(f"{source}: unexpected tensor {hf.names_list(extra)}; "
                            f"not a LLaMA model matching its metadata")
    self._t = {h: by_name[g] for g, h in wanted.items()}
    for t in self._t.values():
      check_type(t, source)

  def _perm(self, name: str) -> np.ndarray | None:
    """GGUF row order -> HF row order of q / k (None for other tensors)."""
    heads = {"q_proj": self.cfg.n_heads, "k_proj": self.cfg.n_kv_heads}
    m = re.search(r"self_attn\.([qk]_proj)\.weight$", name)
    if not m:
      return None
    n = self.shape(name)[0]
    return np.argsort(gguf_permute(np.arange(n)[:, None], heads[m.group(1)])[:, 0])

  def shape(self, name: str) -> tuple[int, ...]:
    return _shape(self._t[name])

  def read_block(self, name: str, index: tuple) -> np.ndarray:
    """tensor[index] (torch layout): only the needed rows are dequantized."""
    t, perm = self._t[name], self._perm(name)
    rows, rest = index[0], tuple(index[1:])
    if perm is not None:
      rows = perm[rows]
    return dequantize(t, rows)[(slice(None),) + rest]

  def __getitem__(self, name: str) -> np.ndarray:
    return self.read_block(name, (slice(None),) * len(self.shape(name)))

  def __iter__(self):
    return iter(self._t)

  def __len__(self) -> int:
    return len(self._t)


def load_gguf(path: str | os.PathLike, dtype: str | None = None, role: str = "target"):
  """Loads a llama GGUF file: (cfg, params, tokenizer or None).

  Args:
    dtype: compute and param dtype; default float32 (what every GGUF type
      dequantizes to exactly, F16 and BF16 included); 'int8' quantizes the
      float32 weights per channel (quant.py).
    role: 'target' or 'draft': the placement on the active mesh.
  Raises:
    CheckpointError: one line: not GGUF, truncated, not llama, a missing or
      unexpected tensor, a tensor type gguf cannot dequantize.
  """
  if dtype and canonical_precision(dtype) == INT8:  # float32, then quantized
    cfg, params, tok = load_gguf(path, "float32", role)
    return (*quant.quantize_model(cfg, params, role), tok)
  path = Path(path)
  reader = open_reader(path)
  source = str(path)
  try:
    cfg = read_config(reader, source, name=path.stem)
  except ConfigError as e:
    raise CheckpointError(str(e)) from None
  if dtype:
    cfg = cfg.with_dtype(dtype)
  cfg = sharding.pad_vocab(cfg)  # on a mesh the model axis does not divide V
  state = GGUFState(reader, cfg, source)
  shardings = None
  if sharding.current() is not None:
    shapes = jax.eval_shape(lambda: model_lib.init_params(cfg))
    shardings = sharding.role_shardings(cfg, shapes, role)
  params = hf.hf_state_to_params(cfg, state, source=source, shardings=shardings)
  tok = gguf_tokenizer(reader, source)
  if tok is not None and tok.vocab_size > cfg.vocab_size:
    raise TokenizerError(f"{source}: tokenizer has {tok.vocab_size} tokens but the "
                         f"model only {cfg.vocab_size}")
  return cfg, params, tok

# ---------------------------------------------------------------- tokenizer

# gguf.TokenType values
NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 2, 3, 4, 5, 6


def _spm_merges(tokens: list[str], scores: list[float], types: list[int]):
  """SentencePiece BPE as BPE merges: every split of a normal piece into two
  normal pieces, ranked by the merged piece's score (highest first), ties by
  the halves' ids (transformers' SentencePieceExtractor does the same)."""
  ids = {t: i for i, t in enumerate(tokens) if types[i] == NORMAL}
  merges = []
  for piece, i in ids.items():
    local = [(piece[:k], piece[k:]) for k in range(1, len(piece))
             if piece[:k] in ids and piece[k:] in ids]
    local.sort(key=lambda lr: (ids[lr[0]], ids[lr[1]]))
    merges += [(l, r, scores[i]) for l, r in local]
  merges.sort(key=lambda m: -m[2])  # stable: ties keep the id order
  return [(l, r) for l, r, _ in merges]


def _post_processor(tokens, bos, eos, add_bos: bool, add_eos: bool):
  """BOS / EOS around each sequence, as the file's add_*_token say."""
  from tokenizers import processors  # pylint: disable=import-outside-toplevel
  add_bos, add_eos = add_bos and bos is not None, add_eos and eos is not None
  if not (add_bos or add_eos):
    return None
  around = lambda seq: ([f"{tokens[bos]}:{seq}"] * add_bos + [f"${'AB'[seq]}:{seq}"]
                        + [f"{tokens[eos]}:{seq}"] * add_eos)
  special = [(tokens[bos], bos)] * add_bos + [(tokens[eos], eos)] * add_eos
  return processors.TemplateProcessing(single=around(0), pair=around(0) + around(1),
                                       special_tokens=special)


def _add_tokens(backend, tokens, types) -> None:
  """Control tokens as special tokens (matched in text, skipped when
  decoding); user-defined ones as plain added tokens (matched in text)."""
  from tokenizers import AddedToken  # pylint: disable=import-outside-toplevel
  pick = lambda kind: [AddedToken(t, special=kind == CONTROL, normalized=False)
                       for i, t in enumerate(tokens) if types[i] == kind]
  backend.add_special_tokens(pick(CONTROL))
  backend.add_tokens(pick(USER_DEFINED))


def _spm_tokenizer(tokens, scores, types, merges, unk, add_prefix):
  """llama.cpp's 'llama' (SentencePiece BPE) vocabulary as `tokenizers`:
  spaces as '▁', a '▁' prepended (add_space_prefix), byte fallback."""
  import tokenizers  # pylint: disable=import-outside-toplevel
  from tokenizers import decoders, models, normalizers  # pylint: disable=import-outside-toplevel
  vocab = {t: i for i, t in enumerate(tokens)}
  if merges is None:
    merges = _spm_merges(tokens, scores, types)
  has_bytes = BYTE in types
  tok = tokenizers.Tokenizer(models.BPE(
      vocab, merges, unk_token=None if unk is None else tokens[unk],
      fuse_unk=True, byte_fallback=has_bytes))
  norm = [normalizers.Replace(" ", "\u2581")]
  if add_prefix:
    norm.insert(0, normalizers.Prepend("\u2581"))
  tok.normalizer = normalizers.Sequence(norm)
  dec = [decoders.Replace("\u2581", " ")] + [decoders.ByteFallback()] * has_bytes
  dec += [decoders.Fuse()] + [decoders.Strip(" ", 1, 0)] * add_prefix
  tok.decoder = decoders.Sequence(dec)
  return tok


def _bpe_tokenizer(tokens, merges, fam: pretokenizers.Family):
  """llama.cpp's 'gpt2' (byte-level BPE) vocabulary as `tokenizers`, split
  by the family's regexes (formats/pretokenizers.py)."""
  import tokenizers  # pylint: disable=import-outside-toplevel
  from tokenizers import decoders, models  # pylint: disable=import-outside-toplevel
  vocab = {t: i for i, t in enumerate(tokens)}
  tok = tokenizers.Tokenizer(models.BPE(vocab, merges, ignore_merges=fam.ignore_merges))
  tok.pre_tokenizer = pretokenizers.pre_tokenizer(fam)
  tok.decoder = decoders.ByteLevel()
  return tok


class _UnsplitTokenizer(Tokenizer):
  """A byte-level BPE vocabulary whose pre-tokenizer specjax does not know:
  it decodes (the weights load, prompts may be given as ids), and encoding
  raises the reason in one line."""

  def __init__(self, backend, bos_id, eos_id, source: str, reason: str):
    super().__init__(backend, "hf", bos_id, eos_id, source)
    self.reason = reason

  def encode(self, text: str, add_special: bool = True) -> list[int]:
    raise TokenizerError(f"{self.reason}: give the prompt as token ids")


def gguf_tokenizer(reader, source: str) -> Tokenizer | None:
  """The tokenizer of a GGUF file's `tokenizer.ggml.*` metadata, or None
  when the file has no token list.

  `llama` (SentencePiece BPE: scores decide the merges, '▁' for spaces,
  byte tokens <0xNN>) and `gpt2` (byte-level BPE with tokenizer.ggml.merges,
  split first as tokenizer.ggml.pre says: llama.cpp's table, in
  formats/pretokenizers.py; without the key, llama.cpp's 'default'). BOS /
  EOS are added as `add_bos_token` / `add_eos_token` say; without the key,
  llama.cpp's defaults: BOS for `llama` and for the pre-tokenizers llama.cpp
  adds it with (llama-bpe, tekken, chameleon), else nothing. Control tokens
  are special (matched in text, skipped in decoding), user-defined ones are
  matched too.

  A `gpt2` vocabulary whose pre-tokenizer is not in the table still gives a
  tokenizer, one that decodes but raises TokenizerError (naming the value and
  the supported ones) when asked to encode: the weights load, and prompts can
  be given as ids.

  Raises:
    TokenizerError: an unknown tokenizer model, or a `gpt2` vocabulary
      without merges.
  """
  tokens = field(reader, "tokenizer.ggml.tokens")
  if not tokens:
    return None
  kind = field(reader, "tokenizer.ggml.model", "llama")
  types = field(reader, "tokenizer.ggml.token_type") or [NORMAL] * len(tokens)
  merges = field(reader, "tokenizer.ggml.merges")
  merges = None if merges is None else [tuple(m.split(" ", 1)) for m in merges]
  opt = lambda key: None if field(reader, key) is None else int(field(reader, key))
  bos, eos = opt("tokenizer.ggml.bos_token_id"), opt("tokenizer.ggml.eos_token_id")
  unk = opt("tokenizer.ggml.unknown_token_id")
  if kind == "llama":
    scores = field(reader, "tokenizer.ggml.scores") or [0.0] * len(tokens)
    backend = _spm_tokenizer(tokens, scores, types, merges, unk,
                             bool(field(reader, "tokenizer.ggml.add_space_prefix", True)))
    add_bos_default = True
  elif kind == "gpt2":
    pre = field(reader, "tokenizer.ggml.pre")
    if pre is None:
      logging.warning("%s: no tokenizer.ggml.pre; splitting as llama.cpp's %r",
                      source, pretokenizers.MISSING)
    try:
      fam, reason = pretokenizers.family(pre, source), None
    except TokenizerError as e:  # the weights still load; prompts as ids
      fam, reason = pretokenizers.FAMILIES["gpt2"], str(e)
      logging.warning("%s", reason)
    if not merges:
      raise TokenizerError(f"{source}: a gpt2 tokenizer without tokenizer.ggml.merges")
    backend = _bpe_tokenizer(tokens, merges, fam)
    add_bos_default = fam.add_bos
  else:
    raise TokenizerError(f"{source}: tokenizer model {kind!r} is not supported "
                         f"(only 'llama' and 'gpt2')")
  _add_tokens(backend, tokens, types)
  backend.post_processor = _post_processor(
      tokens, bos, eos, bool(field(reader, "tokenizer.ggml.add_bos_token", add_bos_default)),
      bool(field(reader, "tokenizer.ggml.add_eos_token", False)))
  if kind == "gpt2" and reason is not None:
    return _UnsplitTokenizer(backend, bos, eos, source, reason)
  return Tokenizer(backend, "hf", bos, eos, source)
