"""Weight-only int8: per-output-channel symmetric quantization of the
projection kernels (`--dtype=int8`, ModelConfig.quant).

Every bias-free projection kernel w [in, out] (q, k, v, o, gate, up, down
and the lm_head) becomes
  kernel_q     int8 [in, out]   round(w / scale), clipped to [-127, 127]
  kernel_scale f32  [out]       max |w[:, j]| / 127 (1 where a column is 0)
and layers.QDense computes (x @ kernel_q) * scale in float32, so the kernel
stays int8 in device memory. The embedding (a gather, not a product) and the
norms stay float32; with tied embeddings the output product uses the float
embedding.

Any float checkpoint quantizes the same way (presets: random init, then
quantize; HF, orbax and GGUF files: load in float32, then quantize). A Q8_0
GGUF is dequantized and requantized per channel: its 32-value blocks carry
finer scales than one per channel, so the result is not bit-identical to the
file's values (within one int8 step of the channel's scale).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from specjax.model import sharding
from specjax.model.config import INT8, ModelConfig
from specjax.errors import ConfigError


def quantize_kernel(w: jax.Array) -> tuple[jax.Array, jax.Array]:
  """w [in, out] -> (int8 [in, out], float32 scale [out]), symmetric per
  output channel."""
  w = w.astype(jnp.float32)
  amax = jnp.max(jnp.abs(w), axis=0)
  scale = jnp.where(amax > 0, amax / 127.0, 1.0)
  q = jnp.clip(jnp.round(w / scale), -127, 127).astype(jnp.int8)
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
