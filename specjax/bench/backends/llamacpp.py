"""llama.cpp backend: llama-cpp-python's C API over a GGUF file written from
the same params (`write_gguf`, the GGUF writer), or over the GGUF file the
model was loaded from (`gguf_path`: llama.cpp then runs exactly that file,
quantized or not). llama_cpp and gguf are imported on first use: this module
imports without them."""

from __future__ import annotations

import os
import re
import shutil
import tempfile
from pathlib import Path

import jax
import numpy as np

from specjax.formats import hf
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
        self.path = write_gguf(Path(self.folder) / f"{cfg.name}-{cfg.dtype}.gguf",
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

# ---------------------------------------------------------------- GGUF


def gguf_permute(w: np.ndarray, n_head: int) -> np.ndarray:
  """q/k rows from HF's rotate-half RoPE layout to llama.cpp's interleaved
  one: HF's convert script's `permute` (w [n_head * D, E])."""
  return (w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:])
          .swapaxes(1, 2).reshape(w.shape))


_GGUF_TOP = {"model.embed_tokens.weight": "token_embd.weight",
             "model.norm.weight": "output_norm.weight",
             "lm_head.weight": "output.weight"}
_GGUF_LAYER = {"input_layernorm": "attn_norm", "self_attn.q_proj": "attn_q",
               "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
               "self_attn.o_proj": "attn_output",
               "post_attention_layernorm": "ffn_norm",
               "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
               "mlp.down_proj": "ffn_down"}


def gguf_tensors(cfg: ModelConfig, params) -> dict[str, np.ndarray]:
  """{GGUF name: array, torch layout} from `hf.params_to_hf_state` (the one
  conversion), renamed, q/k rows permuted for llama.cpp's RoPE."""
  out = {}
  for name, arr in hf.params_to_hf_state(cfg, params).items():
    m = re.fullmatch(r"model\.layers\.(\d+)\.(.+)\.weight", name)
    if not m:
      out[_GGUF_TOP[name]] = arr
      continue
    part = m.group(2)
    if part == "self_attn.q_proj":
      arr = gguf_permute(arr, cfg.n_heads)
    elif part == "self_attn.k_proj":
      arr = gguf_permute(arr, cfg.n_kv_heads)
    out[f"blk.{m.group(1)}.{_GGUF_LAYER[part]}.weight"] = arr
  return out


def _gguf_vocab(n: int) -> tuple[list[str], list[float], list[int]]:
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
  toks, scores, types = _gguf_vocab(cfg.vocab_size)
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
