"""Model configuration: one frozen dataclass and the presets.

Axis names used across specjax (shape comments, einsum strings):
  B batch, T new tokens, S cache capacity, L layers, E model dim, H query heads,
  K kv heads, G = H // K query heads per kv head, D head dim, F FFN dim, V vocab.

The config is hashable (frozen, tuples only), so it can be a static argument of
jitted functions: one compilation per (config, shape).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax.numpy as jnp

from specjax.errors import ConfigError

DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "float16": jnp.float16}
DTYPE_ALIASES = {"f32": "float32", "fp32": "float32", "bf16": "bfloat16",
                 "f16": "float16", "fp16": "float16", "half": "float16"}


# The mixed-precision mode: bf16 weights, bf16 matmul operands accumulated in
# f32, everything else (norms, softmax, residual stream, cache) in f32.
MIXED = "bf16-mixed"
MIXED_ALIASES = ("mixed", "bf16-mixed", "bf16_mixed")
# Weight-only int8: the q/k/v/o/gate/up/down projections and the lm_head as
# int8 with one float32 scale per output channel, computed in float32
# (layers.QDense, specjax/quant.py); embedding and norms float32.
INT8 = "int8"
QUANT_MODES = (INT8,)


def canonical_precision(name: str) -> str:
  """A dtype name (canonical_dtype), the mixed mode 'bf16-mixed' or 'int8'."""
  if str(name).lower() in MIXED_ALIASES:
    return MIXED
  return INT8 if str(name).lower() == INT8 else canonical_dtype(name)


def canonical_dtype(name: str) -> str:
  """Maps 'bf16', 'fp32', ... to the canonical names in DTYPES."""
  name = DTYPE_ALIASES.get(str(name).lower(), str(name).lower())
  if name not in DTYPES:
    raise ConfigError(f"unknown dtype {name!r}; valid: {', '.join(DTYPES)} "
                      f"(or {', '.join(DTYPE_ALIASES)})")
  return name


# The attention kinds (layers.Attention): 'blocked' visits KV blocks up to the
# used length (built for XLA:CPU, where it pays); 'masked' is one masked pass
# over the capacity; 'fused' is jax.nn.dot_product_attention (cuDNN's fused
# kernel on a GPU in 16-bit, XLA's elsewhere). 'auto' is resolved per backend
# at model load (for_backend): on a GPU the blocked loop was 2.7-4.8x slower
# than the masked pass at capacity 4096 (H200, docs/results.md).
ATTENTIONS = ("auto", "blocked", "masked", "fused")
BACKEND_ATTENTION = {"gpu": "masked"}  # other backends keep 'auto', which runs 'blocked'


def for_backend(cfg: "ModelConfig", backend: str) -> "ModelConfig":
  """cfg with attention 'auto' resolved for `backend` ('cpu', 'gpu', ...):
  the backend's kind where BACKEND_ATTENTION names one, else cfg unchanged
  (so a CPU config stays equal to its preset). An explicit kind is kept."""
  kind = BACKEND_ATTENTION.get(backend)
  if cfg.attention != "auto" or kind is None:
    return cfg
  return cfg.replace(attention=kind)


@dataclasses.dataclass(frozen=True)
class RopeScaling:
  """LLaMA-3 style RoPE frequency scaling (HF rope_type 'llama3')."""
  factor: float = 8.0
  low_freq_factor: float = 1.0
  high_freq_factor: float = 4.0
  original_max_position: int = 8192


@dataclasses.dataclass(frozen=True)
class ModelConfig:
  """Shape and numerics of one LLaMA-family model."""
  name: str
  vocab_size: int
  dim: int                      # E, the residual width
  n_layers: int                 # L
  n_heads: int                  # H
  n_kv_heads: int               # K; H % K == 0 (grouped-query attention)
  ffn_dim: int                  # F, SwiGLU hidden width
  norm_eps: float = 1e-5
  rope_theta: float = 10000.0
  rope_scaling: RopeScaling | None = None
  max_seq_len: int = 2048       # longest sequence (prompt + generation)
  tie_embeddings: bool = False  # lm_head shares the embedding matrix
  head_dim: int | None = None   # D; defaults to dim // n_heads
  dtype: str = "float32"        # compute dtype
  param_dtype: str = "float32"  # storage dtype of the weights
  dot_dtype: str | None = None  # matmul operand dtype, accumulated in `dtype`; None = dtype
  attn_block: int = 256         # KV slots per attention block (cost follows the used
                                # length); 0 = one masked pass over the capacity
  attention: str = "auto"       # 'blocked' | 'masked' | 'fused' (ATTENTIONS); 'auto': the
                                # backend's (for_backend, at model load; blocked if unresolved)
  scan_layers: bool = False     # the layers as one lax.scan over their stacked weights
                                # (llama.scan_blocks; same logits, fewer ops to launch)
  bos_token_id: int | None = None
  eos_token_id: int | None = None
  quant: str | None = None      # 'int8': weight-only int8 projections (see INT8)
  vocab_multiple: int = 1       # the embedding and LM head hold padded_vocab rows: V
                                # rounded up to this multiple (a mesh's model axis,
                                # sharding.pad_vocab); never saved (see padded_vocab)

  def __post_init__(self):
    if self.quant not in (None,) + QUANT_MODES:
      raise ConfigError(f"{self.name}: quant must be one of {QUANT_MODES} or None, "
                        f"got {self.quant!r}")
    if int(self.vocab_multiple) < 1:
      raise ConfigError(f"{self.name}: vocab_multiple must be >= 1, got {self.vocab_multiple}")
    if int(self.attn_block) < 0:
      raise ConfigError(f"{self.name}: attn_block must be >= 0, got {self.attn_block}")
    if self.attention not in ATTENTIONS:
      raise ConfigError(f"{self.name}: attention must be one of {', '.join(ATTENTIONS)}, "
                        f"got {self.attention!r}")
    for field in ("vocab_size", "dim", "n_layers", "n_heads", "n_kv_heads",
                  "ffn_dim", "max_seq_len"):
      if int(getattr(self, field)) <= 0:
        raise ConfigError(f"{self.name}: {field} must be positive, "
                          f"got {getattr(self, field)}")
    if self.n_heads % self.n_kv_heads:
      raise ConfigError(f"{self.name}: n_heads={self.n_heads} is not a multiple "
                        f"of n_kv_heads={self.n_kv_heads}")
    if self.head_dim is None and self.dim % self.n_heads:
      raise ConfigError(f"{self.name}: dim={self.dim} is not a multiple of "
                        f"n_heads={self.n_heads}; set head_dim")
    object.__setattr__(self, "dtype", canonical_dtype(self.dtype))
    object.__setattr__(self, "param_dtype", canonical_dtype(self.param_dtype))
    if self.dot_dtype is not None:
      object.__setattr__(self, "dot_dtype", canonical_dtype(self.dot_dtype))

  @property
  def d_head(self) -> int:
    return self.head_dim or self.dim // self.n_heads

  @property
  def padded_vocab(self) -> int:
    """Rows of the embedding and columns of the LM head: vocab_size rounded
    up to vocab_multiple. A vocabulary the mesh's model axis does not divide
    (32001, 50277, ...) is padded so that both split evenly over it; the
    padded ids are never looked up (tokens are < vocab_size), their logits
    are masked (llama.mask_padded_logits) and saving strips them
    (llama.strip_vocab), so a checkpoint always holds vocab_size."""
    m = self.vocab_multiple
    return -(-self.vocab_size // m) * m

  @property
  def jnp_dtype(self):
    return DTYPES[self.dtype]

  @property
  def jnp_param_dtype(self):
    return DTYPES[self.param_dtype]

  def replace(self, **kw: Any) -> "ModelConfig":
    return dataclasses.replace(self, **kw)

  @property
  def precision(self) -> str:
    """'float32', 'bfloat16', ..., 'bf16-mixed' (see MIXED) or 'int8'."""
    if self.quant:
      return self.quant
    if self.dot_dtype == "bfloat16" and self.param_dtype == "bfloat16" and \
        self.dtype == "float32":
      return MIXED
    return self.dtype

  def with_dtype(self, dtype: str) -> "ModelConfig":
    """Same model with compute and parameter dtype both set to `dtype`, or
    the mixed mode ('bf16-mixed': bf16 weights and matmul operands, f32
    accumulation and everything else in f32), or 'int8' (see INT8)."""
    precision = canonical_precision(dtype)
    if precision == MIXED:
      return self.replace(dtype="float32", param_dtype="bfloat16", dot_dtype="bfloat16",
                          quant=None)
    if precision == INT8:
      return self.replace(dtype="float32", param_dtype="float32", dot_dtype=None,
                          quant=INT8)
    return self.replace(dtype=precision, param_dtype=precision, dot_dtype=None, quant=None)

  def num_params(self) -> int:
    e, f, d = self.dim, self.ffn_dim, self.d_head
    attn = e * d * (self.n_heads * 2 + self.n_kv_heads * 2)
    layer = attn + 3 * e * f + 2 * e
    head = 0 if self.tie_embeddings else self.vocab_size * e
    return self.n_layers * layer + self.vocab_size * e + head + e

  def to_dict(self) -> dict[str, Any]:
    return dataclasses.asdict(self)

  @classmethod
  def from_dict(cls, d: dict[str, Any]) -> "ModelConfig":
    d = dict(d)
    if d.get("rope_scaling") is not None:
      d["rope_scaling"] = RopeScaling(**d["rope_scaling"])
    names = {f.name for f in dataclasses.fields(cls)}
    unknown = set(d) - names
    if unknown:
      raise ConfigError(f"unknown config fields: {sorted(unknown)}")
    return cls(**d)


def _llama(name, vocab, dim, layers, heads, kv, ffn, **kw) -> ModelConfig:
  return ModelConfig(name=name, vocab_size=vocab, dim=dim, n_layers=layers,
                     n_heads=heads, n_kv_heads=kv, ffn_dim=ffn, **kw)


# Published shapes (from each model's HF config.json).
_PRESETS: dict[str, ModelConfig] = {c.name: c for c in [
    # JackFram/llama-160m, the draft in the seed thread.
    _llama("llama-160m", 32000, 768, 12, 12, 12, 3072, norm_eps=1e-6,
           max_seq_len=2048, bos_token_id=1, eos_token_id=2),
    _llama("llama-7b", 32000, 4096, 32, 32, 32, 11008, norm_eps=1e-6,
           max_seq_len=2048, bos_token_id=1, eos_token_id=2),
    _llama("open-llama-7b-v2", 32000, 4096, 32, 32, 32, 11008, norm_eps=1e-6,
           max_seq_len=2048, bos_token_id=1, eos_token_id=2),
    _llama("llama-2-7b", 32000, 4096, 32, 32, 32, 11008, norm_eps=1e-5,
           max_seq_len=4096, bos_token_id=1, eos_token_id=2),
    _llama("llama-2-13b", 32000, 5120, 40, 40, 40, 13824, norm_eps=1e-5,
           max_seq_len=4096, bos_token_id=1, eos_token_id=2),
    _llama("codellama-7b", 32016, 4096, 32, 32, 32, 11008, norm_eps=1e-5,
           rope_theta=1e6, max_seq_len=16384, bos_token_id=1, eos_token_id=2),
    _llama("codellama-34b", 32000, 8192, 48, 64, 8, 22016, norm_eps=1e-5,
           rope_theta=1e6, max_seq_len=16384, bos_token_id=1, eos_token_id=2),
    _llama("llama-2-70b", 32000, 8192, 80, 64, 8, 28672, norm_eps=1e-5,
           max_seq_len=4096, bos_token_id=1, eos_token_id=2),
    _llama("tinyllama-1.1b", 32000, 2048, 22, 32, 4, 5632, norm_eps=1e-5,
           max_seq_len=2048, bos_token_id=1, eos_token_id=2),
    _llama("llama-3.2-1b", 128256, 2048, 16, 32, 8, 8192, norm_eps=1e-5,
           rope_theta=500000.0, max_seq_len=131072, tie_embeddings=True,
           rope_scaling=RopeScaling(32.0, 1.0, 4.0, 8192),
           bos_token_id=128000, eos_token_id=128001),
    _llama("llama-3-8b", 128256, 4096, 32, 32, 8, 14336, norm_eps=1e-5,
           rope_theta=500000.0, max_seq_len=8192,
           bos_token_id=128000, eos_token_id=128001),
    # A CPU-friendly pair of realistic LLaMA shapes (32k vocab, GQA on the
    # target) for default runs: the target costs ~0.2 B params, the draft is
    # several times cheaper per token.
    _llama("cpu-target", 32000, 1024, 12, 16, 4, 2816, max_seq_len=1024,
           bos_token_id=1, eos_token_id=2),
    _llama("cpu-draft", 32000, 512, 2, 8, 4, 1408, max_seq_len=1024,
           bos_token_id=1, eos_token_id=2),
    # Tiny models for tests: compile in well under a second. Attention blocks
    # of 8 slots, so the tests' caches (16-128 slots) take the blocked path.
    _llama("tiny", 256, 64, 2, 4, 2, 128, max_seq_len=128, attn_block=8),
    _llama("tiny-draft", 256, 32, 1, 2, 1, 64, max_seq_len=128, attn_block=8),
    _llama("tiny-mha", 256, 64, 2, 4, 4, 128, max_seq_len=128, attn_block=8),
]}


def preset_names() -> list[str]:
  return list(_PRESETS)


def get_preset(name: str, dtype: str | None = None) -> ModelConfig:
  """Returns the preset `name`, optionally with compute/param dtype set."""
  if name not in _PRESETS:
    raise ConfigError(f"unknown preset {name!r}; valid presets: "
                      f"{', '.join(preset_names())}")
  cfg = _PRESETS[name]
  return cfg.with_dtype(dtype) if dtype else cfg
