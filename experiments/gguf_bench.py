"""GGUF load speed and int8 decode speed, at a preset's shapes.

  python experiments/gguf_bench.py --model=llama-160m

1. Writes the preset's random weights as GGUF files (formats.gguf_write.
   write_gguf: F16 by numpy, Q8_0 by gguf.quants.quantize), then loads each
   with specjax (gguf_weights.load_gguf: memory map, gguf.quants.dequantize,
   float32 on device) --loads times: median wall seconds until the params
   are on device, and file MB / s. The file was just written, so it is read
   from the page cache: this is the conversion's speed, not the disk's.
2. Decode speed of the same preset at f32, bf16-mixed and int8 (weight-only):
   T(1) and T(8), one forward over 1 and 8 new tokens at batch 1 against a
   cache holding --depth tokens (probes.CostProbe: k forwards in one jitted
   loop, compile excluded, median of --reps), T(8)/T(1), and the params'
   bytes on device.
"""

import os
import time

import jax
from absl import flags

from specjax.formats import checkpoint
from specjax import cli
from specjax.decode import probes
from specjax.formats import gguf as gguf_file
from specjax.formats import gguf_weights
from specjax.model import steps
from specjax.metrics import timing
from specjax.model import llama as model_lib
from specjax import workdir as wd
from specjax.formats import gguf_write
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


def main(argv):
  del argv
  cfg = get_preset(_MODEL.value, "float32")
  os.makedirs(_DIR.value, exist_ok=True)
  params = model_lib.init_params(cfg, 0)
  load = load_speed(cfg, params)
  del params
  print(f"## Loading {cfg.name} GGUF files ({cfg.num_params() / 1e6:.0f} M params) to "
        f"float32 on {jax.default_backend()}, median of {_LOADS.value}\n")
  print(markdown_table(["type", "file", "load s", "MB/s"], load, [False] + [True] * 3))
  print(f"\n## Decode, {cfg.name}, batch 1, depth {_DEPTH.value}, capacity "
        f"{_CAPACITY.value}, median of {_REPS.value} (4 forwards per jitted loop)\n")
  print(markdown_table(["precision", "params on device", "T(1) ms", "T(8) ms", "T(8)/T(1)"],
                       decode_speed(_MODEL.value), [False] + [True] * 4))
  print(f"\nmachine: {wd.machine_line(wd.environment())}")


if __name__ == "__main__":
  cli.run(main)
