"""An EAGLE-3-style draft head (Li et al. 2025) for a specjax target: the
model, its files and the drafter (its training: specjax/train/eagle3.py).

The head fuses the target's features from three layers (low, middle, high:
layers 2, L//2 and L-3 of an L-layer target, stored in its config file)
through `fuse` (3E -> E), then runs EAGLE-1's core (drafters/eagle.py:
`fc` (2E -> E) over [embedding of x_{i+1} ; feature], one decoder layer,
the target's shapes) and its own final RMSNorm and LM head over a reduced
vocabulary ([V_d, E], the set stored beside it as vocab.VOCAB_FILE). Pair
i = (feature_i, x_{i+1}) sits at head-cache slot i, RoPE position i, as in
EAGLE-1. A real pair's feature is the fused target feature; a drafted
child's is the head's own output hidden state (pre-norm) at its parent:
EAGLE-3's recurrence, which its training (training-time test) feeds back
too. The step's bookkeeping (pending pairs, refresh) is EAGLE-1's:
docs/eagle.md.
"""

from __future__ import annotations

import dataclasses
import functools
import os
from pathlib import Path
from typing import Any, ClassVar, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct
from flax import traverse_util

from specjax import workdir as wd
from specjax.drafters import eagle
from specjax.drafters import network
from specjax.drafters import vocab
from specjax.errors import CheckpointError, ConfigError
from specjax.formats import safetensors_io
from specjax.model import kv_cache as kvc
from specjax.model import llama as model_lib
from specjax.model.config import ModelConfig
from specjax.model.layers import weight_init

CONFIG_FILE = "eagle3_config.json"
WEIGHTS_FILE = "model.safetensors"
FORMAT = "specjax-eagle-3"
# Shipped heads by name (specjax/train/eagle3.py); listed once their files exist.
SHIPPED_EAGLE3 = {name: Path(__file__).resolve().parents[1] / "assets" / name
                  for name in ("smollm2-eagle3",)
                  if (Path(__file__).resolve().parents[1] / "assets" / name / CONFIG_FILE
                      ).is_file()}

# The head's own final norm: a constant of the head (trained with it), not the target's.
NORM_EPS = 1e-6

# ---------------------------------------------------------------- the head


def default_layers(n_layers: int) -> tuple[int, int, int]:
  """EAGLE-3's low, middle and high layers of an L-layer target: 2, L//2,
  L-3 (each clipped into 0..L-1 for a shallow target)."""
  clip = lambda i: min(max(i, 0), n_layers - 1)
  return clip(2), clip(n_layers // 2), clip(n_layers - 3)


def head_config(target: ModelConfig) -> ModelConfig:
  """The head's layer: the target's shapes, one layer, float32 (as EAGLE-1's)."""
  return eagle.head_config(target).replace(name=f"{target.name}-eagle3")


class Head3(NamedTuple):
  """A loaded head: its layer's config, params (float32), the target layers
  it fuses, its reduced vocabulary (sorted target ids [V_d]) and its config
  file's dict."""
  cfg: ModelConfig
  params: Any
  layers: tuple[int, ...]
  ids: np.ndarray
  meta: dict


def fuse(hparams, target_feats):
  """The target's three layers' outputs [..., 3E] -> the fused feature [..., E]."""
  kernel = hparams["fuse"]["kernel"]  # [3E, E]
  return jnp.einsum("...f,fe->...e", target_feats.astype(kernel.dtype), kernel)


def head_forward3(hparams, tparams, feats, tokens, hcache: kvc.KVCache, hcfg: ModelConfig,
                  tcfg: ModelConfig, tree_mask=None):
  """T pairs (feats [B, T, E]: fused target features or the head's own
  outputs; tokens [B, T]) at hcache.lengths -> (the head's output hidden
  states [B, T, E] (pre-norm: the feature a child reads), hcache with
  lengths + T). tree_mask as eagle.head_forward's."""
  core = {"fc": hparams["fc"], "block": hparams["block"]}
  return eagle.head_forward(core, tparams, feats, tokens, hcache, hcfg, tcfg,
                            tree_mask=tree_mask)


def head_logits3(hparams, hidden):
  """The head's own final RMSNorm and LM head: hidden [..., E] -> float32
  logits over its reduced set [..., V_d] (column j: target id ids[j])."""
  x = hidden.astype(jnp.float32)
  x = x * jax.lax.rsqrt(jnp.mean(x * x, -1, keepdims=True) + NORM_EPS)
  return vocab.logits(hparams["lm_head"]["table"], x * hparams["norm"]["scale"])


def init_head3(hcfg: ModelConfig, ids_count: int, seed: int = 0):
  """Random head params: EAGLE-1's fc and block (eagle.init_head), `fuse`
  [3E, E] and the LM head table [ids_count, E] at normal(0.02), a unit norm."""
  core = eagle.init_head(hcfg, seed)
  k_fuse, k_head = jax.random.split(jax.random.PRNGKey(seed + 1))
  e, dt = hcfg.dim, hcfg.jnp_param_dtype
  return {"fuse": {"kernel": weight_init(k_fuse, (3 * e, e), dt)},
          "fc": core["fc"], "block": core["block"],
          "norm": {"scale": jnp.ones((e,), dt)},
          "lm_head": {"table": weight_init(k_head, (int(ids_count), e), dt)}}


def new_cache(hcfg: ModelConfig, batch: int, capacity: int) -> kvc.KVCache:
  """The head's own one-layer KV cache."""
  return kvc.init_cache(hcfg, batch, capacity)


# ---------------------------------------------------------------- files


def save_head3(path: str | os.PathLike, hcfg: ModelConfig, hparams, layers, ids,
               target_cfg: ModelConfig, target_name: str, special=(), dtype: str = "float32",
               extra: dict | None = None) -> Path:
  """Writes CONFIG_FILE (the head's config, its target layers, the target's),
  WEIGHTS_FILE (weights in `dtype`: float32 or bfloat16) and the reduced
  set (vocab.VOCAB_FILE, `special` ids required in it) into `path`."""
  if dtype not in ("float32", "bfloat16"):
    raise ConfigError(f"EAGLE-3 head weights: dtype {dtype!r}, expected float32 or bfloat16")
  layers = tuple(int(i) for i in layers)
  if len(layers) != 3 or not all(0 <= i < target_cfg.n_layers for i in layers):
    raise ConfigError(f"EAGLE-3 head: layers {layers} are not three layers of the target's "
                      f"{target_cfg.n_layers}")
  path = Path(path)
  path.mkdir(parents=True, exist_ok=True)
  vocab.save(path, ids, target_cfg.vocab_size, special)
  flat = traverse_util.flatten_dict(jax.device_get(hparams), sep="/")
  safetensors_io.write_safetensors(path / WEIGHTS_FILE, {
      k: np.asarray(jnp.asarray(v).astype(dtype)) for k, v in flat.items()})
  target_cfg = target_cfg.replace(vocab_multiple=1)  # as saved: no mesh padding
  wd.write_json(path / CONFIG_FILE, {"format": FORMAT, "head": hcfg.to_dict(),
                                     "layers": list(layers), "target": target_name,
                                     "target_config": target_cfg.to_dict(), "dtype": dtype,
                                     **(extra or {})})
  return path


def load_head3(path: str | os.PathLike) -> Head3:
  """The head in directory `path` (save_head3's), or a shipped head's name;
  weights as float32. CheckpointError (one line) on a missing or malformed file."""
  d = SHIPPED_EAGLE3.get(str(path), Path(path))
  file = d / CONFIG_FILE
  if not file.is_file():
    raise CheckpointError(f"EAGLE-3 head {str(path)!r}: {file} not found (shipped: "
                          f"{', '.join(SHIPPED_EAGLE3) or 'none yet'})")
  meta = wd.read_json(file)
  if meta.get("format") != FORMAT:
    raise CheckpointError(f"{file}: format {meta.get('format')!r}, expected {FORMAT!r}")
  hcfg = ModelConfig.from_dict(meta["head"])
  ids = vocab.load(d, hcfg.vocab_size)
  if ids is None:
    raise CheckpointError(f"EAGLE-3 head {str(path)!r}: {d / vocab.VOCAB_FILE} not found "
                          "(this head drafts over its reduced set)")
  try:
    flat = safetensors_io.read_safetensors(d / WEIGHTS_FILE)
  except Exception as e:  # pylint: disable=broad-except
    raise CheckpointError(f"cannot read {d / WEIGHTS_FILE}: {str(e)[:300]}") from e
  want = traverse_util.flatten_dict(jax.eval_shape(lambda: init_head3(hcfg, len(ids))), sep="/")
  if set(flat) != set(want) or any(tuple(flat[k].shape) != want[k].shape for k in want):
    raise CheckpointError(f"{d / WEIGHTS_FILE}: tensors do not match the head of {file} "
                          f"and its {len(ids)}-id set")
  params = traverse_util.unflatten_dict(
      {k: jnp.asarray(np.asarray(v, np.float32), hcfg.jnp_param_dtype) for k, v in flat.items()},
      sep="/")
  return Head3(hcfg, params, tuple(int(i) for i in meta.get("layers", ())), ids, meta)


def fit_error(head: Head3, target: ModelConfig) -> str | None:
  """Why `head` cannot draft for `target` (None: it fits): the widths of the
  features, embedding and vocabulary, and the three layers, must agree."""
  if (head.cfg.dim, head.cfg.vocab_size) != (target.dim, target.vocab_size):
    return (f"EAGLE-3 head {head.cfg.name} (dim {head.cfg.dim}, vocab {head.cfg.vocab_size}) "
            f"does not fit target {target.name or 'the target'} (dim {target.dim}, "
            f"vocab {target.vocab_size})")
  if len(head.layers) != 3 or max(head.layers) >= target.n_layers:
    return (f"EAGLE-3 head {head.cfg.name} reads layers {list(head.layers)}; target "
            f"{target.name or 'the target'} has {target.n_layers}")
  return None
