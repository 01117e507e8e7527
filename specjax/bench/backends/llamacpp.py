"""llama.cpp backend: llama-cpp-python's C API over a GGUF file written from
the same params (`formats.gguf_write.write_gguf`), or over the GGUF file the
model was loaded from (`gguf_path`: llama.cpp then runs exactly that file,
quantized or not). llama_cpp and gguf are imported on first use: this module
imports without them."""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

import jax
import numpy as np

from specjax.formats import gguf_write
from specjax.bench.backends.base import Backend, Unavailable, first_line
from specjax.model.config import ModelConfig
from specjax.errors import ConfigError

_LOG_CALLBACK = None  # keeps llama.cpp's (silencing) log callback alive
# The C API LlamaCppBackend drives (llama.cpp of late 2025 and after).
_LLAMA_API = ("llama_model_load_from_file", "llama_init_from_model",
              "llama_get_memory", "llama_memory_seq_rm", "llama_batch_init",
              "llama_decode", "llama_get_logits", "llama_model_free",
              "llama_model_get_vocab", "llama_vocab_n_tokens")


def _llama_cpp():
  try:
    import llama_cpp  # pylint: disable=import-outside-toplevel
    import gguf  # pylint: disable=import-outside-toplevel,unused-import
  except ImportError as e:
    raise Unavailable(f"{e.name} is not installed: pip install -e "
                      f"'.[llamacpp]' (builds llama.cpp from source)") from None
  except OSError as e:  # the package is there but its shared library is not
    raise Unavailable(f"llama-cpp-python cannot load llama.cpp: "
                      f"{first_line(e)}") from None
  missing = [f for f in _LLAMA_API if not hasattr(llama_cpp, f)]
  if missing or "flash_attn_type" not in dict(llama_cpp.llama_context_params._fields_):
    raise Unavailable(f"llama-cpp-python {llama_cpp.__version__} lacks "
                      f"{', '.join(missing) or 'flash_attn_type'}: pip install -U "
                      f"'llama-cpp-python>=0.3.36'")
  global _LOG_CALLBACK
  if _LOG_CALLBACK is None:
    _LOG_CALLBACK = llama_cpp.llama_log_callback(lambda level, text, data: None)
    llama_cpp.llama_log_set(_LOG_CALLBACK, None)
    llama_cpp.llama_backend_init()
  return llama_cpp


_GGML_KV_TYPE = {"float32": 0, "float16": 1, "bfloat16": 30}  # ggml_type ids
# llama_flash_attn_type. "auto" turns it on for CPU, where it rounds Q to f16
# (f32 parity error ~5e-4 instead of ~3e-7); off is llama-bench's default.
FLASH_ATTN = {"auto": -1, "off": 0, "on": 1}


class LlamaCppBackend(Backend):
  """llama.cpp (through llama-cpp-python's C API) over a GGUF file of the
  same params: one llama_decode of B x N tokens, every logit requested, the
  KV cache (in the model's dtype) cut back to depth before every call.

  With `gguf_path` (the file `cfg, params` were loaded from) llama.cpp runs
  that file as it is, nothing is written, and `parity_tol` widens to what
  llama.cpp's matmuls on its weight type allow (`file_parity_tolerance`)."""
  name = "llama.cpp"
  parity_tol = 0.0  # a floor on base.parity_tolerance for this backend

  def __init__(self, cfg: ModelConfig, params, threads: int,
               flash_attn: str = "off", gguf_path: str | os.PathLike | None = None):
    if flash_attn not in FLASH_ATTN:
      raise ConfigError(f"llama.cpp flash_attn must be one of "
                        f"{', '.join(FLASH_ATTN)}, got {flash_attn!r}")
    self.flash_attn = flash_attn
    ll = self.ll = _llama_cpp()
    if jax.default_backend() != "cpu" and not ll.llama_supports_gpu_offload():
      raise Unavailable(f"this llama-cpp-python build is CPU-only and XLA "
                        f"runs on {jax.default_backend()}")
    self.cfg, self.threads = cfg, threads
    self.model, self.ctx, self.batches = None, None, []
    self.folder = None if gguf_path else tempfile.mkdtemp(prefix="specjax_gguf_")
    try:
      if gguf_path:
        self.path = Path(gguf_path)
        self.parity_tol = file_parity_tolerance(self.path)
      else:
        self.path = gguf_write.write_gguf(Path(self.folder) / f"{cfg.name}-{cfg.dtype}.gguf",
                               cfg, params)
      mp = ll.llama_model_default_params()
      mp.n_gpu_layers = -1 if jax.default_backend() != "cpu" else 0
      self.model = ll.llama_model_load_from_file(str(self.path).encode(), mp)
      if not self.model:
        raise Unavailable(f"llama.cpp could not load {self.path}")
      n_vocab = ll.llama_vocab_n_tokens(ll.llama_model_get_vocab(self.model))
      if n_vocab != cfg.vocab_size:
        raise ConfigError(f"llama.cpp: {self.path} has {n_vocab} tokens, the model "
                          f"{cfg.vocab_size}: not the file the model was loaded from")
    except BaseException:
      self.close()
      raise
    self.vocab = cfg.vocab_size

  def _new_context(self, batch: int, capacity: int, n_batch: int):
    ll = self.ll
    self._free_context()
    cp = ll.llama_context_default_params()
    cp.n_ctx = batch * capacity  # capacity slots per sequence
    cp.n_seq_max = batch
    cp.n_batch = cp.n_ubatch = n_batch  # a timed call is one micro-batch
    cp.n_threads = cp.n_threads_batch = self.threads
    cp.type_k = cp.type_v = _GGML_KV_TYPE[self.cfg.dtype]
    cp.flash_attn_type = FLASH_ATTN[self.flash_attn]
    self.ctx = ll.llama_init_from_model(self.model, cp)
    if not self.ctx:
      raise Unavailable("llama.cpp could not create a context")
    self.n_batch = cp.n_batch

  def _batch(self, tokens: np.ndarray, start: int, logits: bool):
    """A llama_batch of rows tokens [B, N] at positions start.., row b in
    sequence b (freed with the context)."""
    ll, (b, n) = self.ll, tokens.shape
    if b * n > self.n_batch:  # llama.cpp would abort the process
      raise ConfigError(f"llama.cpp: {b * n} tokens exceed n_batch {self.n_batch}")
    batch = ll.llama_batch_init(b * n, 0, 1)
    self.batches.append(batch)  # llama_decode reads it; it is never changed
    for i, (row, j) in enumerate(np.ndindex(b, n)):
      batch.token[i], batch.pos[i] = int(tokens[row, j]), start + j
      batch.n_seq_id[i], batch.seq_id[i][0] = 1, row
      batch.logits[i] = logits
    batch.n_tokens = b * n
    return batch

  def _decode(self, batch) -> None:
    rc = self.ll.llama_decode(self.ctx, batch)
    if rc != 0:
      raise RuntimeError(f"llama_decode returned {rc}")

  def prepare(self, prefix, capacity, max_n):
    b, d = prefix.shape
    chunk = max(1, min(d, 512 // b))  # prefill columns per llama_decode
    self._new_context(b, capacity, b * max(chunk, max_n))
    self.depth, self.mem = d, self.ll.llama_get_memory(self.ctx)
    for s in range(0, d, chunk):
      self._decode(self._batch(prefix[:, s:s + chunk], s, False))

  def runner(self, tokens):
    batch = self._batch(np.asarray(tokens), self.depth, True)

    def run():
      self.ll.llama_memory_seq_rm(self.mem, -1, self.depth, -1)
      self._decode(batch)
    return run

  def logits(self, tokens):
    b, n = np.shape(tokens)
    self.runner(tokens)()
    ptr = self.ll.llama_get_logits(self.ctx)
    return np.ctypeslib.as_array(ptr, shape=(b * n, self.vocab)).reshape(
        b, n, self.vocab).copy()

  def _free_context(self):
    for batch in self.batches:
      self.ll.llama_batch_free(batch)
    self.batches = []
    if self.ctx:
      self.ll.llama_free(self.ctx)
      self.ctx = None

  def close(self):
    self._free_context()
    if self.model:
      self.ll.llama_model_free(self.model)
      self.model = None
    if self.folder:  # only the file written here; never a given one
      shutil.rmtree(self.folder, ignore_errors=True)


# max |logit - xla logit| / max |xla logit| that llama.cpp's CPU matmuls allow
# on a file's weight type, whatever the compute dtype: F16 / BF16 weights meet
# activations rounded to F16 / BF16, quantized ones activations quantized to
# 8 bits per block (Q8_0, Q8_1 or Q8_K: about BF16's precision). Measured on
# the tiny models of tests/test_gguf.py: F16 2.5e-4 (trained) to 8.7e-4
# (random weights), Q8_0 7.8e-3 (trained) to 2.5e-2 (random weights).
PARITY_TOL_FILE = {"F32": 0.0, "F16": 1e-2, "BF16": 5e-2}
PARITY_TOL_QUANTIZED = 5e-2


def file_parity_tolerance(path: str | os.PathLike) -> float:
  """The parity tolerance floor of llama.cpp running GGUF file `path`: that
  of its least precise 2-D weight type (PARITY_TOL_FILE, else quantized)."""
  from specjax.formats import gguf as gguf_file  # pylint: disable=import-outside-toplevel
  reader = gguf_file.open_reader(path)
  types = {t.tensor_type.name for t in reader.tensors if len(t.shape) > 1}
  return max((PARITY_TOL_FILE.get(t, PARITY_TOL_QUANTIZED) for t in types), default=0.0)
