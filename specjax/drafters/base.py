"""Drafters: what proposes the gamma tokens a speculative step verifies.

A drafter is static config (a frozen, hashable dataclass, part of
SpecConfig and so a jit static argument), parsed from one spec string
(`parse`, the scripts' --drafter):
  model           the draft model (--model_draft): gamma T=1 steps over its own
                  KV cache (speculative.draft_phase), with the catch-up after a
                  fully accepted step. The engine's original behaviour.
  ngram[:A-B]     prompt lookup (no model): the most recent earlier occurrence
                  of the last n tokens of the row's history (prompt and
                  output), n from B down to A, proposes the tokens that
                  followed it. Default 1-4, llama.cpp's lookup range
                  (LLAMA_NGRAM_MIN / MAX in common/ngram-cache.h); vLLM's
                  `ngram` method defaults to 5-5 (prompt_lookup_min / max),
                  HF's prompt lookup to n = 2 only.
  layerskip:N     self-speculation by early exit: the target's first N layers,
                  then its final norm and LM head, on the target's own weight
                  arrays. Those layers' K/V for a token depend only on the
                  tokens, so the draft shares the target's cache of them: the
                  verify rewrites the slots the draft wrote, and no catch-up is
                  ever needed. N = n_layers is the target itself.
  layerskip:0-9,12,15
                  the listed target layers (strictly increasing). A list that
                  is exactly 0..N-1 is layerskip:N; any other keeps its own
                  cache for the kept layers, handled like the draft model's
                  (catch-up included).
  eagle[:PATH]    an EAGLE-1 head (specjax/eagle.py) over the target's
                  features, with the target's embedding and LM head; PATH a
                  head directory, default the shipped stdlib-eagle.

The interface (speculative.py calls only these; every method but `init` and
`draft_params` runs traced inside the jitted step):
  draft_config(target, draft)  -> the ModelConfig the drafter runs (None for
                                  ngram); raises ConfigError for a bad spec
  draft_params(tparams, draft) -> the pytree passed to propose as `dparams`
                                  (host side; references arrays, no copy)
  init(sc, target, dparams, prompts, capacity, first) -> dstate
                                  (host side, after the target's prefill):
                                  the drafter's state, any pytree, carried in
                                  SpecState.dcache
  propose(dparams, dstate, tcache, tail, n, live, key, sc)
                               -> (Drafted, dstate, tcache): gamma tokens per
                                  row, their q (or none: `deterministic`),
                                  n_drafted (0..gamma); may write the target's
                                  cache (layerskip's shared layers) but must
                                  leave its lengths as they were
  commit(dstate, c: Committed) -> dstate: told what the step kept (tokens,
                                  counts, new lengths and, for drafters with
                                  `needs_features`, the target's hidden
                                  states at the verified positions)
and three flags: `deterministic` (q = onehot(x): accept phase uses p(x) and
the residual max(0, p - onehot(x)); no V-wide q is carried),
`needs_draft_model` (speculative.generate requires a draft Runner) and
`needs_features` (the verify returns the target's final-normed hidden
states [B, gamma+1, E], passed to commit).
"""

from __future__ import annotations

import dataclasses
from typing import Any, ClassVar

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from specjax.model import kv_cache as kvc
from specjax.model import steps
from specjax.model.config import ModelConfig
from specjax.errors import ConfigError


@struct.dataclass
class Drafted:
  """What the draft phase proposes."""
  tokens: jax.Array     # [B, gamma] (any id past n_drafted; never accepted)
  q: jax.Array          # [B, gamma, V] draft distributions ([B, gamma, 0] unless needs_q)
  n_drafted: jax.Array  # [B] tokens really drafted (< gamma after an early stop or no match)
  caught_up: jax.Array  # [B] bool: the row's d_gamma of the last step was fed first


@struct.dataclass
class Committed:
  """What a step kept, as a drafter's commit sees it (live rows; a finished
  row's fields say it kept nothing: n == n_prev, kept == 0)."""
  n_prev: jax.Array    # [B] sequence length before the step
  n: jax.Array         # [B] sequence length after it (prompt + kept tokens)
  n_acc: jax.Array     # [B] drafts accepted
  emitted: jax.Array   # [B, gamma+1] d_1..d_k, the target's token; the first `kept` are kept
  kept: jax.Array      # [B] tokens kept (n_acc + 1, less what n_predict / EOS cut off)
  live: jax.Array      # [B] bool: the row was live during the step
  d_len: jax.Array     # [B] a gamma-step draft cache's length after the step (catch-up rule)
  features: Any = None  # [B, gamma+1, E] target hidden states at [last, d_1..d_gamma]
                        # (needs_features), else None


@dataclasses.dataclass(frozen=True)
class Drafter:
  """The interface (see the module docstring); subclasses are static config."""
  kind: ClassVar[str] = ""
  deterministic: ClassVar[bool] = False
  needs_draft_model: ClassVar[bool] = False
  needs_features: ClassVar[bool] = False
  # the state's shapes do not depend on gamma, so steps of different gammas
  # continue each other (autogamma's requirement)
  gamma_free_state: ClassVar[bool] = True

  @property
  def spec(self) -> str:
    """The canonical spec string (parse(d.spec) == d)."""
    return self.kind

  def __str__(self) -> str:
    return self.spec

  def draft_config(self, target: ModelConfig, draft: ModelConfig | None) -> ModelConfig | None:
    raise NotImplementedError

  def draft_params(self, tparams, draft: steps.Runner | None):
    raise NotImplementedError

  def init(self, sc, target: steps.Runner, dparams, prompts, capacity: int, first):
    raise NotImplementedError

  def propose(self, dparams, dstate, tcache: kvc.KVCache, tail, n, live, key, sc):
    raise NotImplementedError

  def commit(self, dstate, c: Committed):
    raise NotImplementedError


def _draft_phase():
  """speculative.draft_phase, looked up at call time (speculative imports
  this module; tests patch the phase there)."""
  from specjax.decode import speculative  # pylint: disable=import-outside-toplevel
  return speculative.draft_phase


def _rollback_draft_cache(dcache: kvc.KVCache, c: Committed) -> kvc.KVCache:
  """A gamma-step draft cache after commit: d_len, cut to what was kept."""
  return kvc.rollback(dcache, jnp.minimum(c.d_len, c.n - 1))


@dataclasses.dataclass(frozen=True)
class ModelDrafter(Drafter):
  """The draft model: its own KV cache, gamma T=1 steps in a lax.scan."""
  kind: ClassVar[str] = "model"
  needs_draft_model: ClassVar[bool] = True

  def draft_config(self, target, draft):
    if draft is None:
      raise ConfigError("drafter 'model' needs a draft model (--model_draft)")
    return draft

  def draft_params(self, tparams, draft):
    if draft is None:
      raise ConfigError("drafter 'model' needs a draft model (--model_draft)")
    return draft.params

  def init(self, sc, target, dparams, prompts, capacity, first):
    m = steps.Runner(sc.draft, dparams)
    return m.prefill(prompts, m.new_cache(len(prompts), capacity))[1]

  def propose(self, dparams, dstate, tcache, tail, n, live, key, sc):
    d, dcache = _draft_phase()(dparams, dstate, tail, n, live, key, sc)
    return d, dcache, tcache

  def commit(self, dstate, c):
    return _rollback_draft_cache(dstate, c)


MODEL = ModelDrafter()


# ---------------------------------------------------------------- layerskip


def _ranges(layers: tuple[int, ...]) -> str:
  """(0, 1, 2, 5, 7, 8) -> '0-2,5,7-8'."""
  parts, i = [], 0
  while i < len(layers):
    j = i
    while j + 1 < len(layers) and layers[j + 1] == layers[j] + 1:
      j += 1
    parts.append(str(layers[i]) if i == j else f"{layers[i]}-{layers[j]}")
    i = j + 1
  return ",".join(parts)


@dataclasses.dataclass(frozen=True)
class LayerSkipDrafter(Drafter):
  """The target with a subset of its layers (its own arrays, no copy)."""
  layers: tuple[int, ...] = (0,)
  kind: ClassVar[str] = "layerskip"

  @property
  def prefix(self) -> bool:
    """The first N layers: the draft shares the target's cache of them."""
    return self.layers == tuple(range(len(self.layers)))

  @property
  def spec(self) -> str:
    if self.prefix:
      return f"layerskip:{len(self.layers)}"
    if len(self.layers) == 1:  # 'layerskip:K' alone would mean the first K layers
      return f"layerskip:{self.layers[0]}-{self.layers[0]}"
    return f"layerskip:{_ranges(self.layers)}"

  def draft_config(self, target, draft):
    if self.layers[-1] >= target.n_layers:
      raise ConfigError(f"drafter {self.spec}: layer {self.layers[-1]} is out of range, the "
                        f"target {target.name} has layers 0..{target.n_layers - 1}")
    return target.replace(name=f"{target.name}[{self.spec}]", n_layers=len(self.layers))

  def draft_params(self, tparams, draft):
    params = {k: v for k, v in dict(tparams).items() if not k.startswith("layers_")}
    params.update({f"layers_{i}": tparams[f"layers_{l}"] for i, l in enumerate(self.layers)})
    return params

  def init(self, sc, target, dparams, prompts, capacity, first):
    if self.prefix:
      return ()  # the target's cache holds the draft's layers
    m = steps.Runner(sc.draft, dparams)
    return m.prefill(prompts, m.new_cache(len(prompts), capacity))[1]

  def propose(self, dparams, dstate, tcache, tail, n, live, key, sc):
    if not self.prefix:
      d, dcache = _draft_phase()(dparams, dstate, tail, n, live, key, sc)
      return d, dcache, tcache
    k = len(self.layers)
    # The target's cache holds the kept sequence minus `last` (n - 1): the
    # draft's own invariant, so the draft phase never catches up.
    shared = kvc.KVCache(k=tcache.k[:k], v=tcache.v[:k], lengths=tcache.lengths)
    d, shared = _draft_phase()(dparams, shared, tail, n, live, key, sc)
    # The slots the draft wrote (n-1 .. n-2+gamma) are rewritten by the
    # verify, which starts at the target's unchanged lengths.
    return d, dstate, tcache.replace(k=shared.k + tcache.k[k:], v=shared.v + tcache.v[k:])

  def commit(self, dstate, c):
    return dstate if self.prefix else _rollback_draft_cache(dstate, c)


# ---------------------------------------------------------------- ngram


@dataclasses.dataclass(frozen=True)
class NgramDrafter(Drafter):
  """Prompt lookup: the continuation of the latest earlier match of the
  row's last n tokens (n = n_max down to n_min), on device, fixed shapes."""
  n_min: int = 1
  n_max: int = 4
  kind: ClassVar[str] = "ngram"
  deterministic: ClassVar[bool] = True

  @property
  def spec(self) -> str:
    return f"ngram:{self.n_min}-{self.n_max}"

  def draft_config(self, target, draft):
    return None

  def draft_params(self, tparams, draft):
    return None

  def init(self, sc, target, dparams, prompts, capacity, first):
    """The token history [B, capacity]: prompt and first token (its length is
    SpecState.n)."""
    hist = np.zeros((len(prompts), capacity), np.int32)
    first = np.asarray(first)
    for b, p in enumerate(prompts):
      hist[b, :len(p)] = p
      hist[b, len(p)] = first[b]
    return jnp.asarray(hist)

  def propose(self, dparams, dstate, tcache, tail, n, live, key, sc):
    tokens, n_drafted = ngram_propose(dstate, n, sc.gamma, self.n_min, self.n_max)
    b = n.shape[0]
    return Drafted(tokens=tokens, q=jnp.zeros((b, sc.gamma, 0), jnp.float32),
                   n_drafted=jnp.where(live, n_drafted, 0),
                   caught_up=jnp.zeros((b,), bool)), dstate, tcache

  def commit(self, dstate, c):
    # emitted lands at n_prev..; only the first `kept` lie inside the new
    # length n. A finished row is left alone (its write could run past the
    # capacity, where dynamic_update_slice would clamp it onto its history).
    write = jax.vmap(lambda h, e, at: jax.lax.dynamic_update_slice(h, e, (at,)))
    return jnp.where(c.live[:, None], write(dstate, c.emitted, c.n_prev), dstate)


def ngram_propose(hist, n, gamma: int, n_min: int, n_max: int):
  """Prompt lookup over hist [B, S] (row b's history is hist[b, :n[b]]).

  For each n-gram size m (the largest one that matches wins), the key is the
  row's last m tokens; a match is a start j with hist[j:j+m] == key and
  j + m < n (strictly earlier than the key itself, at least one token after
  it); the latest match proposes hist[j+m : j+m+gamma], cut at the end of
  the history. Returns (tokens [B, gamma] (0 past n_drafted), n_drafted [B]).
  """
  b, s = hist.shape
  idx = jnp.arange(s)[None, :]                      # [1, S] candidate starts j
  best_j = jnp.full((b,), -1, jnp.int32)
  best_m = jnp.zeros((b,), jnp.int32)
  for m in range(n_min, n_max + 1):                 # a larger m overrides
    key_pos = jnp.clip(n[:, None] - m + jnp.arange(m)[None, :], 0, s - 1)
    key = jnp.take_along_axis(hist, key_pos, 1)     # [B, m]
    ok = (idx + m < n[:, None]) & (n[:, None] > m)  # [B, S]
    for i in range(m):  # hist[b, j + i] == key[b, i]
      shifted = jnp.pad(hist[:, i:], ((0, 0), (0, i)), constant_values=-1)
      ok = ok & (shifted == key[:, i:i + 1])
    j = jnp.max(jnp.where(ok, idx, -1), 1).astype(jnp.int32)
    found = j >= 0
    best_j = jnp.where(found, j, best_j)
    best_m = jnp.where(found, m, best_m)
  start = best_j + best_m                           # first proposed position
  n_drafted = jnp.where(best_j >= 0, jnp.clip(n - start, 0, gamma), 0).astype(jnp.int32)
  pos = jnp.arange(gamma)[None, :]
  tokens = jnp.take_along_axis(hist, jnp.clip(start[:, None] + pos, 0, s - 1), 1)
  return jnp.where(pos < n_drafted[:, None], tokens, 0).astype(jnp.int32), n_drafted


# ---------------------------------------------------------------- parsing

KINDS = ("model", "ngram", "layerskip", "eagle")
NGRAM_DEFAULT = (1, 4)


def _int(text: str, spec: str) -> int:
  try:
    return int(text)
  except ValueError:
    raise ConfigError(f"drafter {spec!r}: {text!r} is not an integer") from None


def parse(spec: str | Drafter) -> Drafter:
  """'model' | 'ngram' | 'ngram:A-B' | 'layerskip:N' | 'layerskip:0-9,12,15'
  | 'eagle' -> a Drafter (ConfigError, one line, for anything else).

  Layer indices are checked against the target later (draft_config)."""
  if isinstance(spec, Drafter):
    return spec
  text = str(spec).strip()
  kind, colon, arg = text.partition(":")
  kind = kind.strip().lower()
  if kind not in KINDS:
    raise ConfigError(f"unknown drafter {text!r}; valid: model, ngram[:A-B], layerskip:N, "
                      "layerskip:LIST (e.g. 0-9,12,15), eagle")
  if kind == "eagle":
    from specjax.drafters import eagle  # pylint: disable=import-outside-toplevel
    return eagle.EagleDrafter(arg.strip() or "stdlib-eagle")
  if kind == "model":
    if colon:
      raise ConfigError(f"drafter 'model' takes no argument, got {text!r}")
    return MODEL
  if kind == "ngram":
    if not colon:
      return NgramDrafter(*NGRAM_DEFAULT)
    lo, dash, hi = arg.partition("-")
    n_min, n_max = _int(lo, text), _int(hi if dash else lo, text)
    if n_min < 1:
      raise ConfigError(f"drafter {text!r}: the n-gram size must be >= 1")
    if n_min > n_max:
      raise ConfigError(f"drafter {text!r}: ngram_min {n_min} > ngram_max {n_max}")
    return NgramDrafter(n_min, n_max)
  # layerskip
  if not arg.strip():
    raise ConfigError(f"drafter {text!r}: layerskip needs N (keep the first N layers) or a "
                      "layer list such as 0-9,12,15")
  if "," not in arg and "-" not in arg:
    n = _int(arg, text)
    if n < 1:
      raise ConfigError(f"drafter {text!r}: keep at least one layer (N >= 1)")
    return LayerSkipDrafter(tuple(range(n)))
  layers: list[int] = []
  for part in arg.split(","):
    lo, dash, hi = part.partition("-")
    a = _int(lo, text)
    z = _int(hi, text) if dash else a
    if a < 0 or z < a:
      raise ConfigError(f"drafter {text!r}: bad layer range {part.strip()!r}")
    layers.extend(range(a, z + 1))
  if any(y <= x for x, y in zip(layers, layers[1:])):
    raise ConfigError(f"drafter {text!r}: layers must be strictly increasing, no repeats")
  return LayerSkipDrafter(tuple(layers))
