"""The layer loop: specjax's unrolled layers against a `lax.scan` over stacked weights.

specjax's model (llama.py) unrolls its layers in Python over separate
per-layer weights and caches. The obvious alternative, one `lax.scan` over
weights and caches stacked on a layer axis, compiles in constant time but
decodes several times slower on XLA:CPU. This benchmark measures both, which
is why it keeps a second formulation of the model (`scan_forward`): it is
the thing being compared, built from the same linen blocks, and a test pins
its logits to llama.forward's.

  layer_loop_decode   real weights, both variants compiled ahead of time,
                      decode ms/step, logits compared
  layer_loop_compile  lowering + compile seconds at real depth (e.g.
                      llama-2-70b's 80 layers) from shapes only: nothing is
                      allocated, nothing runs
"""

from __future__ import annotations

import time
from typing import Any, Callable, Sequence

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from specjax.bench import tables
from specjax.formats import checkpoint
from specjax.decode import probes
from specjax.model import config as config_lib
from specjax.model import kv_cache as kvc
from specjax.model import llama as model_lib
from specjax.model import steps
from specjax.metrics import timing
from specjax import workdir as wd
from specjax.model.config import ModelConfig
from specjax.errors import ConfigError
from specjax.model.layers import Block, RMSNorm, weight_init
from specjax.workdir import Record




def stack_layers(params, n_layers: int):
  """The per-layer subtrees layers_0..layers_{L-1} stacked on a new axis 0."""
  layers = [params[f"layers_{i}"] for i in range(n_layers)]
  return jax.tree_util.tree_map(lambda *xs: jnp.stack(xs), *layers)


def scan_params(params, cfg: ModelConfig):
  """specjax params re-laid-out for `scan_forward`: layers stacked [L, ...]."""
  out = {k: v for k, v in params.items() if not k.startswith("layers_")}
  out["layers"] = stack_layers(params, cfg.n_layers)
  return out


def init_scan_cache(cfg: ModelConfig, batch: int, capacity: int):
  """(k, v, lengths): k and v [L, B, K, S, D], lengths [B]."""
  shape = (cfg.n_layers, batch, cfg.n_kv_heads, capacity, cfg.d_head)
  return (jnp.zeros(shape, cfg.jnp_dtype), jnp.zeros(shape, cfg.jnp_dtype),
          jnp.zeros((batch,), jnp.int32))


def scan_forward(params, tokens, cache, cfg: ModelConfig):
  """The same model as llama.forward, its layer loop a `lax.scan` over
  stacked weights and a stacked cache (the naive variant).

  tokens [B, T], cache (k, v, lengths) -> (logits [B, T, V] f32, cache).
  """
  k_all, v_all, lengths = cache
  positions = lengths[:, None] + jnp.arange(tokens.shape[1])[None, :]
  embed = nn.Embed(cfg.vocab_size, cfg.dim, dtype=cfg.jnp_dtype,
                   param_dtype=cfg.jnp_param_dtype, embedding_init=weight_init)
  x = embed.apply({"params": params["embed"]}, tokens)  # [B, T, E]

  def layer(x, xs):
    lp, k, v = xs
    x, k, v = Block(cfg).apply({"params": lp}, x, positions, k, v, lengths)
    return x, (k, v)

  x, (k_all, v_all) = jax.lax.scan(layer, x, (params["layers"], k_all, v_all))
  x = RMSNorm(cfg).apply({"params": params["final_norm"]}, x)
  if cfg.tie_embeddings:
    logits = embed.apply({"params": params["embed"]}, x, method="attend")
  else:
    logits = nn.Dense(cfg.vocab_size, use_bias=False, dtype=cfg.jnp_dtype,
                      param_dtype=cfg.jnp_param_dtype).apply(
                          {"params": params["lm_head"]}, x)
  t = tokens.shape[1]
  return logits.astype(jnp.float32), (k_all, v_all, lengths + t)


scan_step = jax.jit(scan_forward, static_argnames=("cfg",),
                    donate_argnames=("cache",))


def _aot_compile(jitted, *args, **static) -> tuple[Any, float, float]:
  """Lowers and compiles `jitted` for args (arrays or ShapeDtypeStructs)
  without running it. Returns (executable, wall s, JAX compile-event s)."""
  with timing.CompileWatch() as cw:
    t0 = time.perf_counter()
    exe = jitted.lower(*args, **static).compile()
    wall = time.perf_counter() - t0
  return exe, wall, cw.seconds


def layer_loop_decode(cfg: ModelConfig, params, capacity: int, depth: int,
                      reps: int, seed: int = 0) -> list[Record]:
  """Unrolled vs scan on real weights: compile s, decode ms/step, logits diff.

  Both variants decode one token (batch 1) against a cache of `capacity`
  slots holding the same `depth` prompt tokens, rolled back to depth between
  repetitions. Each variant is compiled ahead of time (timed on its own), so
  the timed repetitions run the compiled executable only.
  """
  if not 0 <= depth < capacity:
    raise ConfigError(f"need 0 <= depth < capacity, got depth={depth}, "
                      f"capacity={capacity}")
  rng = np.random.RandomState(seed)
  prompt = probes.random_tokens(rng, cfg.vocab_size, 1, depth)
  tok = probes.random_tokens(rng, cfg.vocab_size, 1, 1)
  dep = np.full((1,), depth, np.int32)
  u_cache = kvc.init_cache(cfg, 1, capacity)
  sp = scan_params(params, cfg)
  s_cache = init_scan_cache(cfg, 1, capacity)
  if depth:
    u_cache = timing.block(steps.forward_step(params, prompt, u_cache, cfg=cfg)[1])
    s_cache = timing.block(scan_step(sp, prompt, s_cache, cfg=cfg)[1])
  variants = {
      "unrolled": (steps.forward_step, params, u_cache,
                   lambda c: kvc.rollback(c, dep)),
      "scan": (scan_step, sp, s_cache, lambda c: (c[0], c[1], jnp.asarray(dep))),
  }
  del u_cache, s_cache  # donated below; the holders own them
  base = {**tables.model_info(cfg, params), "n_layers": cfg.n_layers,
          "capacity": capacity, "depth": depth, "batch": 1, "T": 1}
  records, logits = [], {}
  for name, (fn, p, cache, roll) in variants.items():
    exe, wall, events = _aot_compile(fn, p, tok, cache, cfg=cfg)
    holder = [cache]

    def run(exe=exe, p=p, roll=roll, holder=holder):
      out, holder[0] = exe(p, tok, roll(holder[0]))
      return out

    t = timing.measure(run, reps=reps, warmup=2)
    logits[name] = np.asarray(run())
    records.append({**base, "variant": name, "compile_s": wall,
                    "compile_events_s": events, "decode": t.to_dict(),
                    "ms_per_step": 1e3 * t.median, "ms_std": 1e3 * t.std,
                    "load_avg": wd.load_avg()})
  diff = float(np.max(np.abs(logits["unrolled"] - logits["scan"])))
  for r in records:
    r["max_abs_logit_diff"] = diff
  return records


def layer_loop_compile(cfg: ModelConfig, capacity: int) -> list[Record]:
  """Lowering + compile seconds of the T=1 decode, unrolled and scan, for
  `cfg` at full size: params and cache are ShapeDtypeStructs, so nothing is
  allocated and nothing runs."""
  params = jax.eval_shape(lambda: model_lib.init_params(cfg))
  cache = jax.eval_shape(lambda: kvc.init_cache(cfg, 1, capacity))
  sp = jax.eval_shape(lambda p: scan_params(p, cfg), params)
  s_cache = jax.eval_shape(lambda: init_scan_cache(cfg, 1, capacity))
  tok = jax.ShapeDtypeStruct((1, 1), jnp.int32)
  info = {"model": cfg.name, "n_params": cfg.num_params(),
          "size_bytes": cfg.num_params() * jnp.dtype(cfg.jnp_param_dtype).itemsize,
          "backend": jax.default_backend(), "dtype": cfg.precision,
          "n_layers": cfg.n_layers, "capacity": capacity, "depth": None,
          "batch": 1, "T": 1, "decode": None, "ms_per_step": None,
          "ms_std": None, "max_abs_logit_diff": None}
  records = []
  for name, fn, p, c in (("unrolled", steps.forward_step, params, cache),
                         ("scan", scan_step, sp, s_cache)):
    _, wall, events = _aot_compile(fn, p, tok, c, cfg=cfg)
    records.append({**info, "variant": name, "compile_s": wall,
                    "compile_events_s": events, "load_avg": wd.load_avg()})
  return records


def run_layer_loop_bench(preset: str, dtype: str = "float32",
                         capacity: int = 256, depth: int = 128, reps: int = 20,
                         compile_presets: Sequence[str] = ("llama-2-70b",),
                         seed: int = 0, load: Callable = checkpoint.load_model,
                         on_record: Callable[[Record], None] | None = None
                         ) -> list[Record]:
  """`layer_loop_decode` on `preset` (real weights, run), then
  `layer_loop_compile` on each of `compile_presets` (compiled, never run).
  Every record carries the environment."""
  env = wd.environment()
  cfg, params, _ = load(preset, dtype=config_lib.canonical_precision(dtype),
                        seed=seed)
  records = []

  def emit(rs):
    for r in rs:
      records.append({**r, "env": env})
      if on_record:
        on_record(records[-1])

  emit(layer_loop_decode(cfg, params, capacity, depth, reps, seed))
  del params
  for name in compile_presets:
    emit(layer_loop_compile(config_lib.get_preset(name, dtype), capacity))
  return records


LAYER_LOOP_COLUMNS = ("model", "params", "layers", "dtype", "capacity", "variant",
                      "compile s", "decode ms/step (median)", "max abs Δlogits")


def layer_loop_row(r: Record) -> list[str]:
  ms = ("not run (compile only)" if r["ms_per_step"] is None
        else f"{r['ms_per_step']:.2f} ± {r['ms_std']:.2f}")
  diff = ("" if r["max_abs_logit_diff"] is None
          else f"{r['max_abs_logit_diff']:.2e}")
  return [r["model"], tables.format_params(r["n_params"]), str(r["n_layers"]),
          r["dtype"], str(r["capacity"]), r["variant"], f"{r['compile_s']:.2f}",
          ms, diff]


def layer_loop_table(records: Sequence[Record]) -> str:
  return tables.markdown_table(LAYER_LOOP_COLUMNS,
                        [layer_loop_row(r) for r in records],
                        (False, True, True, False, True, False, True, True, True))
