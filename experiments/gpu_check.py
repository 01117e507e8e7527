"""The GPU check: one short script for a machine with a GPU (under 5 minutes, no network).

  python experiments/gpu_check.py --workdir=/tmp/specjax_gpu

1. Checks that JAX sees a GPU.
2. llama-bench on the llama-160m and llama-7b shapes in bf16 (random weights):
   pp 1..16 (the verify-cost curve) and tg 64.
3. A short sweep: 160m draft, 7b target, gamma 1..8, bernoulli 0.6 / 0.8 / 1.0
   (configs/sweep_gamma.py:gpu).
4. Prints a compact summary: tg t/s, the fraction of the memory-bandwidth
   roofline reached, T(n)/T(1), and measured vs predicted speedups.

`--smoke` runs the same path on tiny models on the CPU (used by the tests).
"""

import os
import sys

import jax
from absl import flags

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from configs import sweep_gamma  # noqa: E402
from specjax import bench, cli, config, sweep
from specjax import workdir as wd
from specjax.errors import SpecjaxError

_WORKDIR = flags.DEFINE_string("workdir", "/tmp/specjax_gpu", "Output folder.")
_SMOKE = flags.DEFINE_bool("smoke", False, "Tiny models on any backend: checks the script only.")
_BANDWIDTH = flags.DEFINE_float("bandwidth_gbs", None, "Peak memory bandwidth (GB/s); default: "
                                "looked up from the device kind.", lower_bound=1.0)
_REPS = flags.DEFINE_integer("reps", 5, "Benchmark repetitions.", lower_bound=1)


def main(argv):
  del argv
  dev = jax.devices()[0]
  if not _SMOKE.value and jax.default_backend() != "gpu":
    raise SpecjaxError(f"JAX does not see a GPU (backend {jax.default_backend()!r}, devices "
                       f"{jax.devices()}); see BUILD.md, or pass --smoke")
  print(f"backend {jax.default_backend()}, device {dev.device_kind}, jax {jax.__version__}")
  os.makedirs(_WORKDIR.value, exist_ok=True)
  cfg = sweep_gamma.get_config("gpu")
  if _SMOKE.value:
    cfg.target, cfg.draft, cfg.dtype = "tiny", "tiny-draft", "float32"
    cfg.gammas, cfg.n_predict, cfg.ctx_size, cfg.reps = (1, 2), 8, 48, 1
    cfg.accepts = ("bernoulli:0.8", "always")
  models = [cfg.draft, cfg.target]
  jsonl = os.path.join(_WORKDIR.value, "bench.jsonl")
  open(jsonl, "w").close()
  n_prompt = [1, 2, 4] if _SMOKE.value else [1, 2, 3, 4, 5, 6, 8, 9, 12, 16]
  records = bench.run_bench(models, [cfg.dtype], n_prompt=n_prompt,
                            n_gen=64 if not _SMOKE.value else 4, n_depth=128 if not _SMOKE.value else 8,
                            reps=_REPS.value, on_record=lambda r: wd.append_jsonl(jsonl, [r]))
  bandwidth = _BANDWIDTH.value or bench.device_bandwidth_gbs(dev.device_kind)
  lines = ["## Decode and verify cost", "",
           "| model | tg t/s | ms/token | roofline | " + " | ".join(
               f"T({n})/T(1)" for n in (2, 4, 8, 16)) + " |", "|---" * 8 + "|"]
  for name in models:
    rs = [r for r in records if r["model"] == config.get_preset(name).name]
    tg = next(r for r in rs if r["kind"] == "tg")
    ratio = {r["n_tokens"]: r["verify_ratio"] for r in rs if r["kind"] == "pp"}
    step_s = tg["median_s"] / tg["n_tokens"]
    roof = (bench.roofline_fraction(config.get_preset(name, cfg.dtype), tg["size_bytes"],
                                    tg["capacity"], step_s, bandwidth) if bandwidth else None)
    lines.append(f"| {name} | {tg['n_tokens'] / tg['median_s']:.1f} | {1e3 * step_s:.2f} | "
                 + (f"{100 * roof:.0f}% of {bandwidth:.0f} GB/s" if roof else "bandwidth unknown")
                 + " | " + " | ".join(f"{ratio.get(n, float('nan')):.2f}" for n in (2, 4, 8, 16))
                 + " |")
  points = sweep.run_sweep(cfg, os.path.join(_WORKDIR.value, "sweep"), progress=False)
  lines += ["", "## Speedup, 160m draft / 7b target (bf16, random weights)", "",
            "| gamma | accept rule | speedup | Leviathan | measured-cost | efficiency |",
            "|---" * 6 + "|"]
  for r in sorted(points, key=lambda r: (r["accept_rule"], r["gamma"])):
    lines.append(f"| {r['gamma']} | {r['accept_rule']} | {r['speedup']:.2f}x | "
                 f"{r['predicted_leviathan']:.2f}x | {r['predicted_measured_cost']:.2f}x | "
                 f"{r['efficiency']:.2f} |")
  lines += ["", f"Machine: {wd.machine_line(wd.environment())}."]
  text = "\n".join(lines) + "\n"
  with open(os.path.join(_WORKDIR.value, "gpu_summary.md"), "w") as f:
    f.write(text)
  print(text)


if __name__ == "__main__":
  cli.run(main)
