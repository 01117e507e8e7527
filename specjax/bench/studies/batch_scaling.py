"""Batch scaling across backends: XLA vs PyTorch vs llama.cpp, same weights.

The seed thread's root cause was batch scaling: llama.cpp's cost to verify N
tokens grew almost linearly in N. This measures T(N), the median wall
seconds of one forward over N new tokens per row at batch B (every logit
computed, against a cache holding `depth` tokens per row, rolled back before
every call), on every backend (bench/backends/), same model, weights,
machine and run, the backends alternating for every N; compile and first
calls kept apart. Every backend's logits are checked against xla's first (a
mismatch stops the run: `ParityError`); a GGUF file runs in llama.cpp as it
is and in the others dequantized (backends.llamacpp.file_parity_tolerance).
The report (ratio, tps, flat region, cliff, speedup: defined once in
docs/engines.md) is batch_scaling_report's.
"""

from __future__ import annotations

import dataclasses
import importlib.metadata
import os
import sys
import time
from typing import Any, Callable, Sequence

import numpy as np

from specjax.bench.studies import batch_scaling_report as report
from specjax.bench import tables
from specjax.formats import checkpoint
from specjax.formats import gguf as gguf_file
from specjax.metrics import timing
from specjax.model import kv_cache as kvc
from specjax.model import config as config_lib
from specjax import workdir as wd
from specjax.bench.backends import BACKENDS, llamacpp, pytorch
from specjax.bench.backends import xla as xla_lib
from specjax.bench.backends.base import (Backend, Sample, Unavailable, check_parity, first_line,
                                   parity_error, parity_tolerance)
from specjax.model.config import ModelConfig
from specjax.errors import ConfigError, SpecjaxError
from specjax.workdir import Record


_NAME_FIELDS = ("models", "dtypes", "backends")
_INT_FIELDS = ("n_tokens", "depths", "batches", "batch_n_tokens")


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
    d[f] = tuple(sorted(set(tables.parse_ints(",".join(map(str, v)), f"config.{f}"))))
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
             "llamacpp_flash_attn": tuple(llamacpp.FLASH_ATTN)}
  for field, allowed in choices.items():
    if str(c[field]).lower() not in allowed:
      raise ConfigError(f"config.{field} must be one of {', '.join(allowed)}, "
                        f"got {c[field]!r}")
  for dtype in c.dtypes:
    config_lib.canonical_dtype(dtype)
  return c


@dataclasses.dataclass
class Run:
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
    wd.append_jsonl(os.path.join(self.workdir, wd.RESULTS), [r])


def _make_backends(run: Run, cfg: ModelConfig, params,
                   gguf_path: str | None = None) -> list[Backend]:
  """The configured backends for one model and dtype, xla first;
  unavailable ones become notes. llama.cpp runs `gguf_path`, the file the
  model was loaded from, when there is one (else a file written from params)."""
  c, out = run.c, []
  xla = xla_lib.XlaBackend(cfg, params)
  eager: list[pytorch.TorchBackend] = []  # torch-compile shares its model
  dynamic = {"auto": None, "true": True, "false": False}[str(c.compile_dynamic).lower()]
  makers = {
      "xla": lambda: xla,
      "xla-loop": lambda: xla_lib.XlaLoopBackend(xla, c.loop_k, c.seed),
      "torch": lambda: pytorch.TorchBackend(cfg, params, run.threads, c.torch_attention),
      "torch-compile": lambda: pytorch.TorchCompileBackend(
          cfg, params, run.threads, c.torch_attention, dynamic,
          eager[0].model if eager else None),
      "llama.cpp": lambda: llamacpp.LlamaCppBackend(cfg, params, run.threads,
                                                    c.llamacpp_flash_attn, gguf_path),
  }
  for name in sorted(c.backends, key=BACKENDS.index):
    if run.notes.get(name, "").startswith(("unavailable", "skipped")):
      continue
    try:
      t0 = time.perf_counter()
      out.append(makers[name]())
      if name == "torch":
        eager.append(out[-1])
      on = f" on {gguf_path}" if name == "llama.cpp" and gguf_path else ""
      run.log(f"{name}: ready for {cfg.name} {cfg.dtype}{on} "
              f"({time.perf_counter() - t0:.1f} s setup)")
    except Unavailable as e:
      run.note(name, f"unavailable ({e})")
    except Exception as e:  # pylint: disable=broad-except
      if name != "llama.cpp" or isinstance(e, SpecjaxError):
        raise
      run.note(name, f"unavailable ({first_line(e)})")
  return out


def _drop(run: Run, backends: list[Backend], b: Backend, e: Exception,
          where: str) -> None:
  """torch-compile and llama.cpp failures end that backend, not the run."""
  if b.name not in ("torch-compile", "llama.cpp"):
    raise e
  run.note(b.name, f"skipped (failed {where}: {first_line(e)})")
  backends.remove(b)
  b.close()


def _parity(run: Run, backends: list[Backend], live: list[Backend],
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
    tol = max(parity_tolerance(b.name, base["dtype"]), getattr(b, "parity_tol", 0.0))
    what = (f"{b.name} vs xla, {base['model']} {base['dtype']}, depth "
            f"{base['depth']}, batch {base['batch']}, N {tokens.shape[1]}")
    try:
      err = check_parity(ref, got, tol, what)
    finally:
      run.parity.append({**base, "backend": b.name, "n_tokens": tokens.shape[1],
                         "parity_error": parity_error(ref, got), "tolerance": tol,
                         "call_s": call_s})


def _record(run: Run, b: Backend, base: Record, shape: tuple[int, int],
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
          "load_avg": wd.load_avg(), "env": run.env}


def _measure_group(run: Run, backends: list[Backend], base: Record,
                   prefix: np.ndarray, ns: Sequence[int],
                   rng: np.random.RandomState) -> None:
  """One (model, dtype, depth, B): prepare, parity, then every N (ascending)
  with the backends alternating, their order rotating every round."""
  bsz, cap = prefix.shape[0], base["capacity"]
  live = []
  for b in [b for b in backends if b.max_batch >= bsz]:
    try:
      b.prepare(prefix, cap, max(ns))
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
  return (f"{r['model']} {r['dtype']} depth={r['depth']} B={r['batch']} "
          f"N={r['n_tokens']:>2} {r['backend']:<13} T {1e3 * r['median_s']:8.2f} ms"
          f"{ratio}, {r['tps']:.1f} t/s, CPU {r['cpu_util']:.2f} cores")


def _draft_cost(run: Run, dtype: str, depth: int, capacity: int) -> float | None:
  """T_draft(1) of config.draft on xla (per call), same depth and capacity,
  seconds; None when config.c is given."""
  c = run.c
  if c.c > 0 or not c.draft:
    return None
  cfg, params, _ = checkpoint.load_model(c.draft, dtype=dtype, seed=c.seed + 1, role="draft")
  xla = xla_lib.XlaBackend(cfg, params)
  rng = np.random.RandomState(c.seed + 1)
  xla.prepare(rng.randint(0, cfg.vocab_size, (1, depth)), capacity, 1)
  t = xla.measure(rng.randint(0, cfg.vocab_size, (1, 1)), c.reps * c.rounds, True).timing
  run.log(f"draft {cfg.name} {dtype} depth={depth}: T(1) {1e3 * t.median:.2f} ms (xla)")
  return t.median


def _check_depths(c, cfg) -> int:
  """The largest N of the config; ConfigError if the deepest depth plus it
  does not fit the model's max_seq_len."""
  max_n = max(max(c.n_tokens), max(c.batch_n_tokens))
  if max(c.depths) + max_n > cfg.max_seq_len:
    raise ConfigError(f"{cfg.name}: depth + largest N = "
                      f"{max(c.depths) + max_n} exceeds max_seq_len "
                      f"{cfg.max_seq_len}")
  return max_n


def _model_run(run: Run, spec: str, dtype: str, rng) -> None:
  """Every depth and batch size for one model and dtype."""
  c = run.c
  cfg, params, _ = checkpoint.load_model(spec, dtype=dtype, seed=c.seed)
  max_n = _check_depths(c, cfg)
  backends = _make_backends(run, cfg, params,
                            spec if gguf_file.is_gguf_file(spec) else None)
  try:
    for depth in c.depths:
      capacity = kvc.round_capacity(depth + max_n)
      base = {"kind": "timing", "model": cfg.name, "model_spec": spec,
              "dtype": cfg.dtype, "depth": depth, "capacity": capacity,
              "vocab": cfg.vocab_size, "n_params": cfg.num_params()}
      run.costs.append({**base, "draft": c.draft,
                        "t_draft_s": _draft_cost(run, cfg.dtype, depth, capacity)})
      for bsz in c.batches:
        ns = c.n_tokens if bsz == 1 else c.batch_n_tokens
        prefix = rng.randint(0, cfg.vocab_size, (bsz, depth))
        _measure_group(run, backends, {**base, "batch": bsz}, prefix, ns, rng)
  finally:
    for b in backends:
      b.close()


def run_batch_scaling(c, workdir: str, log: Callable[[str], None] | None = None
                      ) -> list[Record]:
  """The comparison: every model x dtype x depth x batch, every backend,
  parity first; writes results.jsonl, results.csv, config.json,
  parity.json, scaling.png, decode.png and summary.md into `workdir`.

  Args:
    c: the config (configs/batch_scaling.py).
    log: progress lines (default: stderr).
  Returns:
    The timing records.
  Raises:
    ConfigError: bad settings. ParityError: two backends disagree.
  """
  c = settings(c)
  for spec in c.models:  # presets: refused before anything runs (others when loaded)
    if spec in config_lib.preset_names():
      _check_depths(c, config_lib.get_preset(spec))
  os.makedirs(workdir, exist_ok=True)
  jsonl = os.path.join(workdir, wd.RESULTS)
  if os.path.exists(jsonl):
    os.remove(jsonl)  # one run, one file: ratios only mean something within it
  log = log or (lambda s: print(s, file=sys.stderr, flush=True))
  threads = c.threads or xla_lib.xla_threads()
  run = Run(c, workdir, threads, _environment(threads), log)
  if threads != xla_lib.xla_threads():
    run.note("threads", f"torch and llama.cpp use {threads} threads, XLA "
             f"{xla_lib.xla_threads()} (set XLA_FLAGS to change XLA's)")
  wd.write_config(workdir, c.to_dict(), run.env)
  rng = np.random.RandomState(c.seed)
  load_start = wd.load_avg()
  for spec in c.models:
    for dtype in c.dtypes:
      _model_run(run, spec, config_lib.canonical_dtype(dtype), rng)
  run.env["load_avg_start"], run.env["load_avg_end"] = load_start, wd.load_avg()
  report.write_outputs(run.workdir, report.Outcome(run.c, run.env, run.records, run.notes,
                                                   run.parity, run.costs))
  return run.records


def _environment(threads: int) -> Record:
  """workdir.environment(), the thread counts, and the versions of the
  optional backends' packages (None where missing)."""
  env = {**wd.environment(), "threads": threads, "xla_threads": xla_lib.xla_threads()}
  for key, dist in (("torch", "torch"), ("transformers", "transformers"),
                    ("llama_cpp", "llama-cpp-python"), ("gguf", "gguf")):
    try:
      env[key] = importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
      env[key] = None
  return env
