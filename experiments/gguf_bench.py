"""GGUF load speed and memory, and int8 decode speed, at a preset's shapes.

  python experiments/gguf_bench.py --model=llama-160m --out_dir=/tmp/gguf_bench
  python experiments/gguf_bench.py --parts=memory --src=/tmp/old_src  # another tree

1. --parts=load: the preset's random weights written as F16 and Q8_0 GGUF
   files (formats.gguf_write), each loaded by specjax (gguf_weights.load_gguf):
   median wall seconds until the params are on device, and file MB / s (from
   the page cache: the conversion's speed, not the disk's).
2. --parts=decode: speed at f32, bf16-mixed and int8: T(1), T(8) at batch 1 against
   --depth cached tokens (probes.CostProbe), T(8)/T(1), the params' bytes.
3. --parts=memory: F32, BF16 and Q8_0 files and a bf16 HF directory (or
   --memory_types=smollm2-135m, a file as it is), each loaded by
   checkpoint.load_model at each of --memory_dtypes in a fresh subprocess
   (PYTHONPATH=--src, so an older tree can be measured) and run (prefill and
   2 tokens): the peak resident memory of the load and of the whole run
   (XLA:CPU's float32 copies of bf16 weights show only in the run), the
   params' bytes, the ratios, what stays resident ('kept'), the load's seconds.

With --out_dir, the tables go to summary.md there and the memory rows to
load_memory.json. How the peak is measured, and the figures:
docs/gguf_int8.md.
"""

import json
import os
import subprocess
import sys
import time

import jax
from absl import flags

from specjax.formats import checkpoint
from specjax import cli
from specjax.decode import probes
from specjax.formats import gguf_weights
from specjax.model import steps
from specjax.metrics import timing
from specjax.model import llama as model_lib
from specjax import workdir as wd
from specjax.formats import gguf_write, hf
from specjax.bench.tables import format_size, markdown_table
from specjax.model.config import get_preset

_MODEL = flags.DEFINE_string("model", "llama-160m", "Preset whose shapes are written and timed.")
_TYPES = flags.DEFINE_list("types", ["F16", "Q8_0"], "GGUF tensor types to write and load.")
_DTYPES = flags.DEFINE_list("dtypes", ["float32", "bf16-mixed", "int8"], "Decode precisions.")
_DIR = flags.DEFINE_string("dir", "/tmp/specjax_gguf_bench", "Where the GGUF files go.")
_LOADS = flags.DEFINE_integer("loads", 2, "Timed loads per file (medians).", lower_bound=1)
_REPS = flags.DEFINE_integer("reps", 5, "Timed repetitions of each T(n) (medians).", lower_bound=1)
_DEPTH = flags.DEFINE_integer("depth", 128, "Tokens in the cache before each timed forward.")
_CAPACITY = flags.DEFINE_integer("capacity", 256, "KV-cache slots.")
_PARTS = flags.DEFINE_list("parts", ["load", "decode", "memory"], "What to measure.")
_MEM_TYPES = flags.DEFINE_list("memory_types", ["F32", "BF16", "Q8_0", "hf-bf16"],
                               "Files whose load and run memory is measured: GGUF types "
                               "written at --model's shapes, hf-bf16, or existing files as they "
                               "are (a .gguf path, a packaged model: smollm2-135m).")
_MEM_DTYPES = flags.DEFINE_list("memory_dtypes",
                                ["default", "float32", "bfloat16", "bf16-mixed", "int8"],
                                "Load precisions of the memory part ('default': the file's).")
_SRC = flags.DEFINE_string("src", None, "PYTHONPATH of the memory part's subprocesses "
                           "(default: this checkout).")
_OUT_DIR = flags.DEFINE_string("out_dir", None, "Where summary.md and load_memory.json go.")

# One load and a short run in a fresh interpreter: argv = path, dtype; prints one JSON line.
_MEASURE = r"""
import json, resource, sys, time
import gguf, jax, jax.numpy as jnp, tokenizers
from specjax.decode import generation
from specjax.formats import checkpoint
from specjax.model import steps
jnp.zeros(1).block_until_ready()
def status(key):
  for line in open("/proc/self/status"):
    if line.startswith(key + ":"):
      return int(line.split()[1]) * 1024
try:
  with open("/proc/self/clear_refs", "w") as f:
    f.write("5")  # resets VmHWM to VmRSS
  how = "VmHWM"
except OSError:
  how = "ru_maxrss"
before = status("VmRSS")
t0 = time.perf_counter()
cfg, params, _ = checkpoint.load_model(sys.argv[1], None if sys.argv[2] == "default" else sys.argv[2])
jax.block_until_ready(params)
seconds = time.perf_counter() - t0
hwm = lambda: (status("VmHWM") if how == "VmHWM"
               else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024)
peak, after = hwm(), status("VmRSS")
nbytes = sum(x.nbytes for x in jax.tree_util.tree_leaves(params))
t0 = time.perf_counter()  # the whole run: prefill and a 2-token decode loop, compiled and run
generation.generate(steps.Runner(cfg, params), [[1, 2, 3, 4, 5]], 2)
run_seconds, run_peak = time.perf_counter() - t0, hwm()
import specjax
print(json.dumps({"src": specjax.__file__, "precision": cfg.precision, "param_bytes": nbytes,
                  "peak": peak - before, "after": after - before, "seconds": seconds,
                  "run_peak": run_peak - before, "max_rss": run_peak,
                  "run_seconds": run_seconds, "how": how}))
"""


def load_speed(cfg, params) -> list[list[str]]:
  rows = []
  for name in _TYPES.value:
    path = os.path.join(_DIR.value, f"{cfg.name}-{name}.gguf")
    if name.upper() == "F16":
      gguf_write.write_gguf(path, cfg.with_dtype("float16"), params)
    else:
      gguf_write.write_gguf(path, cfg, params, tensor_type=name)
    size = os.path.getsize(path)
    times = []
    for _ in range(_LOADS.value):
      t0 = time.perf_counter()
      _, loaded, _ = gguf_weights.load_gguf(path)
      timing.block(loaded)
      times.append(time.perf_counter() - t0)
      del loaded
    t = sorted(times)[len(times) // 2]
    rows.append([name, format_size(size), f"{t:.2f}", f"{size / t / 1e6:.0f}"])
  return rows


def decode_speed(name: str) -> list[list[str]]:
  rows = []
  for dtype in _DTYPES.value:
    cfg, params, _ = checkpoint.load_model(name, dtype=dtype)
    probe = probes.CostProbe(steps.Runner(cfg, params), _CAPACITY.value, _DEPTH.value, k=4)
    t = probe.times([1, 8], reps=_REPS.value)
    t1, t8 = t[1].median, t[8].median
    rows.append([cfg.precision, format_size(model_lib.param_bytes(params)),
                 f"{1e3 * t1:.2f}", f"{1e3 * t8:.2f}", f"{t8 / t1:.2f}"])
    del params, probe
  return rows


def write_file(cfg, params, kind: str) -> str:
  """The preset's weights as a GGUF file of tensor type `kind` (F32, F16,
  BF16 or a quantized type) or, for 'hf-bf16', a bf16 HF directory; a
  packaged model's name or an existing file is used as it is."""
  if kind in checkpoint.PACKAGED or os.path.isfile(kind):
    return kind
  if kind == "hf-bf16":
    path = os.path.join(_DIR.value, f"{cfg.name}-hf-bf16")
    bf16 = cfg.with_dtype("bfloat16")
    hf.save_hf(path, bf16, jax.tree_util.tree_map(lambda x: x.astype(bf16.jnp_param_dtype),
                                                  params))
    return path
  path = os.path.join(_DIR.value, f"{cfg.name}-{kind}.gguf")
  plain = {"F32": "float32", "F16": "float16", "BF16": "bfloat16"}
  if kind.upper() in plain:
    gguf_write.write_gguf(path, cfg.with_dtype(plain[kind.upper()]), params)
  else:
    gguf_write.write_gguf(path, cfg, params, tensor_type=kind)
  return path


def measure_load(path: str, dtype: str) -> dict:
  """One load of `path` at `dtype` in a fresh interpreter (_MEASURE)."""
  src = _SRC.value or os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  env = dict(os.environ, PYTHONPATH=src, JAX_PLATFORMS=os.environ.get("JAX_PLATFORMS", ""))
  # cwd=src: `python -c` puts the working directory first on sys.path.
  spec = path if path in checkpoint.PACKAGED else os.path.abspath(path)
  proc = subprocess.run([sys.executable, "-c", _MEASURE, spec, dtype],
                        env=env, cwd=src, capture_output=True, text=True, timeout=1800,
                        check=False)
  if proc.returncode:
    return {"error": (proc.stderr.strip().splitlines() or ["?"])[-1]}
  return json.loads(proc.stdout.strip().splitlines()[-1])


def load_memory(cfg, params) -> tuple[list[list[str]], list[dict]]:
  rows, records = [], []
  for kind in _MEM_TYPES.value:
    path = write_file(cfg, params, kind)
    for dtype in _MEM_DTYPES.value:
      r = {"file": kind, "dtype": dtype, **measure_load(path, dtype)}
      records.append(r)
      if "error" in r:
        rows.append([kind, dtype, "error: " + r["error"][:80]] + [""] * 8)
        continue
      rows.append([kind, dtype, r["precision"], format_size(r["param_bytes"]),
                   format_size(r["peak"]), f"{r['peak'] / r['param_bytes']:.2f}",
                   format_size(r["run_peak"]), f"{r['run_peak'] / r['param_bytes']:.2f}",
                   format_size(r["max_rss"]),
                   format_size(r["after"] - r["param_bytes"]) if "after" in r else "",
                   f"{r['seconds']:.2f}"])
  return rows, records


def main(argv):
  del argv
  cfg = get_preset(_MODEL.value, "float32")
  os.makedirs(_DIR.value, exist_ok=True)
  params = model_lib.init_params(cfg, 0)
  out = []
  if "load" in _PARTS.value:
    out += [f"## Loading {cfg.name} GGUF files ({cfg.num_params() / 1e6:.0f} M params) "
            f"to float32 on {jax.default_backend()}, median of {_LOADS.value}\n",
            markdown_table(["type", "file", "load s", "MB/s"], load_speed(cfg, params),
                           [False] + [True] * 3)]
  records = []
  if "memory" in _PARTS.value:
    rows, records = load_memory(cfg, params)
    out += [f"## Load and run memory, {cfg.name} shapes or the file's: peak resident memory "
            "during the load, and during the load plus a 2-token run (prefill and decode "
            "loop), less before them; max RSS: the process's; one fresh process per row "
            f"(src: {_SRC.value or 'this checkout'})\n",
            markdown_table(["file", "--dtype", "loads as", "params", "load peak",
                            "load/params", "run peak", "run/params", "max RSS", "kept",
                            "load s"], rows, [False] * 3 + [True] * 8)]
  del params
  if "decode" in _PARTS.value:
    out += [f"## Decode, {cfg.name}, batch 1, depth {_DEPTH.value}, capacity "
            f"{_CAPACITY.value}, median of {_REPS.value} (4 forwards per jitted loop)\n",
            markdown_table(["precision", "params on device", "T(1) ms", "T(8) ms",
                            "T(8)/T(1)"], decode_speed(_MODEL.value), [False] + [True] * 4)]
  out.append(f"machine: {wd.machine_line(wd.environment())}")
  text = "\n\n".join(out) + "\n"
  print(text)
  if _OUT_DIR.value:
    os.makedirs(_OUT_DIR.value, exist_ok=True)
    with open(os.path.join(_OUT_DIR.value, "summary.md"), "w") as fh:
      fh.write(text)
    wd.write_json(os.path.join(_OUT_DIR.value, "load_memory.json"), records)


if __name__ == "__main__":
  cli.run(main)
