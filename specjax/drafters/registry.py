"""The drafter registry: one spec string (the scripts' --drafter) -> a Drafter."""

from __future__ import annotations

import dataclasses

from specjax.drafters import eagle
from specjax.drafters import eagle3
from specjax.drafters import vocab
from specjax.drafters.network import NetworkDrafter
from specjax.drafters.base import Drafter
from specjax.drafters.draft_model import MODEL, LayerSkipDrafter
from specjax.drafters.ngram import NgramDrafter
from specjax.drafters.streaming import StreamingDrafter
from specjax.errors import ConfigError


KINDS = ("model", "ngram", "layerskip", "eagle", "eagle3", "streaming")
NGRAM_DEFAULT = (1, 4)


def _int(text: str, spec: str) -> int:
  try:
    return int(text)
  except ValueError:
    raise ConfigError(f"drafter {spec!r}: {text!r} is not an integer") from None


def streaming(text: str, arg: str) -> StreamingDrafter:
  """'W[,S][+layerskip:K]' (the text after 'streaming:') -> the sparse-KV
  self-draft: a window of W >= 1 slots, S >= 0 sinks (4), the first K >= 1
  layers (all)."""
  arg, plus, skip = arg.partition("+")
  w, comma, s = arg.partition(",")
  if not w.strip():
    raise ConfigError(f"drafter {text!r}: streaming needs a window W (streaming:W[,S])")
  window, sinks, layers = _int(w, text), _int(s, text) if comma else 4, 0
  if window < 1:
    raise ConfigError(f"drafter {text!r}: the window W must be >= 1, got {window}")
  if sinks < 0:
    raise ConfigError(f"drafter {text!r}: the sinks S must be >= 0, got {sinks}")
  if plus:
    kind, _, k = skip.partition(":")
    if kind.strip().lower() != "layerskip" or not k.strip() or "," in k or "-" in k:
      raise ConfigError(f"drafter {text!r}: streaming combines with layerskip:K only (the "
                        f"first K layers, which share the target's cache), got {skip!r}")
    layers = _int(k, text)
    if layers < 1:
      raise ConfigError(f"drafter {text!r}: keep at least one layer (K >= 1)")
  return StreamingDrafter(window, sinks, layers)


def parse(spec: str | Drafter) -> Drafter:
  """'model' | 'ngram' | 'ngram:A-B' | 'layerskip:N' | 'layerskip:0-9,12,15'
  | 'eagle' | 'eagle:PATH' | 'eagle3' | 'eagle3:PATH' | 'streaming:W[,S]'
  | 'streaming:W,S+layerskip:K' -> a Drafter (ConfigError,
  one line, for anything else); a network drafter's spec may end in ':vocab=V' (full, N, a shipped
  ranking or a path: its reduced draft vocabulary, drafters/vocab.py).

  Layer indices are checked against the target later (draft_config)."""
  if isinstance(spec, Drafter):
    return spec
  text = str(spec).strip()
  head, sep, value = text.rpartition(":vocab=")
  if sep:
    value = value.strip()
    if not value:
      raise ConfigError(f"drafter {text!r}: vocab= needs a value (full, N or a path)")
    vocab.check_spec(value)
    drafter = parse(head)
    if not isinstance(drafter, NetworkDrafter):
      raise ConfigError(f"drafter {text!r}: {drafter.kind} has no LM head to reduce (vocab=)")
    return dataclasses.replace(drafter, vocab=value)
  text = str(spec).strip()
  kind, colon, arg = text.partition(":")
  kind = kind.strip().lower()
  if kind not in KINDS:
    raise ConfigError(f"unknown drafter {text!r}; valid: model, ngram[:A-B], layerskip:N, "
                      "layerskip:LIST (e.g. 0-9,12,15), eagle[:PATH], eagle3[:PATH], "
                      "streaming:W[,S][+layerskip:K], each network drafter with an optional "
                      ":vocab=V")
  if kind == "eagle":
    return eagle.EagleDrafter(arg.strip())  # bare: the target's shipped head
  if kind == "eagle3":
    return eagle3.Eagle3Drafter(arg.strip())  # bare: the target's shipped head
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
  if kind == "streaming":
    return streaming(text, arg)
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
