"""The GPU check: the one prepared script for a machine with a GPU (no network,
about 5 minutes on one GPU).

  pip install --no-deps -e . && python experiments/gpu_check.py --workdir=/tmp/specjax_gpu

1. Checks that JAX sees a GPU, and measures its ceilings: bf16 FLOP/s of
   an 8192^3 product and the read bandwidth of summing 2 GiB (the ridge
   point they imply: the tokens per verify below which reading the weights
   sets the time).
2. Decode and verify cost, llama-160m and llama-7b shapes in bf16 (random
   weights), depth 128: tg t/s, ms/token and the share of the HBM roofline
   (every weight and the attended KV slots read once per token), T(N)/T(1)
   for N up to 64, where the flat region ends, and the FLOP rate reached at
   the largest N (what the curve implies about the ridge point).
3. Attention over the used length: llama-160m decode at capacity 256 and 4096
   with 128 used, and at 2000 used, blocked next to masked.
4. The sweep, llama-160m draft / llama-7b target, bf16
   (configs/sweep_gamma.py:gpu): measured speedup next to Leviathan's and
   the measured-cost prediction.
5. Speculative decoding at batch > 1 (configs/sweep_gamma.py:gpu_batch):
   llama-7b / llama-160m, bf16, batches 1, 8, 32, gamma 1 and 4, bernoulli:0.8:
   speedup per batch, the tail model's steps, the crossover batch.
6. The loop overhead of the speculative device loop (gamma 4).
7. With several local GPUs: llama-7b T(1) and T(5) on data:1,model:M for
   M = 1, 2, 4, 8 up to the number of GPUs (tensor parallelism); with one,
   the summary says so.

Writes gpu_summary.md and gpu_check.jsonl (one record per measurement, each
with the environment) to --workdir and prints both paths and the summary.
`--smoke` runs the same path on tiny models on any backend (the tests use it).
"""

import os
import sys
import time

import jax
import jax.numpy as jnp
from absl import flags

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from configs import sweep_gamma  # noqa: E402
from specjax.bench import llama_bench as bench
from specjax.bench import roofline
from specjax.bench import tables
from specjax.formats import checkpoint
from specjax import cli
from specjax.model import config
from specjax.bench import costs
from specjax.parallel import mesh_plan
from specjax.model import sharding
from specjax.model import steps
from specjax.bench import sweep
from specjax.bench.batch_scaling_report import FLAT_LIMIT, scaling_report
from specjax import workdir as wd
from specjax.errors import SpecjaxError

_WORKDIR = flags.DEFINE_string("workdir", "/tmp/specjax_gpu", "Output folder.")
_SMOKE = flags.DEFINE_bool("smoke", False, "Tiny models on any backend: checks the script only.")
_BANDWIDTH = flags.DEFINE_float("bandwidth_gbs", None, "Peak memory bandwidth (GB/s); default: "
                                "looked up from the device kind.", lower_bound=1.0)
_REPS = flags.DEFINE_integer("reps", 5, "Benchmark repetitions.", lower_bound=1)
_SKIP = flags.DEFINE_list("skip", [], "Parts to leave out: peaks, bench, attention, sweep, batch, "
                         "overhead, mesh.")


class Out:
  """gpu_check.jsonl, appended as each record is finished."""

  def __init__(self, workdir: str):
    os.makedirs(workdir, exist_ok=True)
    self.path = os.path.join(workdir, "gpu_check.jsonl")
    open(self.path, "w").close()
    self.env = wd.environment()

  def __call__(self, part: str, rec: dict) -> None:
    wd.append_jsonl(self.path, [{"part": part, **rec, "env": self.env}])


def peaks_part(smoke: bool, reps: int, out, measured: dict) -> list[str]:
  """The device's measured ceilings (roofline.measure_peaks, bf16 on a GPU); the
  bench part reports its roofline share against them too."""
  n, mib, dtype = (256, 8, "float32") if smoke else (8192, 2048, "bfloat16")
  peaks = roofline.measure_peaks(reps=reps, n=n, read_mib=mib, dtype=dtype)
  measured.update(peaks)
  out("peaks", {"n": n, "read_mib": mib, "dtype": dtype, **peaks})
  item = jnp.dtype(dtype).itemsize  # bytes per weight
  ridge = peaks["peak_gflops"] * item / (2 * peaks["read_gbs"])
  return ["## Measured ceilings", "",
          f"{dtype} {n}^3 product: {peaks['peak_gflops'] / 1e3:.1f} TFLOP/s; summing "
          f"{mib} MiB: {peaks['read_gbs']:.0f} GB/s. Ridge point for {item}-byte weights at "
          f"batch 1: N = {ridge:.0f} tokens per forward (below it the weights' read sets "
          f"the time: T(N)/T(1) can stay near 1)."]


def bench_part(models, dtype, n_prompt, n_gen, depth, reps, bandwidth, out,
               measured_gbs=None) -> list[str]:
  records = bench.run_bench(models, [dtype], n_prompt=n_prompt, n_gen=n_gen, n_depth=depth,
                            reps=reps, on_record=lambda r: out("bench", r))
  lines = ["## Decode and verify cost (batch 1, depth %d)" % depth, "",
           "| model | tg t/s | ms/token | roofline | measured read | " + " | ".join(
               f"T({n})/T(1)" for n in n_prompt[1:]) + " | leaves flat at N | TFLOP/s at N=%d |"
           % max(n_prompt), "|---" * (7 + len(n_prompt) - 1) + "|"]
  for spec in models:
    cfg = config.get_preset(spec, dtype)
    rs = [r for r in records if r["model"] == cfg.name]
    tg = next(r for r in rs if r["kind"] == "tg")
    pp = {r["n_tokens"]: r for r in rs if r["kind"] == "pp"}
    ratio = {n: r["verify_ratio"] for n, r in pp.items()}
    step_s = tg["median_s"] / tg["n_tokens"]
    slots = roofline.attended_slots(cfg, tg["capacity"], depth + n_gen)
    roof = (roofline.roofline_fraction(cfg, tg["size_bytes"], slots, step_s, bandwidth)
            if bandwidth else None)
    leave, _ = scaling_report({n: r["median_s"] for n, r in pp.items()})
    n_max = max(pp)
    tflops = 2 * tg["n_params"] * n_max / pp[n_max]["median_s"] / 1e12
    lines.append(f"| {spec} | {1 / step_s:.1f} | {1e3 * step_s:.2f} | "
                 + (f"{100 * roof:.0f}% of {bandwidth:.0f} GB/s" if roof else "bandwidth unknown")
                 + " | " + (f"{100 * roofline.roofline_fraction(cfg, tg['size_bytes'], slots, step_s, measured_gbs):.0f}%"
                            if measured_gbs else "-")
                 + " | " + " | ".join(f"{ratio.get(n, float('nan')):.2f}" for n in n_prompt[1:])
                 + f" | {leave or '-'} | {tflops:.1f} |")
  lines += ["", f"Leaves flat at N: the smallest N with T(N)/T(1) > {FLAT_LIMIT} (- if none). "
            "TFLOP/s: 2 x params x N / T(N) at the largest N; past the ridge point the "
            "verify is compute-bound and T(N) grows with N. Measured read: the roofline "
            "share against the read bandwidth measured in the first part."]
  return lines


def attention_part(spec, dtype, points, n_gen, reps, out) -> list[str]:
  cfg, params, _ = checkpoint.load_model(spec, dtype=dtype)
  rs = bench.attention_scaling(steps.Runner(cfg, params), points, n_gen, reps,
                               on_record=lambda r: out("attention", r))
  ms = {(r["capacity"], r["n_depth"], r["variant"]): r["ms_per_token"] for r in rs}
  (c_lo, d_lo), (c_hi, _) = points[0], points[1]
  ratio = ms[(c_hi, d_lo, "blocked")] / ms[(c_lo, d_lo, "blocked")]
  return [f"## Attention over the used length ({spec}, {cfg.precision})", "",
          bench.attention_table(rs), "",
          f"Blocked, {d_lo} used: capacity {c_hi} costs {ratio:.2f}x capacity {c_lo} "
          f"(goal <= 1.1)."]


def sweep_part(cfg, workdir) -> list[str]:
  points = sweep.run_sweep(cfg, os.path.join(workdir, "sweep"), progress=False)
  lines = [f"## Speedup, {cfg.draft} draft / {cfg.target} target ({cfg.dtype or 'own dtype'}, "
           "random weights)", "",
           "| gamma | accept rule | speedup | T(g+1)/T(1) | Leviathan | measured-cost | efficiency |",
           "|---" * 7 + "|"]
  for r in sorted(points, key=lambda r: (r["accept_rule"], r["gamma"])):
    lines.append(f"| {r['gamma']} | {r['accept_rule']} | {r['speedup']:.2f}x | "
                 f"{r['verify_ratio']:.2f} | {r['predicted_leviathan']:.2f}x | "
                 f"{r['predicted_measured_cost']:.2f}x | {r['efficiency']:.2f} |")
  return lines


def batch_part(cfg, workdir) -> list[str]:
  from specjax.bench import sweep_report  # pylint: disable=import-outside-toplevel
  points = sweep.run_sweep(cfg, os.path.join(workdir, "sweep_batch"), progress=False)
  lines = [f"## Batch > 1: {cfg.draft} draft / {cfg.target} target ({cfg.dtype or 'own dtype'})",
           "", "| batch | gamma | accept rule | speedup | loop steps (measured / tail model) | "
           "T(B,g+1)/T(B,1) | predicted |", "|---" * 7 + "|"]
  for r in sorted(points, key=lambda r: (r["accept_rule"], r["gamma"], r["batch"])):
    lines.append(f"| {r['batch']} | {r['gamma']} | {r['accept_rule']} | {r['speedup']:.2f}x | "
                 f"{r['steps_measured']:.1f} / {r['steps_predicted']:.1f} | "
                 f"{r['verify_ratio']:.2f} | {r['predicted_tail']:.2f}x |")
  lines.append("")
  for g in sorted({r["gamma"] for r in points}):
    for rule in sorted({r["accept_rule"] for r in points}):
      xs = [(r["batch"], r["speedup"]) for r in points
            if r["gamma"] == g and r["accept_rule"] == rule]
      b = sweep_report.crossover(xs)
      lines.append(f"Crossover, gamma {g}, {rule}: "
                   + (f"batch {b}" if b else f"none up to batch {max(x for x, _ in xs)}") + ".")
  return lines


def overhead_part(target, draft, dtype, gamma, reps, out) -> list[str]:
  tcfg, tparams, _ = checkpoint.load_model(target, dtype=dtype)
  dcfg, dparams, _ = checkpoint.load_model(draft, dtype=dtype, seed=1, role="draft")
  prompt = list(range(3, 35))
  rec = costs.loop_overhead(steps.Runner(tcfg, tparams), steps.Runner(dcfg, dparams), prompt,
                            gamma, n_steps=8, reps=reps)
  out("overhead", rec)
  return [f"## Device-loop overhead ({target} / {draft}, gamma {gamma})", "",
          f"Loop {1e3 * rec['loop_step_s']:.3f} ms/step, its phases alone "
          f"{1e3 * rec['phases_step_s']:.3f} ms/step: overhead "
          f"{100 * rec['overhead_share']:.2f} % (goal <= 2 %)."]


def mesh_part(model, dtype, reps, out) -> list[str]:
  """T(1), T(5) on data:1,model:M over the local devices (M = 1, 2, 4, 8)."""
  n = jax.local_device_count()
  lines = [f"## Tensor parallelism over the local devices ({n})", ""]
  if n < 2:
    return lines + [f"One {jax.default_backend()} device: the model-axis figures need several "
                    "(experiments/mesh_bench.py measures them on virtual CPU devices)."]
  cfg = config.get_preset(model)
  axes = [m for m in (1, 2, 4, 8) if m <= n and sharding.divides(cfg, m)]
  recs = mesh_plan.model_axis_costs(model, dtype, axes, 4, 256, 128, reps)
  for r in recs:
    out("mesh", r)
  return lines + [f"{model} ({recs[0]['precision']}), batch 1, 128 of 256 slots used, medians "
                  f"of {reps}:", "", tables.markdown_table(
                      ["mesh", "T(1) ms", "T(5) ms", "T(5)/T(1)", "T(1) vs model:1"],
                      [[r["mesh"], f"{1e3 * r['t1_s']:.2f}", f"{1e3 * r['tv_s']:.2f}",
                        f"{r['verify_ratio']:.2f}", f"{r['t1_vs_first']:.2f}"] for r in recs])]


def main(argv):
  del argv
  dev = jax.devices()[0]
  if not _SMOKE.value and jax.default_backend() != "gpu":
    raise SpecjaxError(f"JAX does not see a GPU (backend {jax.default_backend()!r}, devices "
                       f"{jax.devices()}); see BUILD.md, or pass --smoke")
  print(f"backend {jax.default_backend()}, device {dev.device_kind}, jax {jax.__version__}",
        flush=True)
  out, reps, skip = Out(_WORKDIR.value), _REPS.value, set(_SKIP.value)
  scfg, bcfg = sweep_gamma.get_config("gpu"), sweep_gamma.get_config("gpu_batch")
  if _SMOKE.value:
    bcfg.target, bcfg.draft, bcfg.dtype = "tiny", "tiny-draft", "float32"
    bcfg.batches, bcfg.gammas, bcfg.n_predict, bcfg.ctx_size, bcfg.reps = (1, 2), (2,), 8, 48, 1
    scfg.target, scfg.draft, scfg.dtype = "tiny", "tiny-draft", "float32"
    scfg.gammas, scfg.n_predict, scfg.ctx_size, scfg.reps = (1, 2), 8, 48, 1
    scfg.accepts = ("bernoulli:0.8", "always")
    models, n_prompt, n_gen, depth = ["tiny-draft", "tiny"], [1, 2, 4], 4, 8
    attn_model, attn_points, attn_gen = "tiny", [(32, 8), (128, 8), (128, 96)], 4
  else:
    models, n_prompt, n_gen, depth = ["llama-160m", "llama-7b"], [1, 2, 4, 8, 16, 32, 64], 64, 128
    attn_model, attn_points, attn_gen = "llama-160m", [(256, 128), (4096, 128), (4096, 2000)], 32
  bandwidth = _BANDWIDTH.value or roofline.device_bandwidth_gbs(dev.device_kind)
  lines, t0 = [f"# GPU check: {dev.device_kind}", ""], time.perf_counter()
  measured = {}  # filled by the peaks part
  parts = [
      ("peaks", lambda: peaks_part(_SMOKE.value, reps, out, measured)),
      ("bench", lambda: bench_part(models, scfg.dtype, n_prompt, n_gen, depth, reps,
                                   bandwidth, out, measured.get("read_gbs"))),
      ("attention", lambda: attention_part(attn_model, scfg.dtype, attn_points, attn_gen,
                                           reps, out)),
      ("sweep", lambda: sweep_part(scfg, _WORKDIR.value)),
      ("batch", lambda: batch_part(bcfg, _WORKDIR.value)),
      ("overhead", lambda: overhead_part(scfg.target, scfg.draft, scfg.dtype, 4 if not
                                         _SMOKE.value else 2, reps, out)),
      ("mesh", lambda: mesh_part("tiny" if _SMOKE.value else "llama-7b", scfg.dtype, reps,
                                 out)),
  ]
  for name, part in parts:
    if name in skip:
      continue
    t = time.perf_counter()
    lines += part() + ["", f"({name}: {time.perf_counter() - t:.0f} s)", ""]
    print(f"{name} done ({time.perf_counter() - t0:.0f} s)", flush=True)
  lines += [f"Machine: {wd.machine_line(out.env)}. Total {time.perf_counter() - t0:.0f} s."]
  text = "\n".join(lines) + "\n"
  summary = os.path.join(_WORKDIR.value, "gpu_summary.md")
  with open(summary, "w") as f:
    f.write(text)
  print(text)
  print(f"wrote {summary} and {out.path}")


if __name__ == "__main__":
  cli.run(main)
