"""Weight-only int8: per-output-channel symmetric quantization of the
projection kernels (`--dtype=int8`, ModelConfig.quant).

Every bias-free projection kernel w [in, out] (q, k, v, o, gate, up, down
and the lm_head) becomes
  kernel_q     int8 [in, out]   round(w / scale), clipped to [-127, 127]
  kernel_scale f32  [out]       max |w[:, j]| / 127 (1 where a column is 0)
and layers.QDense computes (x @ kernel_q) * scale in float32, the kernel
staying int8 in device memory; the embedding and the norms stay float32.
Every float source quantizes the same way (`quantize_model`; HF and GGUF
files a block of rows at a time, `quantize_rows`, bit-identical), so the
float model is never held whole. How the product runs on CPU, the accuracy,
and a Q8_0 file's requantization: docs/gguf_int8.md, "int8 weights".
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from specjax.model import sharding
from specjax.model.config import INT8, ModelConfig
from specjax.errors import ConfigError


# Both divisions written as the products XLA makes of them anyway (amax / 127
# as amax * (1 / 127), w / scale as w * (1 / scale)), so that quantize_rows
# (NumPy) gives quantize_kernel's bits on every backend.
INV_127 = np.float32(1.0 / 127.0)


def quantize_kernel(w: jax.Array) -> tuple[jax.Array, jax.Array]:
  """w [in, out] -> (int8 [in, out], float32 scale [out]), symmetric per
  output channel."""
  w = w.astype(jnp.float32)
  amax = jnp.max(jnp.abs(w), axis=0)
  scale = jnp.where(amax > 0, amax * INV_127, 1.0)
  q = jnp.clip(jnp.round(w * (1.0 / scale)), -127, 127).astype(jnp.int8)
  return q, scale


def quantize_rows(w: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
  """quantize_kernel in NumPy on the torch layout, for a loader reading a
  kernel's rows (its output channels) a block at a time: w [out, in] ->
  (int8 [out, in], float32 scale [out]), bit-identical to quantize_kernel(w.T)
  (the same float32 operations; round half to even in both)."""
  w = np.asarray(w, np.float32)
  amax = np.max(np.abs(w), axis=1)
  scale = np.where(amax > 0, amax * INV_127, np.float32(1.0)).astype(np.float32)
  q = np.clip(np.round(w * (np.float32(1.0) / scale)[:, None]), -127, 127).astype(np.int8)
  return q, scale


def dequantize_kernel(q: jax.Array, scale: jax.Array) -> jax.Array:
  return q.astype(jnp.float32) * scale


def quantize_params(params):
  """Every {'kernel': w} (a Dense) of a params tree as {'kernel_q',
  'kernel_scale'}; everything else as it is."""
  if isinstance(params, dict) or hasattr(params, "items"):
    if set(params) == {"kernel"}:
      q, scale = quantize_kernel(params["kernel"])
      return {"kernel_q": q, "kernel_scale": scale}
    return {k: quantize_params(v) for k, v in params.items()}
  return params


def quantize_model(cfg: ModelConfig, params, role: str = "target"):
  """(cfg, float params) -> (int8 cfg, int8 params), placed for `role` on
  the active mesh (sharding.role_shardings)."""
  if cfg.quant:
    raise ConfigError(f"{cfg.name}: the params are already quantized ({cfg.quant})")
  qcfg = cfg.with_dtype(INT8)
  shapes = jax.eval_shape(quantize_params, params)
  out = sharding.role_shardings(qcfg, shapes, role)
  return qcfg, jax.jit(quantize_params, out_shardings=out)(params)
