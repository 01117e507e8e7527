"""Where one decode step's time goes, by ablation (batch 1, f32 or --dtype).

  python experiments/decode_profile.py --model=llama-160m,cpu-target --depth=128

T(1) of one token (k forwards in one jitted loop, probes.CostProbe: no host
dispatch, compile excluded) at --depth tokens already cached, for:

  full           the model as it runs
  no attention   attention replaced by its query (the cache is still written,
                 so nothing can be hoisted out of the loop): the attention's cost
  no norms       RMSNorm replaced by identity
  no rope        RoPE replaced by identity
  projections    only the model's own weight products (every layer's seven,
                 then the LM head) chained in one jitted loop at M = 1

next to the bandwidth bound: the step's bytes (every weight once, the
attended K/V slots: roofline.decode_bytes) over the read bandwidth measured
here (roofline.measure_read, once per repetition: it drifts). Variants
alternate within each repetition; medians of --reps. An ablated variant computes something else: only its
time means anything.
"""

import contextlib
import functools

import jax
import jax.numpy as jnp
import numpy as np
from absl import flags

from specjax.bench.studies import roofline
from specjax.formats import checkpoint
from specjax import cli
from specjax.decode import probes
from specjax.model import layers
from specjax.model import steps
from specjax.metrics import timing
from specjax import workdir as wd
from specjax.errors import ConfigError

_MODEL = flags.DEFINE_list("model", ["llama-160m", "cpu-target"], "Models: preset names, HF or orbax directories.")
_DTYPE = flags.DEFINE_string("dtype", None, "Compute dtype (float32, bf16-mixed, ...); default: the model's own.")
_DEPTH = flags.DEFINE_integer("depth", 128, "Tokens in the cache before the timed step.", lower_bound=1)
_REPS = flags.DEFINE_integer("reps", 7, "Repetitions (medians).", lower_bound=1)
_K = flags.DEFINE_integer("k", 8, "Forwards per jitted loop.", lower_bound=1)
_OUT = cli.RecordFlags("(model, variant)")

VARIANTS = ("full", "no attention", "no norms", "no rope")


@contextlib.contextmanager
def ablated(variant: str):
  """Patches the layers module for one variant while it is traced."""
  saved = (layers.attend_masked, layers.attend_blocked, layers.apply_rope,
           layers.RMSNorm.__call__)
  if variant == "no attention":
    layers.attend_masked = lambda q, k, v, pos, dtype, tree=None: q.astype(dtype)
    layers.attend_blocked = lambda q, k, v, pos, block, dtype, tree=None: q.astype(dtype)
  elif variant == "no rope":
    layers.apply_rope = lambda x, positions, inv_freq: x
  elif variant == "no norms":
    layers.RMSNorm.__call__ = lambda self, x: x
  try:
    yield
  finally:
    (layers.attend_masked, layers.attend_blocked, layers.apply_rope,
     layers.RMSNorm.__call__) = saved


def kernels(params) -> list[jax.Array]:
  """The float weight matrices a decode step multiplies, in order."""
  out = []
  for i in range(len([k for k in params if k.startswith("layers_")])):
    layer = params[f"layers_{i}"]
    out += [layer["attn"][n]["kernel"] for n in ("wq", "wk", "wv", "wo")]
    out += [layer["mlp"][n]["kernel"] for n in ("w_gate", "w_up", "w_down")]
  head = params["lm_head"]["kernel"] if "lm_head" in params else params["embed"]["embedding"].T
  return out + [head]


@functools.partial(jax.jit, static_argnames=("k", "dtype"))
def _projections(ws, x, *, k: int, dtype):
  """k rounds of every weight product of one step at M = 1 (each input the
  previous output's matching slice, so nothing is loop-invariant)."""
  def body(_, s):
    tot = s
    for w in ws:
      a = jnp.broadcast_to(x[: w.shape[0]] + tot, (1, w.shape[0])).astype(dtype)
      tot = tot + jnp.sum(a @ w.astype(dtype)) * 1e-30
    return tot
  return jax.lax.fori_loop(0, k, body, jnp.zeros((), jnp.float32))


def profile(spec: str) -> list[dict]:
  cfg, params, _ = checkpoint.load_model(spec, dtype=_DTYPE.value)
  if cfg.quant:
    raise ConfigError("decode_profile times float weights; --dtype=int8 is not supported")
  depth = _DEPTH.value
  capacity = depth + 16
  probe_of, logits = {}, {}
  tokens = np.arange(1, 9)[None] % cfg.vocab_size
  for v in VARIANTS:  # each variant its own config name: its own trace
    with ablated(v):
      m = steps.Runner(cfg.replace(name=f"{cfg.name}|{v}"), params)
      probe_of[v] = probes.CostProbe(m, capacity, depth, k=_K.value)
      probe_of[v].times([1])  # compile while patched
      # what the variant computes, to show the ablation took effect
      logits[v] = np.asarray(m.forward(tokens, m.new_cache(1, capacity))[0], np.float32)
  ws = kernels(params)
  x = jnp.asarray(np.random.default_rng(0).standard_normal(max(max(w.shape[0] for w in ws), 1)),
                  jnp.float32)
  proj = lambda: _projections(ws, x, k=_K.value, dtype=cfg.jnp_dtype)
  timing.block(proj())
  times = {v: [] for v in (*VARIANTS, "projections")}
  read_gbs = []  # the machine's read bandwidth drifts: measured in every repetition too
  for _ in range(_REPS.value):
    for v in VARIANTS:
      with ablated(v):
        times[v].append(probe_of[v].times([1])[1].median)
    times["projections"].append(timing.measure(proj, reps=1, warmup=0).median / _K.value)
    read_gbs.append((512 << 20) / roofline.measure_read(reps=1, read_mib=512).median / 1e9)
  peaks = {"read_gbs": float(np.median(read_gbs))}
  n_bytes = roofline.decode_bytes(cfg, sum(int(w.size) * w.dtype.itemsize for w in ws),
                               roofline.attended_slots(cfg, capacity, depth + 1))
  bound = n_bytes / (peaks["read_gbs"] * 1e9)
  med = {v: float(np.median(t)) for v, t in times.items()}
  env = wd.environment()
  return [{"model": cfg.name, "precision": cfg.precision, "depth": depth, "capacity": capacity,
           "variant": v, "ms": 1e3 * s, "share_of_full": s / med["full"],
           "max_abs_logit_diff": (float(np.abs(logits[v] - logits["full"]).max())
                                  if v in logits else None),
           "bound_ms": 1e3 * bound, "read_gbs": peaks["read_gbs"], "env": env}
          for v, s in med.items()]


def main(argv):
  del argv
  on_record = _OUT.on_record(lambda r: f"{r['model']} {r['variant']}: {r['ms']:.2f} ms")
  records = []
  for spec in _MODEL.value:
    rs = profile(spec)
    for r in rs:
      on_record(r)
    records += rs
  print("| model | depth | full ms | no attention | no norms | no rope | projections | "
        "bandwidth bound | attention | rest |")
  print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
  for name in dict.fromkeys(r["model"] for r in records):
    ms = {r["variant"]: r["ms"] for r in records if r["model"] == name}
    r0 = next(r for r in records if r["model"] == name)
    attn = ms["full"] - ms["no attention"]
    print(f"| {name} | {r0['depth']} | {ms['full']:.2f} | {ms['no attention']:.2f} | "
          f"{ms['no norms']:.2f} | {ms['no rope']:.2f} | {ms['projections']:.2f} | "
          f"{r0['bound_ms']:.2f} ({r0['read_gbs']:.1f} GB/s) | {attn:.2f} | "
          f"{ms['full'] - ms['projections'] - attn:.2f} |")
  print("attention = full - no attention; rest = full - projections - attention (norms, RoPE, "
        "cache writes, residuals, embedding, sampling, per-op overhead).")
  _OUT.finish(records)


if __name__ == "__main__":
  cli.run(main)
