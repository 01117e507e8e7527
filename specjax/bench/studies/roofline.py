"""The roofline of the machine a run is on: the decode step's bytes against
the memory bandwidth (data sheet or measured), the measured peaks (FLOP/s of
a square product, read bandwidth of a sum), and the lower bound of a
product of M rows."""

from __future__ import annotations
import jax
import jax.numpy as jnp
import numpy as np
from specjax.metrics import timing
from specjax.model.config import ModelConfig
from specjax.workdir import Record


# Peak DRAM/HBM bandwidth in GB/s by device kind (vendor data sheets).
DEVICE_BANDWIDTH_GBS = {
    "H200": 4800.0, "H100 SXM": 3350.0, "H100 PCIe": 2000.0, "H100": 3350.0,
    "A100-SXM4-80GB": 2039.0, "A100 80GB": 1935.0, "A100": 1555.0, "L40S": 864.0,
    "L4": 300.0, "V100": 900.0, "RTX 4090": 1008.0, "RTX 3090": 936.0, "T4": 320.0,
}


def device_bandwidth_gbs(device_kind: str) -> float | None:
  """Peak bandwidth of a device kind string ('NVIDIA H200', ...), or None."""
  for name, gbs in DEVICE_BANDWIDTH_GBS.items():  # longest names come first
    if name.lower() in device_kind.lower():
      return gbs
  return None


def attended_slots(cfg: ModelConfig, capacity: int, length: int) -> int:
  """Cache slots one decode step reads at `length` used slots: whole
  attention blocks up to the used length (layers.attend_blocked), or the
  whole capacity (attend_masked, and the fused kind's mask)."""
  block = cfg.attn_block
  if block and capacity > block and cfg.attention in ("auto", "blocked"):
    return min(capacity, -(-int(length) // block) * block)
  return capacity


def decode_bytes(cfg: ModelConfig, param_bytes: int, kv_slots: int, batch: int = 1) -> int:
  """Bytes one decode step must read: every weight once, plus the K and V
  cache of every layer over `kv_slots` slots (attended_slots)."""
  item = np.dtype(cfg.jnp_dtype).itemsize
  cache = 2 * cfg.n_layers * batch * kv_slots * cfg.n_kv_heads * cfg.d_head * item
  return param_bytes + cache


def roofline_fraction(cfg: ModelConfig, param_bytes: int, kv_slots: int, step_s: float,
                      bandwidth_gbs: float) -> float:
  """Achieved / peak bandwidth for a decode step of step_s seconds."""
  return decode_bytes(cfg, param_bytes, kv_slots) / step_s / (bandwidth_gbs * 1e9)


def measure_read(reps: int = 5, read_mib: int = 512, dtype=jnp.float32) -> timing.Timing:
  """Time of summing a read_mib MiB array of `dtype` (memory-bound): the
  read bandwidth is read_mib MiB / its median."""
  dtype = jnp.dtype(dtype)
  big = jnp.ones(((read_mib << 20) // dtype.itemsize,), dtype)
  total = jax.jit(lambda x: jnp.sum(x, dtype=jnp.float32))
  return timing.measure(lambda: total(big), reps=reps)


def measure_peaks(reps: int = 5, n: int = 2048, read_mib: int = 512,
                  dtype=jnp.float32) -> Record:
  """This backend's measured ceilings in `dtype` (float32 by default): FLOP/s
  of one square n x n x n product (compute-bound) and the bandwidth of
  summing a read_mib MiB array (measure_read); medians of `reps`, compile
  excluded. What a skinny product could reach, next to what it does
  (experiments/dot_bench.py, experiments/gpu_check.py)."""
  a = jax.random.normal(jax.random.PRNGKey(0), (n, n), jnp.dtype(dtype))
  mm = jax.jit(lambda x: x @ x)
  t_mm = timing.measure(lambda: mm(a), reps=reps)
  t_rd = measure_read(reps, read_mib, dtype)
  return {"peak_gflops": 2 * n ** 3 / t_mm.median / 1e9,
          "read_gbs": (read_mib << 20) / t_rd.median / 1e9,
          "compile_s": t_mm.compile_s + t_rd.compile_s}


def roofline_bound(m: int, n_params: int, bytes_per_param: float, peak_gflops: float,
                   read_gbs: float) -> float:
  """Lower bound on the time of a product of m rows with n_params weights:
  the weights read once at read_gbs, or 2 m n_params FLOPs at peak_gflops,
  whichever is longer. Its ratio to m = 1 stays 1 up to the ridge point
  m* = peak x bytes_per_param / (2 x bandwidth)."""
  return max(n_params * bytes_per_param / (read_gbs * 1e9),
             2.0 * m * n_params / (peak_gflops * 1e9))
