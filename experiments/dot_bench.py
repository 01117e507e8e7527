"""Where the verify cost goes on CPU: one projection at M = 1..16 rows, by variant.

  python experiments/dot_bench.py --model=llama-160m
  XLA_FLAGS=--xla_cpu_use_xnnpack=true python experiments/dot_bench.py   # a flag, same table

A verify over gamma+1 tokens multiplies M = gamma+1 rows by the weights the
decode multiplies one row by; the bytes read are the same. This times each
weight shape of one layer (and the LM head) at each M, variants alternating:

  f32 x@W        the model's layout: W [in, out], f32 (what specjax runs)
  f32 x@W^T      W stored [out, in] (torch's layout), contracted on its last dim
  bf16 W, f32    bf16 weights, f32 accumulation (half the bytes to read)
  fused          q|k|v and gate|up as one matrix each (one dot instead of 3 / 2)
  row gemvs      M separate matrix-vector products (reads W M times)

k dots in one jitted loop, median of --reps, compile excluded; ms per layer
and the ratio to M = 1. With --roofline (default) it also measures this
machine's float32 ceilings (roofline.measure_peaks) and prints the
roofline's bound on T(M)/T(1) next to what XLA reaches. The reasoning and the
figures: docs/decode_cost.md, "The f32 verify curve and the roofline".
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
from absl import flags

from specjax.bench.studies import roofline
from specjax import cli
from specjax.metrics import timing
from specjax import workdir as wd
from specjax.model.config import get_preset

_MODEL = flags.DEFINE_string("model", "llama-160m", "Preset whose shapes are timed.")
_MS = flags.DEFINE_list("m", ["1", "2", "4", "8", "16"], "Rows per product (tokens).")
_REPS = flags.DEFINE_integer("reps", 7, "Repetitions (medians).", lower_bound=1)
_K = flags.DEFINE_integer("k", 8, "Products per jitted loop.", lower_bound=1)
_JSON = flags.DEFINE_string("json_out", None, "Write the table as JSON here.")
_ROOF = flags.DEFINE_bool("roofline", True, "Also measure the f32 peaks and print the roofline bound.")


@functools.partial(jax.jit, static_argnames=("kind", "k"))
def _loop(xs, ws, *, kind, k):
  """k rounds of every projection of one layer; a scalar carry keeps them live.

  The carry takes the sum of every output element: taking one element would
  let XLA slice the product down to a single row or column and time nothing.

  xs: {input width: [M, width] activations}; each weight takes the one that
  matches its input dimension.
  """
  def dot(a, w):
    if kind == "f32 x@W^T":
      return jax.lax.dot_general(a, w, (((1,), (1,)), ((), ())))
    if kind == "bf16 W, f32":
      return jnp.dot(a.astype(jnp.bfloat16), w, preferred_element_type=jnp.float32)
    if kind == "row gemvs":
      return jnp.stack([a[i] @ w for i in range(a.shape[0])])
    return a @ w

  in_dim = lambda w: w.shape[1] if kind == "f32 x@W^T" else w.shape[0]

  def body(_, s):
    return s + sum(jnp.sum(dot(xs[in_dim(w)] + s, w)) for w in ws) * 1e-30
  return jax.lax.fori_loop(0, k, body, jnp.zeros((), jnp.float32))


def _weights(cfg, kind, rng):
  e, f, d = cfg.dim, cfg.ffn_dim, cfg.d_head
  q, kv = cfg.n_heads * d, cfg.n_kv_heads * d
  if kind == "fused":
    shapes = [(e, q + 2 * kv), (q, e), (e, 2 * f), (f, e)]
  else:
    shapes = [(e, q), (e, kv), (e, kv), (q, e), (e, f), (e, f), (f, e)]
  dtype = jnp.bfloat16 if kind == "bf16 W, f32" else jnp.float32
  ws = []
  for a, b in shapes:
    w = rng.standard_normal((a, b)).astype(np.float32) * 0.02
    ws.append(jnp.asarray(w.T if kind == "f32 x@W^T" else w, dtype))
  return ws


def main(argv):
  del argv
  cfg = get_preset(_MODEL.value)
  ms = [int(m) for m in _MS.value]
  kinds = ["f32 x@W", "f32 x@W^T", "bf16 W, f32", "fused", "row gemvs"]
  rng = np.random.default_rng(0)
  weights = {kind: _weights(cfg, kind, rng) for kind in kinds}
  widths = {cfg.dim, cfg.ffn_dim, cfg.n_heads * cfg.d_head}
  xs = {m: {w: jnp.asarray(rng.standard_normal((m, w)), jnp.float32) for w in widths}
        for m in ms}
  k = _K.value
  compile_s, times = {}, {kind: {m: [] for m in ms} for kind in kinds}
  for kind in kinds:
    for m in ms:
      with timing.CompileWatch() as cw:
        _loop(xs[m], weights[kind], kind=kind, k=k).block_until_ready()
      compile_s[(kind, m)] = cw.seconds
  for _ in range(_REPS.value):  # alternate variants within each repetition
    for m in ms:
      for kind in kinds:
        t = timing.measure(lambda: _loop(xs[m], weights[kind], kind=kind, k=k), reps=1)
        times[kind][m].append(t.median / k)
  med = {kind: {m: float(np.median(v)) for m, v in d.items()} for kind, d in times.items()}
  env = wd.environment()
  print(f"{cfg.name}: the projections of one layer (dim {cfg.dim}, ffn {cfg.ffn_dim}), "
        f"ms per layer, median of {_REPS.value}; XLA_FLAGS={env.get('xla_flags') or '-'}")
  print("| variant | " + " | ".join(f"M={m}" for m in ms) + " | " +
        " | ".join(f"T({m})/T(1)" for m in ms[1:]) + " |")
  print("|---|" + "---|" * (2 * len(ms) - 1))
  for kind in kinds:
    t1 = med[kind][ms[0]]
    print(f"| {kind} | " + " | ".join(f"{1e3 * med[kind][m]:.3f}" for m in ms) + " | " +
          " | ".join(f"{med[kind][m] / t1:.2f}" for m in ms[1:]) + " |")
  base1 = med["f32 x@W"][ms[0]]
  print("vs the model's layout at M=1: " + ", ".join(
      f"{kind} {med[kind][ms[0]] / base1:.2f}x" for kind in kinds[1:]))
  roof = print_roofline(cfg, ms, med["f32 x@W"]) if _ROOF.value else None
  print(f"machine: {wd.machine_line(env)}")
  if _JSON.value:
    wd.write_json(_JSON.value, {"model": cfg.name, "ms": ms, "median_s": med, "env": env,
                                 "compile_s": {f"{a}|{b}": v for (a, b), v in compile_s.items()},
                                 "roofline": roof})


def print_roofline(cfg, ms, measured):
  """Prints the f32 layer's roofline bound per M next to `measured` ({M: s})."""
  peaks = roofline.measure_peaks(reps=_REPS.value)
  e, f, d = cfg.dim, cfg.ffn_dim, cfg.d_head
  q, kv = cfg.n_heads * d, cfg.n_kv_heads * d
  n_params = e * (2 * q + 2 * kv) + 3 * e * f  # q, k, v, o; gate, up, down
  gf, bw = peaks["peak_gflops"], peaks["read_gbs"]
  bound = {m: roofline.roofline_bound(m, n_params, 4, gf, bw) for m in ms}
  ridge = gf * 4 / (2 * bw)
  print(f"\nRoofline, f32 (measured here: {gf:.0f} GFLOP/s on a 2048^3 product, {bw:.1f} GB/s "
        f"reading 512 MiB): one layer's {n_params / 1e6:.1f} M weights; ridge point at "
        f"M = {ridge:.1f} rows (below it the weights' read sets the time)")
  print("| M | bound ms | bound T(M)/T(1) | f32 x@W ms | T(M)/T(1) | GFLOP/s | % of peak | x bound |")
  print("|---:|---:|---:|---:|---:|---:|---:|---:|")
  rows = []
  for m in ms:
    got = 2 * m * n_params / measured[m] / 1e9
    rows.append({"m": m, "bound_s": bound[m], "measured_s": measured[m], "gflops": got})
    print(f"| {m} | {1e3 * bound[m]:.3f} | {bound[m] / bound[ms[0]]:.2f} | "
          f"{1e3 * measured[m]:.3f} | {measured[m] / measured[ms[0]]:.2f} | {got:.1f} | "
          f"{100 * got / gf:.0f}% | {measured[m] / bound[m]:.2f} |")
  return {**peaks, "ridge_m": ridge, "layer_params": n_params, "rows": rows}


if __name__ == "__main__":
  cli.run(main)
