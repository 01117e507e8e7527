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
from specjax.model import quant
from specjax.model.config import ModelConfig
from specjax.model.layers import weight_init

CONFIG_FILE = "eagle3_config.json"
WEIGHTS_FILE = "model.safetensors"
# 2: `fuse` RMS-normalises each layer's output first; the LM head may be the
# target's own rows (LM_HEAD_TARGET, not stored); weights may be int8.
FORMAT = "specjax-eagle-3.2"
LM_HEAD_TARGET = "target"   # meta["lm_head"]: the target's rows of the set, frozen
LM_HEAD_OWN = "own"         # the head's own trained table, stored with it
DTYPES = ("float32", "bfloat16", "int8")
# Shipped heads by name (specjax/train/eagle3_stage.py); listed once their files exist.
_ASSETS = Path(__file__).resolve().parents[1] / "assets"
SHIPPED_EAGLE3 = {name: _ASSETS / name for name in ("smollm2-eagle3",)
                  if (_ASSETS / name / CONFIG_FILE).is_file()}

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
  """The target's three layers' outputs [..., 3E] -> the fused feature [..., E]:
  each layer's output RMS-normalised (their scales differ by orders of
  magnitude along the depth), then one linear map [3E, E]."""
  kernel = hparams["fuse"]["kernel"]  # [3E, E]
  x = target_feats.astype(jnp.float32)
  x = x.reshape(x.shape[:-1] + (3, x.shape[-1] // 3))
  x = x * jax.lax.rsqrt(jnp.mean(x * x, -1, keepdims=True) + NORM_EPS)
  return jnp.einsum("...f,fe->...e", x.reshape(target_feats.shape).astype(kernel.dtype), kernel)


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


def init_head3(hcfg: ModelConfig, ids_count: int, seed: int = 0, lm_head: str = LM_HEAD_OWN):
  """Random head params: EAGLE-1's fc and block (eagle.init_head), `fuse`
  [3E, E] and (lm_head LM_HEAD_OWN) the LM head table [ids_count, E] at
  normal(0.02), a unit norm. LM_HEAD_TARGET: no table (with_lm_head adds
  the target's rows)."""
  core = eagle.init_head(hcfg, seed)
  k_fuse, k_head = jax.random.split(jax.random.PRNGKey(seed + 1))
  e, dt = hcfg.dim, hcfg.jnp_param_dtype
  params = {"fuse": {"kernel": weight_init(k_fuse, (3 * e, e), dt)},
            "fc": core["fc"], "block": core["block"],
            "norm": {"scale": jnp.ones((e,), dt)}}
  if lm_head == LM_HEAD_OWN:
    params["lm_head"] = {"table": weight_init(k_head, (int(ids_count), e), dt)}
  return params


def lm_head_kind(hparams) -> str:
  """LM_HEAD_OWN when the params carry their table, else LM_HEAD_TARGET."""
  return LM_HEAD_OWN if "lm_head" in hparams else LM_HEAD_TARGET


def with_lm_head(hparams, tparams, ids):
  """Params whose logits head_logits3 can take: a head without its own
  table gets the target's LM head rows of `ids` (vocab.head_table)."""
  if "lm_head" in hparams:
    return hparams
  return {**hparams, "lm_head": {"table": vocab.head_table(tparams, ids).astype(jnp.float32)}}


def new_cache(hcfg: ModelConfig, batch: int, capacity: int) -> kvc.KVCache:
  """The head's own one-layer KV cache."""
  return kvc.init_cache(hcfg, batch, capacity)


# ---------------------------------------------------------------- files


def _stored(flat: dict, dtype: str) -> dict:
  """Flat params -> the tensors written: every leaf in `dtype`; in int8, each
  kernel [in, out] as `kernel_q` int8 and `kernel_scale` float32 [out]
  (model/quant.py, per output channel) and the other leaves in bfloat16."""
  if dtype != "int8":
    return {k: np.asarray(jnp.asarray(v).astype(dtype)) for k, v in flat.items()}
  out = {}
  for k, v in flat.items():
    if k.endswith("/kernel"):
      q, scale = quant.quantize_kernel(jnp.asarray(v))
      out[k + "_q"], out[k + "_scale"] = np.asarray(q), np.asarray(scale)
    else:
      out[k] = np.asarray(jnp.asarray(v).astype(jnp.bfloat16))
  return out


def _restored(tensors: dict, dtype: str) -> dict:
  """_stored's inverse: flat float32 params (int8 kernels dequantized)."""
  out = {}
  for k, v in tensors.items():
    if dtype == "int8" and k.endswith("/kernel_q"):
      base = k[:-len("_q")]
      out[base] = np.asarray(quant.dequantize_kernel(jnp.asarray(v),
                                                     jnp.asarray(tensors[base + "_scale"])))
    elif not (dtype == "int8" and k.endswith("/kernel_scale")):
      out[k] = np.asarray(v, np.float32)
  return out


def save_head3(path: str | os.PathLike, hcfg: ModelConfig, hparams, layers, ids,
               target_cfg: ModelConfig, target_name: str, special=(), dtype: str = "float32",
               extra: dict | None = None) -> Path:
  """Writes CONFIG_FILE (the head's config, its target layers, the target's,
  whose LM head it uses), WEIGHTS_FILE (weights in `dtype`: float32,
  bfloat16, or int8 kernels per output channel) and the reduced set
  (vocab.VOCAB_FILE, `special` ids required in it) into `path`. A head
  without its own table (LM_HEAD_TARGET) stores none: it reads the target's."""
  if dtype not in DTYPES:
    raise ConfigError(f"EAGLE-3 head weights: dtype {dtype!r}, expected one of {', '.join(DTYPES)}")
  layers = tuple(int(i) for i in layers)
  if len(layers) != 3 or not all(0 <= i < target_cfg.n_layers for i in layers):
    raise ConfigError(f"EAGLE-3 head: layers {layers} are not three layers of the target's "
                      f"{target_cfg.n_layers}")
  path = Path(path)
  path.mkdir(parents=True, exist_ok=True)
  vocab.save(path, ids, target_cfg.vocab_size, special)
  flat = traverse_util.flatten_dict(jax.device_get(hparams), sep="/")
  safetensors_io.write_safetensors(path / WEIGHTS_FILE, _stored(flat, dtype))
  target_cfg = target_cfg.replace(vocab_multiple=1)  # as saved: no mesh padding
  wd.write_json(path / CONFIG_FILE, {"format": FORMAT, "head": hcfg.to_dict(),
                                     "layers": list(layers), "target": target_name,
                                     "target_config": target_cfg.to_dict(), "dtype": dtype,
                                     "lm_head": lm_head_kind(hparams), **(extra or {})})
  return path


def load_head3(path: str | os.PathLike) -> Head3:
  """The head in directory `path` (save_head3's), or a shipped head's name;
  weights as float32 (without a table when meta["lm_head"] is
  LM_HEAD_TARGET: with_lm_head adds it). CheckpointError (one line) on a
  missing or malformed file."""
  d = SHIPPED_EAGLE3.get(str(path), Path(path))
  file = d / CONFIG_FILE
  if not file.is_file():
    raise CheckpointError(f"EAGLE-3 head {str(path)!r}: {file} not found (shipped: "
                          f"{', '.join(SHIPPED_EAGLE3) or 'none yet'})")
  meta = wd.read_json(file)
  if meta.get("format") != FORMAT:
    raise CheckpointError(f"{file}: format {meta.get('format')!r}, expected {FORMAT!r} "
                          "(retrain the head with this version)")
  kind, dtype = meta.get("lm_head", LM_HEAD_OWN), meta.get("dtype", "float32")
  if kind not in (LM_HEAD_OWN, LM_HEAD_TARGET) or dtype not in DTYPES:
    raise CheckpointError(f"{file}: lm_head {kind!r} or dtype {dtype!r} is not one this "
                          "version reads")
  hcfg = ModelConfig.from_dict(meta["head"])
  ids = vocab.load(d, hcfg.vocab_size)
  if ids is None:
    raise CheckpointError(f"EAGLE-3 head {str(path)!r}: {d / vocab.VOCAB_FILE} not found "
                          "(this head drafts over its reduced set)")
  try:
    flat = _restored(safetensors_io.read_safetensors(d / WEIGHTS_FILE), dtype)
  except Exception as e:  # pylint: disable=broad-except
    raise CheckpointError(f"cannot read {d / WEIGHTS_FILE}: {str(e)[:300]}") from e
  want = traverse_util.flatten_dict(
      jax.eval_shape(lambda: init_head3(hcfg, len(ids), lm_head=kind)), sep="/")
  if set(flat) != set(want) or any(tuple(flat[k].shape) != want[k].shape for k in want):
    raise CheckpointError(f"{d / WEIGHTS_FILE}: tensors do not match the head of {file} "
                          f"and its {len(ids)}-id set")
  params = traverse_util.unflatten_dict(
      {k: jnp.asarray(v, hcfg.jnp_param_dtype) for k, v in flat.items()}, sep="/")
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


def shipped_head_for(target: ModelConfig) -> str:
  """The name of the shipped head that fits `target` (ConfigError, one line, if none)."""
  names = [n for n in SHIPPED_EAGLE3 if fit_error(_load_cached(n), target) is None]
  if len(names) != 1:
    shipped = ", ".join(f"{n} (for {_load_cached(n).meta.get('target', '?')})"
                        for n in SHIPPED_EAGLE3) or "none yet"
    raise ConfigError(f"no shipped EAGLE-3 head fits target {target.name or 'the target'} "
                      f"(dim {target.dim}, vocab {target.vocab_size}); shipped: {shipped}; "
                      "give one with --drafter=eagle3:PATH")
  return names[0]


@functools.lru_cache(maxsize=4)
def _load_cached(path: str) -> Head3:
  return load_head3(path)


# ---------------------------------------------------------------- the drafter


@struct.dataclass
class Pending3:
  """The pairs the next draft phase feeds first: the last verify's target
  features (three layers, fused when fed) and the kept tokens paired with
  them, from head-cache slot `start` (eagle.Pending's, without x_start)."""
  feats: jax.Array   # [B, W, 3E], W = sc.carried (eagle.pad_pairs)
  tokens: jax.Array  # [B, W] (real up to k+1)
  start: jax.Array   # [B]

  def settled(self, n) -> "Pending3":
    """eagle.cut_to_root (no current token to carry)."""
    return eagle.cut_to_root(self, n)


@struct.dataclass
class Feed3:
  """One step's feeding state: fed index f is head slot base + f (base =
  n - 2, the root's pair, already cached); each fed node's output hidden
  state (its children's feature)."""
  hcache: kvc.KVCache
  base: jax.Array   # [B]
  feats: jax.Array  # [B, F, E] (index 0: the root's output at pair n - 2)


def refresh3(hparams, tparams, hcache, pending: Pending3, n, sc, pairs: int):
  """A step's first part: the head over the first `pairs` pending pairs
  (fused target features) from `start` (SpecConfig.refresh_pairs), rolled
  back to the real pairs (length n - 1). Returns (hcache, the root's output
  hidden state [B, 1, E], at pair n - 2)."""
  hcache = kvc.rollback(hcache, pending.start)
  fused = fuse(hparams, pending.feats[:, :pairs])
  out, hcache = head_forward3(hparams, tparams, fused, pending.tokens[:, :pairs], hcache,
                              sc.draft, sc.target)
  hcache = kvc.rollback(hcache, n - 1)  # the real pairs only
  return hcache, eagle.root_of(out, pending, n)


@functools.partial(jax.jit, static_argnames=("hcfg", "tcfg", "width"))
def _prefill_head3(hparams, tparams, feats, tokens, lens, first, hcache, *, hcfg, tcfg, width):
  """Head cache <- pairs 0..P-2 of each prompt (fused features [B, Tb, 3E]);
  pending <- (f_{P-1}, x_P) at slot P-1, padded to `width` pairs."""
  b, tb = tokens.shape
  # pair i = (f_i, x_{i+1}): the prompt shifted left, x_P (the first token) at P-1
  nxt = jnp.concatenate([tokens[:, 1:], jnp.zeros((b, 1), jnp.int32)], 1)
  nxt = jnp.where(jnp.arange(tb)[None] == (lens - 1)[:, None], first[:, None], nxt)
  _, hcache = head_forward3(hparams, tparams, fuse(hparams, feats), nxt, hcache, hcfg, tcfg)
  hcache = kvc.rollback(hcache, lens - 1)
  last = jnp.take_along_axis(feats, (lens - 1)[:, None, None], 1)  # [B, 1, 3E]
  return eagle.HeadState(hcache=hcache, pending=Pending3(
      feats=eagle.pad_pairs(last, width), tokens=eagle.pad_pairs(first[:, None], width),
      start=lens - 1))


@dataclasses.dataclass(frozen=True)
class Eagle3Drafter(network.NetworkDrafter):
  """The EAGLE-3 head at `path` as a drafter (spec 'eagle3:PATH', or
  'eagle3': the head shipped for the loaded target, `for_target`). State:
  eagle.HeadState over Pending3; the verify's three-layer features
  (`feature_layers`) come through commit. The prompt's come from a target
  prefill pass of init's own. Chains, static and dynamic trees: the walkers.
  Its LM head covers the set stored with it, so it takes no ':vocab='."""
  path: str = ""  # "": the head shipped for the target (for_target names it)
  kind: ClassVar[str] = "eagle3"
  needs_features: ClassVar[bool] = True

  def __post_init__(self):
    if self.vocab:
      raise ConfigError(f"drafter eagle3 drafts over the set stored with its head; "
                        f"':vocab={self.vocab}' is not accepted")

  @property
  def base_spec(self) -> str:
    return f"eagle3:{self.path}" if self.path else "eagle3"

  def head(self) -> Head3:
    if not self.path:
      raise ConfigError("drafter 'eagle3' names no head yet: resolve it for the target "
                        "(Drafter.for_target, as SpecConfig does)")
    return _load_cached(self.path)

  @property
  def feature_layers(self) -> tuple[int, ...]:
    return tuple(self.head().layers)

  def own_params(self, dparams) -> int:
    """The head's stored params (the target's embedding, and its LM head
    rows when the head reads them, are the target's)."""
    return model_lib.param_count(self.head().params)

  def for_target(self, target):
    return self if self.path else dataclasses.replace(self, path=shipped_head_for(target))

  def draft_config(self, target, draft):
    head = self.for_target(target).head()
    error = fit_error(head, target)
    if error:
      raise ConfigError(error)
    return head.cfg

  def draft_params(self, tparams, draft):
    head = self.head()
    return {"head": with_lm_head(head.params, tparams, head.ids), "target": tparams,
            "ids": jnp.asarray(head.ids)}

  def logits(self, dparams, hidden, sc):
    """The head's logits over its set, expanded to target ids (q = 0 outside)."""
    return vocab.expand(head_logits3(dparams["head"], hidden), dparams["ids"],
                        sc.target.padded_vocab)

  def init(self, sc, target, dparams, prompts, capacity, first):
    _, _, feats = target.prefill(prompts, target.new_cache(len(prompts), capacity),
                                 return_hidden=True, hidden_layers=self.feature_layers)
    tokens = np.zeros((len(prompts), feats.shape[1]), np.int32)
    for b, p in enumerate(prompts):
      tokens[b, :len(p)] = p
    lens = jnp.asarray([len(p) for p in prompts], jnp.int32)
    return _prefill_head3(dparams["head"], dparams["target"], feats, jnp.asarray(tokens), lens,
                          jnp.asarray(first, jnp.int32), new_cache(sc.draft, len(prompts),
                                                                   capacity),
                          hcfg=sc.draft, tcfg=sc.target, width=sc.carried)

  def begin(self, dparams, dstate, tcache, tail, n, live, sc, width):
    hcache, root = refresh3(dparams["head"], dparams["target"], dstate.hcache, dstate.pending,
                            n, sc, sc.refresh_pairs(n.shape[0]))
    b = n.shape[0]
    feats = jnp.zeros((b, width, root.shape[-1]), root.dtype).at[:, :1].set(root)
    return Feed3(hcache=hcache, base=n - 2, feats=feats), jnp.zeros((b,), bool)

  def feed(self, dparams, fst, tokens, lo, anc, parent, sc):
    if isinstance(lo, int) and lo == 0:  # the root: its pair is cached, its output known
      return self.logits(dparams, fst.feats[:, :1], sc), fst
    feats = jnp.take_along_axis(fst.feats, parent[:, :, None], 1)  # the parents' outputs
    out, hcache = head_forward3(dparams["head"], dparams["target"], feats, tokens,
                                kvc.rollback(fst.hcache, fst.base + lo), sc.draft, sc.target,
                                tree_mask=None if anc is None else anc[..., 1:])
    fst = fst.replace(hcache=hcache,
                      feats=jax.lax.dynamic_update_slice_in_dim(fst.feats, out, lo, 1))
    return self.logits(dparams, out, sc), fst

  def end(self, dparams, fst, dstate, tcache, n, sc):
    return dstate.replace(hcache=kvc.rollback(fst.hcache, n - 1)), tcache

  def settle(self, dparams, dstate, n, sc):
    hcache, _ = refresh3(dparams["head"], dparams["target"], dstate.hcache, dstate.pending, n,
                         sc, sc.carried)
    return dstate.replace(hcache=hcache, pending=dstate.pending.settled(n))

  def commit(self, dstate, c):
    # As EAGLE-1's (docs/eagle.md): the verified features with the kept
    # tokens from the old length's slot (a tree's: along its accepted path);
    # a row that was not live keeps its pending pairs.
    width = dstate.pending.tokens.shape[1]  # the run's widest step's (SpecConfig.carried)
    new = Pending3(feats=eagle.pad_pairs(c.features, width),
                   tokens=eagle.pad_pairs(c.emitted, width), start=c.n_prev - 1)
    pick = lambda a, b: jnp.where(c.live.reshape((-1,) + (1,) * (a.ndim - 1)), a, b)
    return dstate.replace(pending=jax.tree_util.tree_map(pick, new, dstate.pending))
