"""Batch scaling across backends: XLA vs PyTorch vs llama.cpp, same weights.

The seed thread's root cause was batch scaling: llama.cpp's cost to verify N
tokens grew almost linearly in N. This module measures how one forward over N
new tokens scales on each backend, on the same model, the same weights and
the same machine, in the same run:

  T(N)   median wall seconds of one forward over N new tokens per row, batch
         B, all B N logits computed, against a KV cache already holding C
         tokens per row (rolled back to C before every call, inside the
         timed call, as bench's pp test does).

Backends (each holds the weights of one specjax `params` tree):
  xla            specjax's jitted `forward_step`, dispatched from the host per
                 call (bench's pp test). Pays Python dispatch, as torch and
                 llama.cpp do: the per-call comparison.
  xla-loop       `bench.CostProbe`: k forwards inside one jitted loop, no
                 dispatch (what the on-device speculative loop pays; the
                 cost the sweep uses). Batch 1 only.
  torch          HF `LlamaForCausalLM` from `hf.to_torch_model` (the one
                 conversion), eager, a `DynamicCache` cropped back to C.
  torch-compile  the same model, `torch.compile`d, over a `StaticCache` of
                 the XLA cache's capacity. Skipped with a note where compile
                 fails.
  llama.cpp      llama-cpp-python over a GGUF file written from the same
                 params (`write_gguf`), one `llama_decode` of B N tokens with
                 every logit requested. Unavailable with a note where the
                 package is missing.

Every backend is timed by `timing.measure` (the one method) through a Python
callable; for every N the backends alternate. Compile and first-call time is
kept out of every timing and reported apart. Before any timing, every
backend's logits for the timed call are checked against xla's; a mismatch
stops the run (`ParityError`).

Definitions (the one place):
  ratio(N)    T(N) / T(1), same backend, model, dtype, C and B.
  tps         B N / T(N), tokens per second of the call.
  flat region where ratio(N) <= FLAT_LIMIT; a backend "leaves" it at the
              smallest measured N with ratio(N) > FLAT_LIMIT.
  cliff       consecutive measured N_prev < N with T(N) / T(N_prev) >
              max(CLIFF_STEP, N / N_prev): a jump of more than CLIFF_STEP that
              is also worse than linear in N (so doubling N in the linear
              regime, 16 -> 32, is no cliff).
  speedup     what the backend's curve allows at (alpha, gamma):
              theory.speedup_from_curve(alpha, gamma, c T(1), curve), c the
              draft/target cost ratio (configured, or T_draft(1) / T(1)
              measured on xla).
"""

from __future__ import annotations

import csv
import dataclasses
import importlib.metadata
import inspect
import json
import os
import re
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from specjax import bench, checkpoint, hf, theory, timing
from specjax import config as config_lib
from specjax import steps
from specjax.config import ModelConfig
from specjax.errors import ConfigError, SpecjaxError

Record = dict[str, Any]
BACKENDS = ("xla", "xla-loop", "torch", "torch-compile", "llama.cpp")
FLAT_LIMIT = 1.25  # T(N)/T(1) above this: out of the flat region
CLIFF_STEP = 1.5   # T(N)/T(N_prev) above this and above N/N_prev: a cliff
SUMMARY_NS = (2, 4, 8, 16, 64)
# Parity: max |logit - xla logit| / max |xla logit|, per compute dtype.
PARITY_TOL = {"float32": 1e-4, "bfloat16": 5e-2, "float16": 1e-2}
PARITY_TOL_LLAMACPP_F32 = 1e-3  # its own kernels and accumulation order
CSV_COLUMNS = ("model", "dtype", "context", "batch", "backend", "n_tokens",
               "median_ms", "std_ms", "min_ms", "ratio", "tps", "reps",
               "compile_s", "first_call_s", "cpu_util", "capacity", "threads",
               "load_1m")


class ParityError(SpecjaxError):
  """Two backends holding the same weights compute different logits."""


class Unavailable(Exception):
  """A backend cannot run here; the comparison goes on without it."""


def _first_line(e: BaseException) -> str:
  text = (str(e).strip().splitlines() or [type(e).__name__])[0]
  return f"{type(e).__name__}: {text}"[:300]


def xla_threads() -> int:
  """Threads XLA:CPU computes with: its Eigen pool spans every core unless
  XLA_FLAGS turns multi-threaded Eigen off."""
  if "--xla_cpu_multi_thread_eigen=false" in os.environ.get("XLA_FLAGS", ""):
    return 1
  return os.cpu_count() or 1

# ---------------------------------------------------------------- parity


def parity_error(ref: np.ndarray, other: np.ndarray) -> float:
  """max |other - ref| / max |ref|: the logit error, relative to their scale."""
  ref, other = np.asarray(ref, np.float32), np.asarray(other, np.float32)
  if ref.shape != other.shape:
    return float("inf")
  return float(np.max(np.abs(other - ref)) / max(float(np.max(np.abs(ref))), 1e-30))


def parity_tolerance(backend: str, dtype: str) -> float:
  if backend == "llama.cpp" and dtype == "float32":
    return PARITY_TOL_LLAMACPP_F32
  return PARITY_TOL[dtype]


def check_parity(ref: np.ndarray, other: np.ndarray, tol: float,
                 what: str) -> float:
  """Returns the parity error, or raises ParityError naming `what` and both
  numbers when it exceeds `tol` (or the shapes differ)."""
  err = parity_error(ref, other)
  if not err <= tol:
    shapes = ("" if np.shape(ref) == np.shape(other)
              else f" (shapes {np.shape(other)} vs {np.shape(ref)})")
    raise ParityError(f"parity check failed: {what}: max |Δlogit| / max "
                      f"|logit| = {err:.3g} > tolerance {tol:g}{shapes}: the "
                      f"backends do not compute the same model (weights or "
                      f"their conversion differ); stopping")
  return err

# ---------------------------------------------------------------- backends


@dataclasses.dataclass
class Sample:
  """One backend's measurement of one point (in one round)."""
  timing: timing.Timing
  first_call_s: float | None  # wall s of the first (warm-up) call at this shape
  cpu_util: float             # process CPU s / wall s over the timed repetitions


class _CpuUse:
  """Process CPU seconds over wall seconds inside a `with` block: the cores a
  backend kept busy (spinning threads count)."""

  def __enter__(self):
    self.p0, self.w0 = time.process_time(), time.perf_counter()
    return self

  def __exit__(self, *exc):
    self.util = (time.process_time() - self.p0) / max(time.perf_counter() - self.w0, 1e-9)
    return False


class Backend:
  """One way to run the model. `prepare` fills a new cache of `capacity`
  slots per row with context [B, C] (calls will add at most `max_n` tokens per
  row); `runner(tokens [B, N])` is the timed call (roll back to C, one
  forward); `logits` runs the same call and returns its logits [B, N, V]."""
  name = "?"
  max_batch = 1 << 30
  parity = True  # checked against xla before timing
  threads = 1

  def prepare(self, context: np.ndarray, capacity: int, max_n: int) -> None:
    raise NotImplementedError

  def runner(self, tokens: np.ndarray) -> Callable[[], Any]:
    raise NotImplementedError

  def logits(self, tokens: np.ndarray) -> np.ndarray:
    raise NotImplementedError

  def measure(self, tokens: np.ndarray, reps: int, first: bool) -> Sample:
    """timing.measure of the call after one untimed warm-up call; that
    call's wall seconds when it is the `first` at this shape.

    The warm-up is timed here because JAX's compile events see XLA only:
    its wall time minus the median is torch.compile's or llama.cpp's
    first-call cost. Later rounds warm up too: the first call after
    another backend ran meets that backend's thread pool still spinning.
    """
    run = self.runner(tokens)
    with timing.CompileWatch() as cw:
      warm_s = timing.timed(run)[1]
    with _CpuUse() as cpu:
      t = timing.measure(run, reps=reps, warmup=0)
    return Sample(dataclasses.replace(t, compile_s=cw.seconds, n_compiles=cw.count),
                  warm_s if first else None, cpu.util)

  def close(self) -> None:
    pass


class XlaBackend(Backend):
  """specjax's forward_step, one host-dispatched call per forward."""
  name = "xla"

  def __init__(self, cfg: ModelConfig, params):
    self.m, self.threads = steps.Model(cfg, params), xla_threads()

  def prepare(self, context, capacity, max_n):
    b, c = context.shape
    self.capacity = capacity
    cache = self.m.new_cache(b, capacity)
    self.holder = [timing.block(self.m.prefill(context.tolist(), cache)[1])]
    self.depth = np.full((b,), c, np.int32)

  def runner(self, tokens):
    return bench.pp_runner(self.m, self.holder, jnp.asarray(tokens, jnp.int32), self.depth)

  def logits(self, tokens):
    return np.asarray(self.runner(tokens)(), np.float32)


class XlaLoopBackend(Backend):
  """bench.CostProbe: k forwards inside one jitted loop, time per forward.
  Same model code as xla, so it is not checked for parity separately."""
  name = "xla-loop"
  max_batch = 1
  parity = False

  def __init__(self, xla: XlaBackend, k: int, seed: int):
    self.xla, self.k, self.seed, self.threads = xla, k, seed, xla.threads

  def prepare(self, context, capacity, max_n):
    # The probe fills its own cache with C random tokens (values do not
    # change the cost).
    self.probe = bench.CostProbe(self.xla.m, capacity, context.shape[1],
                                 self.seed, self.k)

  def measure(self, tokens, reps, first):
    # The probe warms up (and compiles) on a new N only; each repetition is
    # k forwards, so a thread-pool switch is spread over k.
    n, warm = tokens.shape[1], None
    if n not in self.probe.tokens:  # compile and warm up outside _CpuUse
      warm = self.probe.times([n], reps=1)[n]
    with _CpuUse() as cpu:
      t = self.probe.times([n], reps=reps)[n]
    if warm:
      t = dataclasses.replace(t, compile_s=warm.compile_s, n_compiles=warm.n_compiles)
    return Sample(t, None, cpu.util)

  def close(self):
    self.probe = None


def _torch():
  try:
    import torch  # pylint: disable=import-outside-toplevel
    import transformers  # pylint: disable=import-outside-toplevel,unused-import
  except ImportError as e:
    raise Unavailable(f"torch/transformers not installed ({e.name}); "
                      f"pip install -e '.[torch]'") from None
  return torch


def _crop_to(cache, length: int) -> None:
  """Rolls an HF cache back to `length` tokens. A negative crop removes that
  many tokens on transformers 4 and 5 alike (5 rejects absolute lengths)."""
  extra = int(cache.get_seq_length()) - length
  if extra > 0:
    cache.crop(-extra)


class TorchBackend(Backend):
  """HF LlamaForCausalLM holding the same params, eager, DynamicCache."""
  name = "torch"

  def __init__(self, cfg: ModelConfig, params, threads: int, attention: str,
               model=None):
    torch = self.torch = _torch()
    if jax.default_backend() != "cpu" and not torch.cuda.is_available():
      raise Unavailable(f"XLA runs on {jax.default_backend()} but this torch "
                        f"has no CUDA: no like-for-like comparison")
    self.device = "cpu" if jax.default_backend() == "cpu" else "cuda"
    self.threads = threads
    torch.set_num_threads(threads)
    if model is None:  # torch-compile shares the eager backend's model
      model = hf.to_torch_model(cfg, params).to(self.device)
      if hasattr(model, "set_attn_implementation"):
        model.set_attn_implementation(attention)
      else:  # transformers < 4.48
        model.config._attn_implementation = attention  # pylint: disable=protected-access
    self.model = model
    names = inspect.signature(self.model.forward).parameters
    # transformers >= 5.2x names it `cache`; older ones `past_key_values`.
    self.cache_kw = "cache" if "cache" in names else "past_key_values"
    self.fwd = self.model.forward

  def new_cache(self, capacity: int):
    from transformers import DynamicCache  # pylint: disable=import-outside-toplevel
    try:
      return DynamicCache(config=self.model.config)
    except TypeError:
      return DynamicCache()

  def _call(self, fn, ids, cache):
    with self.torch.inference_mode():
      return fn(input_ids=ids, use_cache=True, **{self.cache_kw: cache}).logits

  def prepare(self, context, capacity, max_n):
    self.depth, self.capacity = context.shape[1], capacity
    self.cache = self.new_cache(capacity)
    ids = self.torch.from_numpy(context.astype(np.int64)).to(self.device)
    self._call(self.model.forward, ids, self.cache)  # prefill: never compiled

  def runner(self, tokens):
    ids = self.torch.from_numpy(np.asarray(tokens, np.int64)).to(self.device)
    sync = self.torch.cuda.synchronize if self.device == "cuda" else (lambda: None)

    def run():
      _crop_to(self.cache, self.depth)
      out = self._call(self.fwd, ids, self.cache)
      sync()
      return out
    return run

  def logits(self, tokens):
    return self.runner(tokens)().float().cpu().numpy()


class TorchCompileBackend(TorchBackend):
  """The torch model's forward under torch.compile, over a StaticCache of
  `capacity` slots (attention spans all of them, as in XLA's cache)."""
  name = "torch-compile"

  def __init__(self, cfg, params, threads, attention, dynamic: bool | None,
               model=None):
    super().__init__(cfg, params, threads, attention, model)
    torch = self.torch
    if not hasattr(torch, "compile"):
      raise Unavailable(f"torch {torch.__version__} has no torch.compile")
    # Every (N, B, cache) may compile a graph: allow them all.
    for limit in ("recompile_limit", "cache_size_limit"):
      if hasattr(torch._dynamo.config, limit):  # pylint: disable=protected-access
        setattr(torch._dynamo.config, limit, 256)  # pylint: disable=protected-access
    self.fwd = torch.compile(self.model.forward, dynamic=dynamic)

  def new_cache(self, capacity):
    from transformers import StaticCache  # pylint: disable=import-outside-toplevel
    return StaticCache(config=self.model.config, max_cache_len=capacity)


_LOG_CALLBACK = None  # keeps llama.cpp's (silencing) log callback alive
# The C API LlamaCppBackend drives (llama.cpp of late 2025 and after).
_LLAMA_API = ("llama_model_load_from_file", "llama_init_from_model",
              "llama_get_memory", "llama_memory_seq_rm", "llama_batch_init",
              "llama_decode", "llama_get_logits", "llama_model_free")


def _llama_cpp():
  try:
    import llama_cpp  # pylint: disable=import-outside-toplevel
    import gguf  # pylint: disable=import-outside-toplevel,unused-import
  except ImportError as e:
    raise Unavailable(f"{e.name} is not installed: pip install -e "
                      f"'.[llamacpp]' (builds llama.cpp from source)") from None
  except OSError as e:  # the package is there but its shared library is not
    raise Unavailable(f"llama-cpp-python cannot load llama.cpp: "
                      f"{_first_line(e)}") from None
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
_FLASH_ATTN = {"auto": -1, "off": 0, "on": 1}


class LlamaCppBackend(Backend):
  """llama.cpp (through llama-cpp-python's C API) over a GGUF file of the
  same params: one llama_decode of B x N tokens, every logit requested, the
  KV cache (in the model's dtype) cut back to C before every call."""
  name = "llama.cpp"

  def __init__(self, cfg: ModelConfig, params, threads: int,
               flash_attn: str = "off"):
    if flash_attn not in _FLASH_ATTN:
      raise ConfigError(f"llama.cpp flash_attn must be one of "
                        f"{', '.join(_FLASH_ATTN)}, got {flash_attn!r}")
    self.flash_attn = flash_attn
    ll = self.ll = _llama_cpp()
    if jax.default_backend() != "cpu" and not ll.llama_supports_gpu_offload():
      raise Unavailable(f"this llama-cpp-python build is CPU-only and XLA "
                        f"runs on {jax.default_backend()}")
    self.cfg, self.threads = cfg, threads
    self.model, self.ctx, self.batches = None, None, []
    self.folder = tempfile.mkdtemp(prefix="specjax_gguf_")
    try:
      self.path = write_gguf(Path(self.folder) / f"{cfg.name}-{cfg.dtype}.gguf",
                             cfg, params)
      mp = ll.llama_model_default_params()
      mp.n_gpu_layers = -1 if jax.default_backend() != "cpu" else 0
      self.model = ll.llama_model_load_from_file(str(self.path).encode(), mp)
      if not self.model:
        raise Unavailable(f"llama.cpp could not load {self.path}")
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
    cp.flash_attn_type = _FLASH_ATTN[self.flash_attn]
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

  def prepare(self, context, capacity, max_n):
    b, c = context.shape
    chunk = max(1, min(c, 512 // b))  # prefill columns per llama_decode
    self._new_context(b, capacity, b * max(chunk, max_n))
    self.depth, self.mem = c, self.ll.llama_get_memory(self.ctx)
    for s in range(0, c, chunk):
      self._decode(self._batch(context[:, s:s + chunk], s, False))

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
    shutil.rmtree(self.folder, ignore_errors=True)

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


def write_gguf(path: str | os.PathLike, cfg: ModelConfig, params) -> Path:
  """Writes `params` as a llama.cpp GGUF file (llama architecture): weights
  in cfg.param_dtype (norms f32, as llama.cpp's converter keeps them).

  Raises:
    ConfigError: a feature this writer does not map (llama3 RoPE scaling).
  """
  import gguf  # pylint: disable=import-outside-toplevel
  if cfg.rope_scaling is not None:
    raise ConfigError(f"{cfg.name}: write_gguf does not map llama3 RoPE scaling")
  path = Path(path)
  path.parent.mkdir(parents=True, exist_ok=True)
  w = gguf.GGUFWriter(str(path), "llama")
  w.add_name(cfg.name)
  w.add_context_length(cfg.max_seq_len)
  w.add_embedding_length(cfg.dim)
  w.add_block_count(cfg.n_layers)
  w.add_feed_forward_length(cfg.ffn_dim)
  w.add_head_count(cfg.n_heads)
  w.add_head_count_kv(cfg.n_kv_heads)
  w.add_key_length(cfg.d_head)
  w.add_value_length(cfg.d_head)
  w.add_rope_dimension_count(cfg.d_head)
  w.add_layer_norm_rms_eps(cfg.norm_eps)
  w.add_rope_freq_base(cfg.rope_theta)
  w.add_vocab_size(cfg.vocab_size)
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
    if arr.ndim == 1 or cfg.param_dtype == "float32":
      w.add_tensor(name, np.asarray(arr, np.float32))
    elif cfg.param_dtype == "float16":
      w.add_tensor(name, np.asarray(arr, np.float16))
    else:  # bf16: raw bytes, which gguf's own quantize lays out
      q = gguf.GGMLQuantizationType.BF16
      w.add_tensor(name, gguf.quants.quantize(np.asarray(arr, np.float32), q),
                   raw_dtype=q)
  w.write_header_to_file()
  w.write_kv_data_to_file()
  w.write_tensors_to_file()
  w.close()
  return path

# ---------------------------------------------------------------- the run


_NAME_FIELDS = ("models", "dtypes", "backends")
_INT_FIELDS = ("n_tokens", "contexts", "batches", "batch_n_tokens")


def settings(c):
  """A checked, normalised copy of the config: list fields as tuples, each
  element split on commas (`--config.backends=xla,torch` arrives as one
  string). Bad settings -> one ConfigError naming the field."""
  import ml_collections  # pylint: disable=import-outside-toplevel
  d = c.to_dict() if hasattr(c, "to_dict") else dict(c)
  for f in _NAME_FIELDS:
    v = [d[f]] if isinstance(d[f], str) else list(d[f])
    d[f] = tuple(x.strip() for s in v for x in str(s).split(",") if x.strip())
    if not d[f]:
      raise ConfigError(f"config.{f} is empty")
  for f in _INT_FIELDS:
    v = [d[f]] if isinstance(d[f], (str, int)) else list(d[f])
    d[f] = tuple(sorted(set(bench.parse_ints(",".join(map(str, v)), f"config.{f}"))))
  c = ml_collections.ConfigDict(d)
  unknown = [b for b in c.backends if b not in BACKENDS]
  if unknown or "xla" not in c.backends:
    raise ConfigError(f"config.backends must include 'xla' (the parity "
                      f"reference) and name only {', '.join(BACKENDS)}; got "
                      f"{list(c.backends)}")
  if 1 not in c.n_tokens or 1 not in c.batches:
    raise ConfigError("config.n_tokens and config.batches must include 1 "
                      "(T(1) is the base of every ratio)")
  if c.reps < 1 or c.rounds < 1 or c.loop_k < 1 or c.threads < 0:
    raise ConfigError("config.reps, config.rounds and config.loop_k must be "
                      ">= 1, config.threads >= 0")
  if not 0 < c.alpha < 1 or c.gamma < 1 or c.c < 0:
    raise ConfigError("need 0 < config.alpha < 1, config.gamma >= 1, config.c >= 0")
  choices = {"torch_attention": ("sdpa", "eager"),
             "compile_dynamic": ("auto", "true", "false"),
             "llamacpp_flash_attn": tuple(_FLASH_ATTN)}
  for field, allowed in choices.items():
    if str(c[field]).lower() not in allowed:
      raise ConfigError(f"config.{field} must be one of {', '.join(allowed)}, "
                        f"got {c[field]!r}")
  for dtype in c.dtypes:
    config_lib.canonical_dtype(dtype)
  return c


@dataclasses.dataclass
class _Run:
  """What the loops share: config, outputs, notes, environment."""
  c: Any
  workdir: str
  threads: int
  env: Record
  log: Callable[[str], None]
  records: list[Record] = dataclasses.field(default_factory=list)
  notes: dict[str, str] = dataclasses.field(default_factory=dict)
  parity: list[Record] = dataclasses.field(default_factory=list)
  costs: list[Record] = dataclasses.field(default_factory=list)

  def note(self, backend: str, text: str) -> None:
    if backend not in self.notes:
      self.notes[backend] = text
      self.log(f"{backend}: {text}")

  def emit(self, r: Record) -> None:
    self.records.append(r)
    bench.append_jsonl(os.path.join(self.workdir, "results.jsonl"), [r])


def _make_backends(run: _Run, cfg: ModelConfig, params) -> list[Backend]:
  """The configured backends for one model and dtype, xla first;
  unavailable ones become notes."""
  c, out = run.c, []
  xla = XlaBackend(cfg, params)
  eager: list[TorchBackend] = []  # torch-compile shares its model
  dynamic = {"auto": None, "true": True, "false": False}[str(c.compile_dynamic).lower()]
  makers = {
      "xla": lambda: xla,
      "xla-loop": lambda: XlaLoopBackend(xla, c.loop_k, c.seed),
      "torch": lambda: TorchBackend(cfg, params, run.threads, c.torch_attention),
      "torch-compile": lambda: TorchCompileBackend(
          cfg, params, run.threads, c.torch_attention, dynamic,
          eager[0].model if eager else None),
      "llama.cpp": lambda: LlamaCppBackend(cfg, params, run.threads,
                                           c.llamacpp_flash_attn),
  }
  for name in sorted(c.backends, key=BACKENDS.index):
    if run.notes.get(name, "").startswith(("unavailable", "skipped")):
      continue
    try:
      t0 = time.perf_counter()
      out.append(makers[name]())
      if name == "torch":
        eager.append(out[-1])
      run.log(f"{name}: ready for {cfg.name} {cfg.dtype} "
              f"({time.perf_counter() - t0:.1f} s setup)")
    except Unavailable as e:
      run.note(name, f"unavailable ({e})")
    except Exception as e:  # pylint: disable=broad-except
      if name != "llama.cpp" or isinstance(e, SpecjaxError):
        raise
      run.note(name, f"unavailable ({_first_line(e)})")
  return out


def _drop(run: _Run, backends: list[Backend], b: Backend, e: Exception,
          where: str) -> None:
  """torch-compile and llama.cpp failures end that backend, not the run."""
  if b.name not in ("torch-compile", "llama.cpp"):
    raise e
  run.note(b.name, f"skipped (failed {where}: {_first_line(e)})")
  backends.remove(b)
  b.close()


def _parity(run: _Run, backends: list[Backend], live: list[Backend],
            base: Record, tokens: np.ndarray) -> None:
  """Every parity backend's logits for the timed call against xla's.
  Raises ParityError on a mismatch; a backend that fails to run is dropped."""
  ref = live[0].logits(tokens)
  for b in live[1:]:
    if not b.parity:
      continue
    try:
      t0 = time.perf_counter()
      got = b.logits(tokens)
      call_s = time.perf_counter() - t0
    except Exception as e:  # pylint: disable=broad-except
      _drop(run, backends, b, e, "on its first call")
      continue
    tol = parity_tolerance(b.name, base["dtype"])
    what = (f"{b.name} vs xla, {base['model']} {base['dtype']}, context "
            f"{base['context']}, batch {base['batch']}, N {tokens.shape[1]}")
    try:
      err = check_parity(ref, got, tol, what)
    finally:
      run.parity.append({**base, "backend": b.name, "n_tokens": tokens.shape[1],
                         "parity_error": parity_error(ref, got), "tolerance": tol,
                         "call_s": call_s})


def _record(run: _Run, b: Backend, base: Record, shape: tuple[int, int],
            parts: list[Sample], t1: dict) -> Record:
  """One point from its rounds: times pooled; ratio against T(1) of the same
  backend and batch (N = 1 is measured first)."""
  bsz, n = shape
  t = timing.Timing(times=[x for p in parts for x in p.timing.times],
                    compile_s=sum(p.timing.compile_s for p in parts),
                    n_compiles=sum(p.timing.n_compiles for p in parts))
  if n == 1:
    t1[b.name] = t.median
  return {**base, "backend": b.name, "n_tokens": n, "batch": bsz,
          "times_s": t.times, **t.to_dict(), "first_call_s": parts[0].first_call_s,
          "cpu_util": float(np.mean([p.cpu_util for p in parts])),
          "ratio": t.median / t1[b.name] if b.name in t1 else None,
          "tps": bsz * n / t.median, "threads": b.threads,
          "load_avg": bench.load_avg(), "env": run.env}


def _measure_group(run: _Run, backends: list[Backend], base: Record,
                   context: np.ndarray, ns: Sequence[int],
                   rng: np.random.RandomState) -> None:
  """One (model, dtype, C, B): prepare, parity, then every N (ascending) with
  the backends alternating, their order rotating every round."""
  bsz, cap = context.shape[0], base["capacity"]
  live = []
  for b in [b for b in backends if b.max_batch >= bsz]:
    try:
      b.prepare(context, cap, max(ns))
      live.append(b)
    except Exception as e:  # pylint: disable=broad-except
      _drop(run, backends, b, e, "preparing its cache")
  par_n = max(n for n in ns if n <= 8)
  _parity(run, backends, live, base, rng.randint(0, base["vocab"], (bsz, par_n)))
  live = [b for b in live if b in backends]
  t1: dict = {}
  for n in sorted(ns):
    tokens = rng.randint(0, base["vocab"], (bsz, n))
    got: dict[Backend, list] = {}
    for rnd in range(run.c.rounds):
      k = rnd % len(live)
      for b in live[k:] + live[:k]:
        if b not in backends:
          continue
        try:
          got.setdefault(b, []).append(b.measure(tokens, run.c.reps, rnd == 0))
        except Exception as e:  # pylint: disable=broad-except
          _drop(run, backends, b, e, f"at N={n}, B={bsz}")
    for b in live:
      if b in got and b in backends:
        r = _record(run, b, base, tokens.shape, got[b], t1)
        run.emit(r)
        run.log(_progress(r))


def _progress(r: Record) -> str:
  ratio = "" if r["ratio"] is None else f", T(N)/T(1) {r['ratio']:.2f}"
  return (f"{r['model']} {r['dtype']} C={r['context']} B={r['batch']} "
          f"N={r['n_tokens']:>2} {r['backend']:<13} T {1e3 * r['median_s']:8.2f} ms"
          f"{ratio}, {r['tps']:.1f} t/s, CPU {r['cpu_util']:.2f} cores")


def _draft_cost(run: _Run, dtype: str, context: int, capacity: int) -> float | None:
  """T_draft(1) of config.draft on xla (per call), same context and
  capacity, seconds; None when config.c is given."""
  c = run.c
  if c.c > 0 or not c.draft:
    return None
  cfg, params, _ = checkpoint.load_model(c.draft, dtype=dtype, seed=c.seed + 1)
  xla = XlaBackend(cfg, params)
  rng = np.random.RandomState(c.seed + 1)
  xla.prepare(rng.randint(0, cfg.vocab_size, (1, context)), capacity, 1)
  t = xla.measure(rng.randint(0, cfg.vocab_size, (1, 1)), c.reps * c.rounds, True).timing
  run.log(f"draft {cfg.name} {dtype} C={context}: T(1) {1e3 * t.median:.2f} ms (xla)")
  return t.median


def _model_run(run: _Run, spec: str, dtype: str, rng) -> None:
  """Every context and batch size for one model and dtype."""
  c = run.c
  cfg, params, _ = checkpoint.load_model(spec, dtype=dtype, seed=c.seed)
  max_n = max(max(c.n_tokens), max(c.batch_n_tokens))
  if max(c.contexts) + max_n > cfg.max_seq_len:
    raise ConfigError(f"{cfg.name}: context + largest N = "
                      f"{max(c.contexts) + max_n} exceeds max_seq_len "
                      f"{cfg.max_seq_len}")
  backends = _make_backends(run, cfg, params)
  try:
    for context in c.contexts:
      capacity = bench.capacity_for(context + max_n)
      base = {"kind": "timing", "model": cfg.name, "model_spec": spec,
              "dtype": cfg.dtype, "context": context, "capacity": capacity,
              "vocab": cfg.vocab_size, "n_params": cfg.num_params()}
      run.costs.append({**base, "draft": c.draft,
                        "t_draft_s": _draft_cost(run, cfg.dtype, context, capacity)})
      for bsz in c.batches:
        ns = c.n_tokens if bsz == 1 else c.batch_n_tokens
        ctx_tokens = rng.randint(0, cfg.vocab_size, (bsz, context))
        _measure_group(run, backends, {**base, "batch": bsz}, ctx_tokens, ns, rng)
  finally:
    for b in backends:
      b.close()


def run_batch_scaling(c, workdir: str, log: Callable[[str], None] | None = None
                      ) -> list[Record]:
  """The comparison: every model x dtype x context x batch, every backend,
  parity first; writes results.jsonl, results.csv, config.json,
  scaling.png, decode.png and summary.md into `workdir`.

  Args:
    c: the config (configs/batch_scaling.py).
    log: progress lines (default: stderr).
  Returns:
    The timing records.
  Raises:
    ConfigError: bad settings. ParityError: two backends disagree.
  """
  c = settings(c)
  os.makedirs(workdir, exist_ok=True)
  jsonl = os.path.join(workdir, "results.jsonl")
  if os.path.exists(jsonl):
    os.remove(jsonl)  # one run, one file: ratios only mean something within it
  log = log or (lambda s: print(s, file=sys.stderr, flush=True))
  threads = c.threads or xla_threads()
  run = _Run(c, workdir, threads, _environment(threads), log)
  if threads != xla_threads():
    run.note("threads", f"torch and llama.cpp use {threads} threads, XLA "
             f"{xla_threads()} (set XLA_FLAGS to change XLA's)")
  with open(os.path.join(workdir, "config.json"), "w") as f:
    json.dump(c.to_dict(), f, indent=1, default=list)
  rng = np.random.RandomState(c.seed)
  load_start = bench.load_avg()
  for spec in c.models:
    for dtype in c.dtypes:
      _model_run(run, spec, config_lib.canonical_dtype(dtype), rng)
  run.env["load_avg_start"], run.env["load_avg_end"] = load_start, bench.load_avg()
  write_outputs(run)
  return run.records


def _environment(threads: int) -> Record:
  env = {**timing.environment(), "threads": threads, "xla_threads": xla_threads()}
  for key, dist in (("torch", "torch"), ("transformers", "transformers"),
                    ("llama_cpp", "llama-cpp-python"), ("gguf", "gguf")):
    try:
      env[key] = importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
      env[key] = None
  return env

# ---------------------------------------------------------------- outputs


def scaling_report(curve: dict[int, float]) -> tuple[int | None, list[tuple[int, int, float]]]:
  """(smallest N with T(N)/T(1) > FLAT_LIMIT or None, cliffs as
  (N_prev, N, T(N)/T(N_prev)) with that step > max(CLIFF_STEP, N/N_prev))."""
  ns = sorted(curve)
  leave = next((n for n in ns if curve[n] / curve[ns[0]] > FLAT_LIMIT), None)
  cliffs = [(a, b, curve[b] / curve[a]) for a, b in zip(ns, ns[1:])
            if curve[b] / curve[a] > max(CLIFF_STEP, b / a)]
  return leave, cliffs


def allowed_speedup(curve: dict[int, float], alpha: float, gamma: int,
                    c: float) -> float | None:
  """theory.speedup_from_curve at (alpha, gamma), T_draft(1) = c T(1);
  None when the curve does not reach gamma + 1."""
  if not curve or 1 not in curve or max(curve) < gamma + 1:
    return None
  return float(theory.speedup_from_curve(alpha, gamma, c * curve[1], curve))


def _groups(records: Sequence[Record], batch: int = 1) -> dict[tuple, dict[str, dict[int, float]]]:
  """{(model, dtype, context): {backend: {N: T(N) s}}} at one batch size."""
  out: dict[tuple, dict[str, dict[int, float]]] = {}
  for r in records:
    if r["batch"] == batch:
      key = (r["model"], r["dtype"], r["context"])
      out.setdefault(key, {}).setdefault(r["backend"], {})[r["n_tokens"]] = r["median_s"]
  return out


def write_csv(path: str, records: Sequence[Record]) -> None:
  with open(path, "w", newline="") as f:
    w = csv.writer(f)
    w.writerow(CSV_COLUMNS)
    for r in records:
      w.writerow([r["model"], r["dtype"], r["context"], r["batch"], r["backend"],
                  r["n_tokens"], f"{1e3 * r['median_s']:.4f}",
                  f"{1e3 * r['std_s']:.4f}", f"{1e3 * r['min_s']:.4f}",
                  "" if r["ratio"] is None else f"{r['ratio']:.4f}",
                  f"{r['tps']:.3f}", r["reps"], f"{r['compile_s']:.3f}",
                  "" if r["first_call_s"] is None else f"{r['first_call_s']:.3f}",
                  f"{r['cpu_util']:.2f}", r["capacity"], r["threads"],
                  "" if not r["load_avg"] else f"{r['load_avg'][0]:.2f}"])


def _plt():
  import matplotlib  # pylint: disable=import-outside-toplevel
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt  # pylint: disable=import-outside-toplevel
  return plt


def plot_scaling(path: str, records: Sequence[Record]) -> None:
  """T(N)/T(1) against N (B = 1), a panel per model/dtype/context, a line per
  backend, with the linear-cost line N and the ideal flat line 1."""
  plt = _plt()
  from matplotlib import ticker  # pylint: disable=import-outside-toplevel
  groups = _groups(records)
  cols = min(2, len(groups)) or 1
  rows = -(-len(groups) // cols) or 1
  fig, axes = plt.subplots(rows, cols, figsize=(6.5 * cols, 4.6 * rows), squeeze=False)
  for ax, ((model, dtype, ctx), curves) in zip(axes.flat, groups.items()):
    n_all = sorted({n for cv in curves.values() for n in cv})
    for name, cv in curves.items():
      ns = sorted(cv)
      ax.plot(ns, [cv[n] / cv[ns[0]] for n in ns], "o-", ms=4, label=name)
    ax.plot(n_all, n_all, "--", color="gray", lw=1, label="linear cost: N")
    ax.axhline(1.0, color="gray", ls=":", lw=1, label="ideal: flat (1)")
    ax.axhline(FLAT_LIMIT, color="gray", ls="-", lw=0.5, alpha=0.5)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log", base=2)
    for axis in (ax.xaxis, ax.yaxis):
      axis.set_major_formatter(ticker.FormatStrFormatter("%g"))
    ax.set_xlabel("N new tokens in one forward")
    ax.set_ylabel("T(N) / T(1)")
    ax.set_title(f"{model} {dtype}, context {ctx}, batch 1", fontsize=10)
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=7)
  for ax in list(axes.flat)[len(groups):]:
    ax.axis("off")
  fig.tight_layout()
  fig.savefig(path, dpi=110)
  plt.close(fig)


def plot_decode(path: str, records: Sequence[Record]) -> None:
  """T(1) (batch 1) per backend, grouped by model/dtype/context."""
  plt = _plt()
  groups = _groups(records)
  names = [b for b in BACKENDS if any(b in g for g in groups.values())]
  fig, ax = plt.subplots(figsize=(max(6.0, 2.2 * len(groups) + 2), 4.5))
  width = 0.8 / max(1, len(names))
  for i, name in enumerate(names):
    xs = [j + (i - (len(names) - 1) / 2) * width for j in range(len(groups))]
    ys = [1e3 * g[name][1] if name in g and 1 in g[name] else 0.0
          for g in groups.values()]
    bars = ax.bar(xs, ys, width, label=name)
    ax.bar_label(bars, fmt="%.1f", fontsize=6)
  ax.set_xticks(range(len(groups)))
  ax.set_xticklabels([f"{m}\n{d}, C={c}" for m, d, c in groups], fontsize=8)
  ax.set_ylabel("T(1) ms (one decode step, batch 1)")
  ax.set_title("Decode step time per backend (lower is better)")
  ax.legend(fontsize=8)
  ax.grid(alpha=0.3, axis="y")
  fig.tight_layout()
  fig.savefig(path, dpi=110)
  plt.close(fig)


def _fmt(x, spec=".2f") -> str:
  return "-" if x is None else format(x, spec)


def _scaling_table(curves: dict[str, dict[int, float]], c, cost: Record,
                   util: dict[str, float], threads: dict[str, int]
                   ) -> tuple[str, list[str]]:
  """The per-group table and its sentences (flat region, cliffs). A T(1)
  measured while the process got under 80% of its threads' CPU time is
  marked: a backend starved by other work inflates T(1) and deflates every
  ratio (XLA:CPU may also simply not use its whole pool)."""
  ns = [n for n in SUMMARY_NS if any(n in cv for cv in curves.values())]
  t_d = cost.get("t_draft_s")
  rows, lines = [], []
  for name in [b for b in BACKENDS if b in curves]:
    cv = curves[name]
    if 1 not in cv:
      continue
    c_ratio = c.c or (t_d / curves["xla"][1] if t_d and "xla" in curves else None)
    leave, cliffs = scaling_report(cv)
    sp = allowed_speedup(cv, c.alpha, c.gamma, c_ratio) if c_ratio else None
    cpu = util.get(name)
    low = cpu is not None and cpu < 0.8 * min(threads.get(name, 1), os.cpu_count() or 1)
    rows.append([name, f"{1e3 * cv[1]:.2f}", f"{1 / cv[1]:.1f}",
                 _fmt(cpu) + (" (<0.8×threads)" if low else "")]
                + [_fmt(cv[n] / cv[1]) if n in cv else "-" for n in ns]
                + [str(leave) if leave else f"> {max(cv)}",
                   ", ".join(f"{a}→{b} ×{s:.2f}" for a, b, s in cliffs) or "none",
                   _fmt(sp, ".2f")])
    lines.append(f"- {name}: " + (f"leaves the flat region at N = {leave} "
                 f"(T({leave})/T(1) = {cv[leave] / cv[1]:.2f})" if leave else
                 f"stays flat up to N = {max(cv)}") + "; " +
                 ("cliffs at " + ", ".join(f"N {a}→{b} (×{s:.2f})" for a, b, s in cliffs)
                  if cliffs else "no cliff") + ".")
  cols = (["backend", "T(1) ms", "t/s", "CPU cores"] + [f"T({n})/T(1)" for n in ns]
          + ["leaves flat at N", "cliffs", f"speedup α{c.alpha:g} γ{c.gamma}"])
  table = bench.markdown_table(cols, rows, [False] + [True] * (len(cols) - 4) + [True, False, True])
  return table, lines


def summary_markdown(run: _Run) -> str:
  c, env, records = run.c, run.env, run.records
  speedup_c = (f"{c.c:g} (configured)" if c.c else
               f"T_draft(1)/T_target(1), {c.draft} over the target, both on xla")
  out = ["# Batch scaling: XLA vs PyTorch vs llama.cpp", "",
         f"Host {env['host']} ({env['cpu_count']} cores, backend {env['backend']}, "
         f"{env['device_kind']}); threads: XLA {env['xla_threads']} (its Eigen pool), "
         f"torch and llama.cpp {env['threads']}. Load average (1, 5, 15 min) at start "
         f"{_fmt_load(env.get('load_avg_start'))}, at end "
         f"{_fmt_load(env.get('load_avg_end'))}. jax {env['jax']}, torch {env['torch']}, "
         f"transformers {env['transformers']}, llama-cpp-python {env['llama_cpp']}, "
         f"gguf {env['gguf']}; git {env['git_commit']}.", "",
         f"T(N): median of {c.reps * c.rounds} repetitions ({c.rounds} round(s), "
         f"backends alternating) of one forward over N new tokens per row, all logits "
         f"computed, after a context of C tokens (rolled back between calls). `xla` is "
         f"one host-dispatched call per forward, like torch and llama.cpp; `xla-loop` "
         f"runs {c.loop_k} forwards in one jitted loop (no dispatch) and reports the "
         f"time per forward. XLA and torch-compile attend over the whole cache capacity "
         f"(C + max N, rounded up to {bench.CAPACITY_ROUND}); torch eager and llama.cpp "
         f"over the C + N filled slots. `CPU cores`: process CPU seconds per wall "
         f"second during the timed calls at N = 1 (spinning threads count). The flat "
         f"region ends at the smallest N with T(N)/T(1) > {FLAT_LIMIT}; a cliff is a "
         f"step between measured N with T(N)/T(N_prev) > max({CLIFF_STEP}, N/N_prev) "
         f"(worse than linear). Speedup: what each backend's curve allows at "
         f"α {c.alpha:g}, γ {c.gamma} (theory.speedup_from_curve), with c = "
         f"{speedup_c}.", ""]
  out += _busy_warning(env, records)
  out += ["## Backends", ""]
  for name in c.backends:
    out.append(f"- {name}: {run.notes.get(name, 'measured')}")
  if "threads" in run.notes:
    out.append(f"- threads: {run.notes['threads']}")
  out += ["", "## Parity (max |Δlogit| / max |logit| against xla, before any timing)", ""]
  out.append(bench.markdown_table(
      ("model", "dtype", "C", "B", "N", "backend", "error", "tolerance", "call s"),
      [(p["model"], p["dtype"], str(p["context"]), str(p["batch"]), str(p["n_tokens"]),
        p["backend"], f"{p['parity_error']:.2e}", f"{p['tolerance']:g}",
        f"{p['call_s']:.2f}") for p in run.parity],
      (False, False, True, True, True, False, True, True, True)))
  out.append("\n`call s`: wall time of the parity call, which is each backend's "
             "first call at that shape (torch.compile compiles there).")
  costs = {(r["model"], r["dtype"], r["context"]): r for r in run.costs}
  for (model, dtype, ctx), curves in _groups(records).items():
    cost = costs.get((model, dtype, ctx), {})
    t1 = [r for r in records if r["batch"] == 1 and r["n_tokens"] == 1
          and (r["model"], r["dtype"], r["context"]) == (model, dtype, ctx)]
    table, lines = _scaling_table(curves, c, cost,
                                  {r["backend"]: r["cpu_util"] for r in t1},
                                  {r["backend"]: r["threads"] for r in t1})
    cap = cost.get("capacity", "?")
    c_txt = (f"c = {c.c:g}" if c.c else
             f"c = {cost['t_draft_s'] / curves['xla'][1]:.3f}" if cost.get("t_draft_s")
             and "xla" in curves else "c not measured")
    out += ["", f"## {model} {dtype}, context {ctx} (batch 1, cache capacity {cap}, {c_txt})",
            "", table, "", *lines]
  out += _batched_section(records) + _compile_section(records)
  return "\n".join(out) + "\n"


BUSY_LOAD = 0.5  # load average per core above which the summary warns


def _busy_warning(env: Record, records: Sequence[Record]) -> list[str]:
  """A warning when the machine was busy: timings then depend on what else
  ran. Fork-join thread pools (torch's and llama.cpp's OpenMP) wait at every
  op for a thread the scheduler may have parked, and slow down many-fold."""
  load = max((env.get(k) or [0.0])[0] for k in ("load_avg_start", "load_avg_end"))
  if load <= BUSY_LOAD * (env["cpu_count"] or 1):
    return []
  starved = [r for r in records if r["cpu_util"] < 0.8 * min(r["threads"], env["cpu_count"] or 1)]
  text = (f"**Warning: the machine was busy** (load average up to {load:.2f} on "
          f"{env['cpu_count']} cores): other work shares the cores, and "
          f"{len(starved)} of {len(records)} points got less than 80% of their "
          f"threads' CPU time (`cpu_util` in results.csv; `CPU cores` below).")
  if env["threads"] > 1:
    text += (f" With {env['threads']} threads, OpenMP backends (torch, llama.cpp) "
             f"lose a scheduler slice at every barrier when a core is taken, and can "
             f"run 10-50x slower than on an idle machine; on a shared machine compare "
             f"single-threaded: `XLA_FLAGS=--xla_cpu_multi_thread_eigen=false` and "
             f"`--config.threads=1`.")
  return [text, ""]


def _fmt_load(x) -> str:
  return "-" if not x else ", ".join(f"{v:.2f}" for v in x)


def _batched_section(records: Sequence[Record]) -> list[str]:
  rs = [r for r in records if r["batch"] > 1]
  if not rs:
    return []
  base = {(r["model"], r["dtype"], r["context"], r["backend"], r["n_tokens"]): r["median_s"]
          for r in records if r["batch"] == 1}
  rows = []
  for r in sorted(rs, key=lambda r: (r["model"], r["dtype"], r["context"],
                                     BACKENDS.index(r["backend"]), r["n_tokens"], r["batch"])):
    t_b1 = base.get((r["model"], r["dtype"], r["context"], r["backend"], r["n_tokens"]))
    rows.append([r["model"], r["dtype"], str(r["context"]), r["backend"], str(r["n_tokens"]),
                 str(r["batch"]), f"{1e3 * r['median_s']:.2f}", f"{r['tps']:.1f}",
                 _fmt(r["median_s"] / t_b1 if t_b1 else None)])
  return ["", "## Batched view (B rows of N new tokens each)", "",
          bench.markdown_table(("model", "dtype", "C", "backend", "N", "B", "T ms",
                                "t/s (B N / T)", "T / T(B=1)"), rows,
                               (False, False, True, False, True, True, True, True, True))]


def _compile_section(records: Sequence[Record]) -> list[str]:
  acc: dict[tuple, list[float]] = {}
  for r in records:
    a = acc.setdefault((r["model"], r["dtype"], r["backend"]), [0.0, 0.0])
    a[0] += r["compile_s"]
    if r["first_call_s"] is not None:
      a[1] += max(0.0, r["first_call_s"] - r["median_s"])
  rows = [[m, d, b, f"{x[0]:.1f}", f"{x[1]:.1f}"] for (m, d, b), x in acc.items()]
  return ["", "## Compile and first-call time (excluded from every timing)", "",
          "compile s: JAX compile events (XLA only). first-call s: warm-up call minus "
          "the median, summed over points (torch.compile's compile, llama.cpp's and "
          "torch's first-call costs; for xla it repeats the compile).", "",
          bench.markdown_table(("model", "dtype", "backend", "compile s", "first-call s"),
                               rows, (False, False, False, True, True))]


def write_outputs(run: _Run) -> str:
  """results.csv, scaling.png, decode.png, summary.md; returns the summary."""
  w = run.workdir
  write_csv(os.path.join(w, "results.csv"), run.records)
  if run.records:
    plot_scaling(os.path.join(w, "scaling.png"), run.records)
    plot_decode(os.path.join(w, "decode.png"), run.records)
  md = summary_markdown(run)
  with open(os.path.join(w, "summary.md"), "w") as f:
    f.write(md)
  with open(os.path.join(w, "parity.json"), "w") as f:
    json.dump(run.parity, f, indent=1)
  return md
