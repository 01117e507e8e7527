"""GGUF checkpoints (llama.cpp's format, quantized ones too) -> specjax.

    cfg, params, tokenizer = load_gguf("model.Q8_0.gguf")

The file is read by gguf.py (a memory-mapped GGUFReader), a tensor's bytes
when that tensor is converted. The tensors go through
`hf.hf_state_to_params`, the one conversion table, under their HF names: a
`GGUFState` maps HF names to GGUF tensors and undoes llama.cpp's Q/K row
permutation (the inverse of `gguf.gguf_permute`). Without --dtype, F32 and
F16 files load as float32, BF16 and quantized ones by backend and size
(`default_dtype`, logged). Invariant: the peak is the params plus about one block of rows,
never a float32 copy of the model (formats/convert.py). The tokenizer comes
from gguf_tokenizer.py. What loads, the mesh case, the measured peaks:
docs/gguf_int8.md.
"""

from __future__ import annotations

import mmap
import os
import re
from collections.abc import Mapping
from pathlib import Path

import jax
import numpy as np
from absl import logging

from specjax.errors import CheckpointError, ConfigError, TokenizerError
from specjax.formats import gguf as gguf_file
from specjax.formats import hf
from specjax.formats.gguf_tokenizer import gguf_tokenizer
from specjax.model import llama as model_lib
from specjax.model import sharding
from specjax.model.config import ModelConfig


class GGUFState(Mapping):
  """{HF name: float32 array in torch layout} over a GGUF file's tensors,
  each dequantized when read (`read_block`: a block of rows alone), q/k rows
  put back in HF's rotate-half order."""

  def __init__(self, reader, cfg: ModelConfig, source: str):
    self.cfg, self.source, self._reader = cfg, source, reader
    by_name = {t.name: t for t in reader.tensors if t.name != gguf_file.ROPE_FREQS}
    wanted = {gguf_file.gguf_name(t.hf_name): t.hf_name for t in hf.tensor_map(cfg)}
    missing = [g for g in wanted if g not in by_name]
    if missing:
      raise CheckpointError(f"{source}: missing tensor {hf.names_list(missing)}")
    extra = sorted(set(by_name) - set(wanted))
    if extra:
      raise CheckpointError(f"{source}: unexpected tensor {hf.names_list(extra)}; "
                            f"not a LLaMA model matching its metadata")
    self._t = {h: by_name[g] for g, h in wanted.items()}
    for t in self._t.values():
      gguf_file.check_type(t, source)

  def _perm(self, name: str) -> np.ndarray | None:
    """GGUF row order -> HF row order of q / k (None for other tensors)."""
    heads = {"q_proj": self.cfg.n_heads, "k_proj": self.cfg.n_kv_heads}
    m = re.search(r"self_attn\.([qk]_proj)\.weight$", name)
    if not m:
      return None
    n = self.shape(name)[0]
    return np.argsort(gguf_file.gguf_permute(np.arange(n)[:, None], heads[m.group(1)])[:, 0])

  def shape(self, name: str) -> tuple[int, ...]:
    return gguf_file.shape_of(self._t[name])

  def read_block(self, name: str, index: tuple) -> np.ndarray:
    """tensor[index] (torch layout): only the needed rows are dequantized."""
    t, perm = self._t[name], self._perm(name)
    rows, rest = index[0], tuple(index[1:])
    if perm is not None:
      rows = perm[rows]
    return gguf_file.dequantize(t, rows)[(slice(None),) + rest]

  def __getitem__(self, name: str) -> np.ndarray:
    return self.read_block(name, (slice(None),) * len(self.shape(name)))

  def release(self, name: str) -> None:
    """Drops tensor `name`'s pages of the memory map from the resident set
    once it is loaded (they stay in the page cache; a later read maps them
    again): the file's pages would otherwise count once more on top of the
    params. Best effort: a reader without an mmap keeps its pages."""
    t = self._t[name]
    mm = getattr(self._reader.data, "_mmap", None)
    if mm is None or not hasattr(mm, "madvise"):
      return
    start = t.data_offset // mmap.PAGESIZE * mmap.PAGESIZE
    try:
      mm.madvise(mmap.MADV_DONTNEED, start, t.data_offset + t.n_bytes - start)
    except (OSError, ValueError):
      pass

  def __contains__(self, name) -> bool:  # Mapping's would dequantize the tensor
    return name in self._t

  def __iter__(self):
    return iter(self._t)

  def __len__(self) -> int:
    return len(self._t)


# The weight types whose default load is float32: exact, and no larger than
# the file's own precision warrants. F16 would round to bf16 (3 of its 10
# mantissa bits lost), so it stays float32 unless --dtype says otherwise.
FLOAT32_DEFAULT = ("F32", "F16")
# On the CPU a BF16 or quantized file loads as float32 while its float32
# params take at most this share of the machine's memory (the run needs the
# params, the KV cache, the programs' temporaries and the load's block).
CPU_FLOAT32_SHARE = 0.5


def machine_memory() -> int | None:
  """Bytes of memory this process may use: the machine's physical memory,
  or a lower cgroup limit (the v2 and v1 limit files read below); None
  when the system does not say."""
  try:
    total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
  except (ValueError, OSError, AttributeError):
    total = None
  for limit_file in ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes"):
    try:
      with open(limit_file) as f:
        text = f.read().strip()
    except OSError:
      continue
    if text.isdigit():
      total = int(text) if total is None else min(total, int(text))
  return total


def _gb(n: float) -> str:
  return f"{n / 1e9:.2f} GB"


def default_dtype(reader, source: str, backend: str | None = None,
                  memory: int | None = None) -> str:
  """The load precision of a file loaded without --dtype, logged in one line
  with the reason. F32 and F16 weights: float32 (exact). BF16 and quantized
  weights, by backend and size: float32 on the CPU while the float32 params
  fit in CPU_FLOAT32_SHARE of `memory` (machine_memory()), bf16-mixed past
  it, bfloat16 on an accelerator. Not bfloat16 on the CPU: XLA:CPU widens
  bf16 weights to float32 copies inside the compiled prefill and decode (a
  run's peak above float32's) and decodes slower (docs/gguf_int8.md)."""
  sizes: dict[str, int] = {}
  for t in reader.tensors:
    if len(gguf_file.shape_of(t)) > 1:
      sizes[t.tensor_type.name] = sizes.get(t.tensor_type.name, 0) + int(t.n_elements)
  kinds = sorted(sizes, key=lambda k: -sizes[k])
  what = "+".join(kinds) or "no 2-D"
  backend = backend or jax.default_backend()
  f32_bytes = 4 * sum(int(t.n_elements) for t in reader.tensors)
  if all(k in FLOAT32_DEFAULT for k in kinds):
    dtype = "float32"
    why = ("exact; --dtype=bf16 halves the memory, rounding F16's 10 mantissa bits to 7"
           if "F16" in kinds else "exact")
  elif backend != "cpu":
    dtype = "bfloat16"
    why = f"{backend}: half of float32's {_gb(f32_bytes)}; --dtype=float32 for float32"
  else:
    memory = machine_memory() if memory is None else memory
    if memory is None or f32_bytes <= CPU_FLOAT32_SHARE * memory:
      dtype = "float32"
      why = (f"cpu: float32's {_gb(f32_bytes)} fit well within " +
             (f"{_gb(memory)}" if memory else "memory (size unknown)") +
             "; bfloat16 on XLA:CPU keeps float32 copies of the weights and decodes slower")
    else:
      dtype = "bf16-mixed"
      why = (f"cpu: float32's {_gb(f32_bytes)} is over {CPU_FLOAT32_SHARE:.0%} of "
             f"{_gb(memory)}; bf16 weights, float32 activations: plain bfloat16 would hold "
             "float32 copies of the weights; --dtype=int8 for less")
  # A warning, not info: scripts show warnings only, and this choice sets speed and memory.
  logging.warning("%s: %s weights -> %s (%s)", source, what, dtype, why)
  return dtype


def load_gguf(path: str | os.PathLike, dtype: str | None = None, role: str = "target"):
  """Loads a llama GGUF file: (cfg, params, tokenizer or None).

  Args:
    dtype: compute and param dtype; default (`default_dtype`, logged):
      float32 for F32 / F16 weights; BF16 and quantized ones float32 on
      the CPU where they fit (bf16-mixed where not), bfloat16 elsewhere;
      'int8' quantizes each projection per channel as it is read (quant.py).
      Every tensor is dequantized a block of rows at a time straight into
      the dtype (formats/convert.py): the float32 model is never held.
    role: 'target' or 'draft': the placement on the active mesh.
  Raises:
    CheckpointError: one line: not GGUF, truncated, not llama, a missing or
      unexpected tensor, a tensor type gguf cannot dequantize.
  """
  path = Path(path)
  reader = gguf_file.open_reader(path)
  source = str(path)
  try:
    cfg = gguf_file.read_config(reader, source, name=path.stem)
  except ConfigError as e:
    raise CheckpointError(str(e)) from None
  cfg = cfg.with_dtype(dtype or default_dtype(reader, source))
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
