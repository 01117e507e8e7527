"""An EAGLE-1 draft head (Li et al. 2024) for a specjax target: the model, its
files and the drafter (its training: specjax/train/eagle.py).

The head is one decoder layer (layers.Block, the target's shapes) over
fc([embedding of x_{i+1} ; the target's feature f_i (; embedding of x_i)]);
its output predicts f_{i+1}, and the target's own LM head turns a predicted
feature into the next token's logits (the head holds only `fc` and `block`).
Pair i = (f_i, x_{i+1}) sits at head-cache slot i, RoPE position i.
Between steps the state keeps `pending`: the last verify's features and the
kept tokens; a step first runs the head over them (`refresh`, rolled back
to the real pairs: head length n - 1, the target cache's), then feeds its
drafts, each pair reading its parent's predicted feature (the walkers:
drafters/walkers.py). The index derivation, training loss and files:
docs/eagle.md.
"""

from __future__ import annotations

import dataclasses
import functools
import os
from pathlib import Path
from typing import Any, ClassVar

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from specjax.formats import safetensors_io
from specjax.drafters import dynamic
from specjax.drafters import network
from specjax.drafters import ngram
from specjax.drafters import vocab
from specjax.model import kv_cache as kvc
from specjax.model import llama as model_lib
from specjax import workdir as wd
from specjax.model.config import ModelConfig
from specjax.errors import CheckpointError, ConfigError
from specjax.model.layers import Block, weight_init

CONFIG_FILE = "eagle_config.json"
WEIGHTS_FILE = "model.safetensors"
FORMAT = "specjax-eagle-1"
# Shipped heads by name: the stdlib target's, and SmolLM2-135M-Instruct's
# (specjax/train/selfdistill.py; experiments/train_smollm2.py).
SHIPPED_EAGLE = {name: Path(__file__).resolve().parents[1] / "assets" / name
                 for name in ("stdlib-eagle", "smollm2-eagle")}

# ---------------------------------------------------------------- the head


def head_config(target: ModelConfig) -> ModelConfig:
  """The head's layer: the target's shapes, one layer, float32 (trained and
  run in float32 whatever the target's precision; an int8 target keeps a
  float head)."""
  return target.replace(name=f"{target.name}-eagle", n_layers=1, quant=None,
                        dtype="float32", param_dtype="float32", dot_dtype=None,
                        vocab_multiple=1)  # no vocabulary params of its own


def fits(hcfg: ModelConfig, target: ModelConfig) -> bool:
  """The head reads the target's features, embedding and LM head: their widths agree."""
  return (hcfg.dim, hcfg.vocab_size) == (target.dim, target.vocab_size)


def _described(cfg: ModelConfig) -> str:
  return f"{cfg.name or 'the target'} (dim {cfg.dim}, vocab {cfg.vocab_size})"


def check_head(hcfg: ModelConfig, target: ModelConfig) -> None:
  if not fits(hcfg, target):
    raise ConfigError(f"EAGLE head {_described(hcfg)} does not fit target {_described(target)}")


def shipped_head_for(target: ModelConfig) -> str:
  """The name of the shipped head that fits `target` (ConfigError, one line, if none)."""
  names = [n for n in SHIPPED_EAGLE if fits(_load_cached(n)[0], target)]
  if len(names) != 1:
    shipped = ", ".join(f"{n} (for {_load_cached(n)[2].get('target', '?')})"
                        for n in SHIPPED_EAGLE)
    raise ConfigError(f"no shipped EAGLE head fits target {_described(target)}; shipped: "
                      f"{shipped}; give one with --drafter=eagle:PATH")
  return names[0]


class EagleHead(nn.Module):
  """fc([embedding ; feature (; the pair's current token's embedding)]) ->
  one decoder layer -> predicted feature."""
  cfg: ModelConfig

  @nn.compact
  def __call__(self, feats, embeds, positions, k_cache, v_cache, lengths, tree_mask=None,
               prev_embeds=None):
    # feats, embeds, prev_embeds [B, T, E]; positions [B, T]; k_cache, v_cache [B, K, S, D]
    cfg = self.cfg
    parts = [embeds, feats] + ([] if prev_embeds is None else [prev_embeds])
    x = jnp.concatenate([a.astype(cfg.jnp_dtype) for a in parts], -1)
    x = nn.Dense(cfg.dim, use_bias=True, dtype=cfg.jnp_dtype,
                 param_dtype=cfg.jnp_param_dtype, kernel_init=weight_init, name="fc")(x)
    return Block(cfg, name="block")(x, positions, k_cache, v_cache, lengths, tree_mask)


def _init_head(hcfg: ModelConfig, key, prev_token: bool = False):
  cache = kvc.init_cache(hcfg, 1, 1)
  z = jnp.zeros((1, 1, hcfg.dim), hcfg.jnp_dtype)
  pos = jnp.zeros((1, 1), jnp.int32)
  return EagleHead(hcfg).init(key, z, z, pos, cache.k[0], cache.v[0], cache.lengths, None,
                              z if prev_token else None)["params"]


_init_head_jit = jax.jit(_init_head, static_argnums=(0, 2))


def init_head(hcfg: ModelConfig, seed: int = 0, prev_token: bool = False):
  """Random head params (normal(0.02) kernels, zero fc bias, unit norms).
  prev_token: the head also reads each pair's current token (fc 3E -> E;
  `reads_prev_token`)."""
  return _init_head_jit(hcfg, jax.random.PRNGKey(seed), bool(prev_token))


def reads_prev_token(hparams) -> bool:
  """Whether a head's fc reads a third input, the embedding of each pair's
  current token x_i next to (f_i, x_{i+1}) (static: from the fc's shape).

  Why: a copy (an induction step, "x_i came before y once, so y follows x
  again") needs each position's own token as its attention key; the
  target's final feature f_i mostly holds its prediction of x_{i+1}, not
  x_i, and a one-layer head cannot compose a previous-token step with the
  copy, so the pair hands x_i over itself."""
  fc = hparams["fc"]["kernel"]
  return fc.shape[0] == 3 * fc.shape[1]


def new_cache(hcfg: ModelConfig, batch: int, capacity: int) -> kvc.KVCache:
  """The head's own one-layer KV cache."""
  return kvc.init_cache(hcfg, batch, capacity)


def head_forward(hparams, tparams, feats, tokens, hcache: kvc.KVCache, hcfg: ModelConfig,
                 tcfg: ModelConfig, tree_mask=None, prev_tokens=None):
  """T pairs (feats [B, T, E], tokens [B, T]) at hcache.lengths ->
  (predicted next features [B, T, E], hcache with lengths + T).

  prev_tokens [B, T]: each pair's current token (x_i of pair (f_i, x_{i+1}));
  read by a head that `reads_prev_token`, ignored by one that does not.

  tree_mask [T, W] (optional): the pairs are the last T of a W-wide token
  tree block begun W - T slots back, as in llama.forward (each attends to
  the slots before the block and to its ancestors-or-self in it, at
  position block start + its depth there)."""
  if tree_mask is None:
    positions = hcache.lengths[:, None] + jnp.arange(tokens.shape[1])[None, :]
  else:
    prior = jnp.shape(tree_mask)[-1] - tokens.shape[1]
    positions = hcache.lengths[:, None] - prior + model_lib.tree_depths(tree_mask)
  embeds = model_lib.embed_tokens(tparams, tokens, tcfg)
  prev = None
  if reads_prev_token(hparams):
    if prev_tokens is None:
      raise ConfigError("this EAGLE head reads each pair's current token: pass prev_tokens")
    prev = model_lib.embed_tokens(tparams, prev_tokens, tcfg)
  out, k, v = EagleHead(hcfg).apply({"params": hparams}, feats, embeds, positions,
                                    hcache.k[0], hcache.v[0], hcache.lengths, tree_mask, prev)
  return out, kvc.KVCache(k=(k,), v=(v,), lengths=hcache.lengths + tokens.shape[1])


# ---------------------------------------------------------------- files


def _flat(tree, prefix=""):
  out = {}
  for k, v in tree.items():
    name = f"{prefix}/{k}" if prefix else k
    out.update(_flat(v, name) if isinstance(v, dict) else {name: v})
  return out


def save_head(path: str | os.PathLike, hcfg: ModelConfig, hparams, target_cfg: ModelConfig,
              target_name: str, dtype: str = "float32", extra: dict | None = None) -> Path:
  """Writes eagle_config.json + model.safetensors (weights in `dtype`)."""
  path = Path(path)
  path.mkdir(parents=True, exist_ok=True)
  tensors = {k: np.asarray(jnp.asarray(v).astype(dtype)) for k, v in
             _flat(jax.device_get(hparams)).items()}
  safetensors_io.write_safetensors(path / WEIGHTS_FILE, tensors)
  target_cfg = target_cfg.replace(vocab_multiple=1)  # as saved: no mesh padding
  wd.write_json(path / CONFIG_FILE, {"format": FORMAT, "head": hcfg.to_dict(),
                                     "target": target_name, "target_config": target_cfg.to_dict(),
                                     "dtype": dtype, **(extra or {})})
  return path


def load_eagle(path: str | os.PathLike) -> tuple[ModelConfig, Any, dict]:
  """(head config, head params in float32, the config file's dict).

  `path`: a directory written by save_head, or a shipped head's name."""
  d = SHIPPED_EAGLE.get(str(path), Path(path))
  file = d / CONFIG_FILE
  if not file.is_file():
    raise CheckpointError(f"EAGLE head {path!r}: {file} not found (shipped: "
                          f"{', '.join(SHIPPED_EAGLE)})")
  meta = wd.read_json(file)
  if meta.get("format") != FORMAT:
    raise CheckpointError(f"{file}: format {meta.get('format')!r}, expected {FORMAT!r}")
  hcfg = ModelConfig.from_dict(meta["head"])
  from safetensors.numpy import load_file  # pylint: disable=import-outside-toplevel
  try:
    flat = load_file(str(d / WEIGHTS_FILE))
  except Exception as e:  # pylint: disable=broad-except
    raise CheckpointError(f"cannot read {d / WEIGHTS_FILE}: {str(e)[:300]}") from e
  kernel = flat.get("fc/kernel")
  prev = kernel is not None and kernel.shape[0] == 3 * hcfg.dim
  want = _flat(jax.eval_shape(lambda: init_head(hcfg, prev_token=prev)))
  if set(flat) != set(want) or any(flat[k].shape != want[k].shape for k in want):
    raise CheckpointError(f"{d / WEIGHTS_FILE}: tensors do not match the head of {file}")
  params: dict = {}
  for k, v in flat.items():
    node = params
    *parents, leaf = k.split("/")
    for p in parents:
      node = node.setdefault(p, {})
    node[leaf] = jnp.asarray(np.asarray(v, np.float32), hcfg.jnp_param_dtype)
  return hcfg, params, meta


# ---------------------------------------------------------------- the drafter


@struct.dataclass
class Pending:
  """The pairs the next draft phase feeds first (module docstring)."""
  feats: jax.Array   # [B, W, E] features of the last verify (or the prompt's last);
                     # W = sc.carried, the run's widest step's gamma + 1
  tokens: jax.Array  # [B, W] the tokens paired with them (real up to k+1)
  start: jax.Array   # [B] head-cache slot of the first pair
  prev: jax.Array    # [B] the first pair's current token x_start (reads_prev_token)

  def prev_tokens(self):
    """[B, W]: each pending pair's current token (x_start, then the
    tokens of the pairs before it)."""
    return jnp.concatenate([self.prev[:, None], self.tokens[:, :-1]], 1)

  def settled(self, n) -> "Pending":
    """cut_to_root, with the root pair's current token as x_start."""
    return cut_to_root(self, n).replace(prev=root_of(self.prev_tokens(), self, n)[:, 0])


@struct.dataclass
class HeadState:
  """The drafter's state (SpecState.dcache): the head's cache, the pending pairs and, for a
  tree with a grafted prompt-lookup chain (DynamicTree.ngram), ngram.py's history (else None)."""
  hcache: kvc.KVCache
  pending: Pending
  hist: Any = None


@struct.dataclass
class HeadFeed:
  """The head's feeding state for one step: fed index f is head slot base + f
  (base = n - 2, the root's pair, already cached); each fed node's
  predicted feature and token (a child's pair reads its parent's)."""
  hcache: kvc.KVCache
  base: jax.Array    # [B]
  feats: jax.Array   # [B, F, E] (index 0: the root's g_{n-2})
  tokens: jax.Array  # [B, F] (index 0: the root, x_{n-1})


def pad_pairs(a, width: int):
  """A step's pairs [B, k, ...] -> [B, width, ...], zero pairs after them:
  a pending state as wide as the run's widest step (SpecConfig.carried), so
  steps of any candidate continue it. The refresh feeds the padding after
  the real pairs and rolls it back with the rest past n - 1; the root's
  index n - 2 - start is unchanged."""
  return jnp.pad(a, [(0, 0), (0, width - a.shape[1])] + [(0, 0)] * (a.ndim - 2))


def refresh(tparams, hparams, hcache, pending: Pending, n, sc, pairs: int):
  """A step's first part: the head over the first `pairs` pending pairs
  from `start` (SpecConfig.refresh_pairs), rolled back to the real pairs
  (length n - 1). Returns (hcache, the root's feature g_{n-2} [B, 1, E])."""
  hcache = kvc.rollback(hcache, pending.start)
  pred, hcache = head_forward(hparams, tparams, pending.feats[:, :pairs],
                              pending.tokens[:, :pairs], hcache, sc.draft, sc.target,
                              prev_tokens=pending.prev_tokens()[:, :pairs])
  hcache = kvc.rollback(hcache, n - 1)  # the real pairs only
  return hcache, root_of(pred, pending, n)


def root_index(pending, n):
  """[B] the root pair's index among the pending pairs (slot n - 2)."""
  return jnp.clip(n - 2 - pending.start, 0, pending.tokens.shape[1] - 1)


def root_of(out, pending, n):
  """[B, 1, ...] the root pair's entry of a refresh's output [B, pairs, ...]."""
  idx = jnp.minimum(root_index(pending, n), out.shape[1] - 1)
  return jnp.take_along_axis(out, idx.reshape(idx.shape + (1,) * (out.ndim - 1)), 1)


def cut_to_root(pending, n):
  """Pending pairs (either head's) cut to the root's alone, from slot n - 2 (the
  rest is cached): Drafter.settle's result, continued by a one-pair refresh."""
  width = pending.tokens.shape[1]
  cut = lambda a: pad_pairs(root_of(a, pending, n), width)
  return pending.replace(feats=cut(pending.feats), tokens=cut(pending.tokens), start=n - 2)


@functools.partial(jax.jit, static_argnames=("hcfg", "tcfg", "width"))
def _prefill_head(hparams, tparams, hidden, tokens, lens, first, hcache, *, hcfg, tcfg,
                  width):
  """Head cache <- pairs 0..P-2 of each prompt; pending <- (f_{P-1}, x_P),
  padded to `width` pairs."""
  b, tb = tokens.shape
  # pair i = (f_i, x_{i+1}): the prompt shifted left, x_P (the first token) at P-1
  nxt = jnp.concatenate([tokens[:, 1:], jnp.zeros((b, 1), jnp.int32)], 1)
  nxt = jnp.where(jnp.arange(tb)[None] == (lens - 1)[:, None], first[:, None], nxt)
  _, hcache = head_forward(hparams, tparams, hidden, nxt, hcache, hcfg, tcfg,
                           prev_tokens=tokens)
  hcache = kvc.rollback(hcache, lens - 1)
  last = jnp.take_along_axis(hidden, (lens - 1)[:, None, None], 1)  # [B, 1, E]
  prev = jnp.take_along_axis(tokens, (lens - 1)[:, None], 1)[:, 0]  # x_{P-1}
  return HeadState(hcache=hcache, pending=Pending(
      feats=pad_pairs(last, width), tokens=pad_pairs(first[:, None], width), start=lens - 1,
      prev=prev))


_LOOKUP = ngram.NgramDrafter(1, 4)  # a grafted chain's lookup (DynamicTree.ngram)


@functools.lru_cache(maxsize=4)
def _load_cached(path: str):
  return load_eagle(path)


@dataclasses.dataclass(frozen=True)
class EagleDrafter(network.NetworkDrafter):
  """The EAGLE head at `path` as a drafter (spec 'eagle:PATH', or 'eagle':
  the shipped head of the loaded target, `for_target`). State: HeadState; the verify's features
  come through commit (needs_features). The prompt's features come from a
  target prefill pass of init's own (the engine's prefill returns none):
  one extra prompt pass per call, outside the decode loop. Its chains and
  trees are the walkers' (drafters/walkers.py); a tree's step is committed
  as the chain of its accepted path."""
  path: str = ""  # "": the head shipped for the target (for_target names it)
  kind: ClassVar[str] = "eagle"
  needs_features: ClassVar[bool] = True
  can_graft: ClassVar[bool] = True  # its state keeps the history for the lookup

  def own_params(self, dparams) -> int:
    return model_lib.param_count(dparams["head"])  # the target's embedding: only read

  @property
  def base_spec(self) -> str:
    return f"eagle:{self.path}" if self.path else "eagle"

  def for_target(self, target):
    return self if self.path else dataclasses.replace(self, path=shipped_head_for(target))

  def draft_config(self, target, draft):
    hcfg = _load_cached(self.for_target(target).path)[0]
    check_head(hcfg, target)
    return hcfg

  def draft_params(self, tparams, draft):
    if not self.path:
      raise ConfigError("drafter 'eagle' names no head yet: resolve it for the target "
                        "(Drafter.for_target, as SpecConfig does)")
    hcfg, hparams, _ = _load_cached(self.path)
    ids = self.vocab_ids(hcfg.vocab_size, SHIPPED_EAGLE.get(self.path, Path(self.path)))
    return vocab.attach({"head": hparams, "target": tparams}, tparams, ids)

  def logits(self, dparams, g, sc):
    """Next-token logits of predicted features g [..., E]: the target's LM
    head, or its rows of the reduced set (expanded to target ids)."""
    out = vocab.draft_logits(dparams, g, sc.target.padded_vocab)
    return model_lib.head_logits(dparams["target"], g, sc.target) if out is None else out

  def init(self, sc, target, dparams, prompts, capacity, first):
    _, _, hidden = target.prefill(prompts, target.new_cache(len(prompts), capacity),
                                  return_hidden=True)
    tokens = np.zeros((len(prompts), hidden.shape[1]), np.int32)
    for b, p in enumerate(prompts):
      tokens[b, :len(p)] = p
    lens = jnp.asarray([len(p) for p in prompts], jnp.int32)
    state = _prefill_head(dparams["head"], dparams["target"], hidden, jnp.asarray(tokens),
                          lens, jnp.asarray(first, jnp.int32),
                          new_cache(sc.draft, len(prompts), capacity), hcfg=sc.draft,
                          tcfg=sc.target, width=sc.carried)
    graft = sc.tree is not None and sc.tree.graft  # the lookup's history: ngram.py's state
    return state.replace(hist=_LOOKUP.init(sc, target, None, prompts, capacity, first) if graft
                         else None)

  def begin(self, dparams, dstate, tcache, tail, n, live, sc, width):
    hcache, root = refresh(dparams["target"], dparams["head"], dstate.hcache, dstate.pending,
                           n, sc, sc.refresh_pairs(n.shape[0]))
    b = n.shape[0]
    feats = jnp.zeros((b, width, root.shape[-1]), root.dtype).at[:, :1].set(root)
    tokens = jnp.zeros((b, width), jnp.int32).at[:, 0].set(tail[:, 1])
    return HeadFeed(hcache=hcache, base=n - 2, feats=feats, tokens=tokens), jnp.zeros((b,), bool)

  def feed(self, dparams, fst, tokens, lo, anc, parent, sc):
    tparams = dparams["target"]
    if isinstance(lo, int) and lo == 0:  # the root: its pair is cached, its feature known
      return self.logits(dparams, fst.feats[:, :1], sc), fst
    feats = jnp.take_along_axis(fst.feats, parent[:, :, None], 1)  # the parents' [B, w, E]
    g, hcache = head_forward(dparams["head"], tparams, feats, tokens,
                             kvc.rollback(fst.hcache, fst.base + lo), sc.draft, sc.target,
                             tree_mask=None if anc is None else anc[..., 1:],
                             prev_tokens=jnp.take_along_axis(fst.tokens, parent, 1))
    fst = fst.replace(hcache=hcache,
                      feats=jax.lax.dynamic_update_slice_in_dim(fst.feats, g, lo, 1),
                      tokens=jax.lax.dynamic_update_slice_in_dim(fst.tokens, tokens, lo, 1))
    return self.logits(dparams, g, sc), fst

  def end(self, dparams, fst, dstate, tcache, n, sc):
    return dstate.replace(hcache=kvc.rollback(fst.hcache, n - 1)), tcache

  def settle(self, dparams, dstate, n, sc):
    hcache, _ = refresh(dparams["target"], dparams["head"], dstate.hcache, dstate.pending, n,
                        sc, sc.carried)
    return dstate.replace(hcache=hcache, pending=dstate.pending.settled(n))

  def propose_tree(self, dparams, dstate, tcache, tail, n, live, key, sc):
    d, dstate, tcache = network.NetworkDrafter.propose_tree(self, dparams, dstate, tcache, tail,
                                                            n, live, key, sc)
    if sc.tree.graft:  # the prompt-lookup chain, grafted on
      chain, n_chain = ngram.ngram_propose(dstate.hist, n, sc.tree.graft, _LOOKUP.n_min,
                                           _LOOKUP.n_max)
      d = dynamic.graft_chain(d, chain, jnp.where(live, n_chain, 0))
    return d, dstate, tcache

  def commit(self, dstate, c):
    # A token tree's step (c.path) is the chain of its accepted path: the
    # verify's features along [root, path] (speculative.commit reorders
    # them) with the path's tokens, from the same slot.
    # The next draft phase feeds the verified features with the kept tokens
    # from the old length's slot. A row that was not live keeps its pending
    # pairs: its state stays that of its output.
    # the first new pair's current token x_{n_prev-1}: the old pending's last real pair's token
    old = dstate.pending
    prev = jnp.take_along_axis(old.tokens, jnp.clip(c.n_prev - 2 - old.start, 0,
                                                    old.tokens.shape[1] - 1)[:, None], 1)[:, 0]
    width = old.tokens.shape[1]  # the run's widest step's (SpecConfig.carried)
    new = Pending(feats=pad_pairs(c.features, width), tokens=pad_pairs(c.emitted, width),
                  start=c.n_prev - 1, prev=prev)
    pick = lambda a, b: jnp.where(c.live.reshape((-1,) + (1,) * (a.ndim - 1)), a, b)
    hist = None if dstate.hist is None else _LOOKUP.commit(dstate.hist, c)
    return dstate.replace(pending=jax.tree_util.tree_map(pick, new, dstate.pending), hist=hist)
