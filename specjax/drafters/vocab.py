"""A reduced draft vocabulary (EAGLE-3, FR-Spec): the draft's LM head runs
over V_d of the target's V ids, and its logits are mapped back to target ids
with every other id at MASKED_LOGIT, so q is exactly zero outside the set.

Speculative sampling stays exact: min(1, p/q) is only asked where q > 0, and
the residual max(0, p - q) covers the ids the draft cannot propose. The set
is the target's special tokens plus its most frequent output tokens; it is
stored next to the head or draft as a sorted id list (VOCAB_FILE). Why it
pays and how the set is chosen: docs/drafters.md, "A reduced vocabulary".
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Iterable

import jax.numpy as jnp
import numpy as np

from specjax import workdir as wd
from specjax.errors import CheckpointError, ConfigError
from specjax.model import llama

VOCAB_FILE = "draft_vocab.json"
FORMAT = "specjax-draft-vocab-1"
# Shipped rankings by name (the target's output tokens by frequency): a
# spec's `vocab=N` takes the top N of the one built for the target's vocabulary.
SHIPPED_VOCAB = {name: Path(__file__).resolve().parents[1] / "assets" / name
                 for name in ("smollm2-vocab",)}


def count_tokens(seqs: Iterable[Iterable[int]], vocab_size: int) -> np.ndarray:
  """[vocab_size] int64: how often each id occurs in `seqs`."""
  counts = np.zeros(vocab_size, np.int64)
  for s in seqs:
    np.add.at(counts, np.asarray(list(s), np.int64), 1)
  return counts


def top_ids(counts: np.ndarray, size: int, special: Iterable[int]) -> np.ndarray:
  """The sorted set: every id of `special`, then the most frequent ids (ties:
  the lower id) up to `size` ids in all."""
  special = sorted({int(i) for i in special})
  if not 0 < size <= len(counts):
    raise ConfigError(f"draft vocabulary size {size}: must be in 1..{len(counts)}")
  if len(special) > size:
    raise ConfigError(f"draft vocabulary size {size} is below the {len(special)} special tokens")
  order = np.lexsort((np.arange(len(counts)), -np.asarray(counts)))  # count desc, id asc
  rest = [int(i) for i in order if i not in set(special)][:size - len(special)]
  return np.asarray(sorted(special + rest), np.int32)


def coverage(ids: np.ndarray, seqs: Iterable[Iterable[int]]) -> float:
  """The share of the tokens of `seqs` that lie in the set."""
  flat = np.concatenate([np.asarray(list(s), np.int64) for s in seqs] or [np.zeros(0, np.int64)])
  return float(np.isin(flat, ids).mean()) if flat.size else float("nan")


def check_ids(ids, vocab_size: int, where: str = "draft vocabulary") -> np.ndarray:
  """`ids` as int32 if sorted, unique and in 0..vocab_size-1; else CheckpointError."""
  ids = np.asarray(ids)
  if ids.ndim != 1 or ids.size == 0 or not np.issubdtype(ids.dtype, np.integer):
    raise CheckpointError(f"{where}: expected a non-empty list of integer token ids")
  if np.any(np.diff(ids) <= 0) or ids[0] < 0 or ids[-1] >= vocab_size:
    raise CheckpointError(f"{where}: ids must be sorted, unique and in 0..{vocab_size - 1}")
  return ids.astype(np.int32)


def ranking(counts: np.ndarray, special: Iterable[int]) -> np.ndarray:
  """Every id, special tokens first, then by count (desc) and id: top_ids(n)
  is sorted(ranking[:n])."""
  special = sorted({int(i) for i in special})
  order = np.lexsort((np.arange(len(counts)), -np.asarray(counts)))
  return np.asarray(special + [int(i) for i in order if i not in set(special)], np.int32)


def save(path: str | os.PathLike, ids: np.ndarray, vocab_size: int, special: Iterable[int],
         ranked: np.ndarray | None = None, **meta) -> Path:
  """Writes VOCAB_FILE into the directory `path` (the head's or draft's);
  `ranked` (optional): every id in the order other sizes are cut from."""
  ids = check_ids(ids, vocab_size)
  if ranked is not None:
    meta["ranked"] = np.asarray(ranked, np.int32).tolist()
  missing = sorted(set(int(i) for i in special) - set(ids.tolist()))
  if missing:
    raise ConfigError(f"draft vocabulary leaves out special tokens {missing}")
  path = Path(path)
  path.mkdir(parents=True, exist_ok=True)
  wd.write_json(path / VOCAB_FILE, {"format": FORMAT, "vocab_size": int(vocab_size),
                                    "size": int(ids.size), "special": sorted(map(int, special)),
                                    **meta, "ids": ids.tolist()})
  return path / VOCAB_FILE


def _meta(file: Path) -> dict:
  try:
    return wd.read_json(file)
  except (OSError, ValueError) as e:
    raise CheckpointError(f"cannot read the draft vocabulary {file}: {str(e)[:200]}") from None


def load(directory: str | os.PathLike, vocab_size: int, size: int | None = None
         ) -> np.ndarray | None:
  """The sorted ids stored in `directory` (a VOCAB_FILE or its directory;
  None when it stores none), checked against the target's `vocab_size` and its
  special tokens; `size`: the top `size` of the stored ranking instead."""
  file = Path(directory)
  file = file if file.suffix == ".json" else file / VOCAB_FILE
  if not file.is_file():
    return None
  meta = _meta(file)
  if size is not None:
    ranked = check_ids(sorted(meta.get("ranked", [])), vocab_size, f"{file} (ranked)")
    if len(ranked) < size:
      raise ConfigError(f"draft vocabulary of {size} ids: {file} ranks only {len(ranked)}")
    meta["ids"] = sorted(meta["ranked"][:size])
  if meta.get("format") != FORMAT:
    raise CheckpointError(f"{file}: format {meta.get('format')!r}, expected {FORMAT!r}")
  if meta.get("vocab_size") != vocab_size:
    raise CheckpointError(f"{file}: built for a vocabulary of {meta.get('vocab_size')} ids, "
                          f"the target has {vocab_size}")
  ids = check_ids(meta.get("ids", []), vocab_size, str(file))
  missing = sorted(set(meta.get("special", [])) - set(ids.tolist()))
  if missing:
    raise CheckpointError(f"{file}: special tokens {missing} are not in the set")
  return ids


def check_spec(value: str) -> None:
  """A drafter spec's `vocab=` value, checked before any model loads: full,
  N (the top N of the shipped ranking), a shipped name, or a path."""
  if value in ("", "full") or value in SHIPPED_VOCAB:
    return
  if value.isdigit():
    if int(value) < 1:
      raise ConfigError("vocab=N: N must be at least 1")
    return
  if not Path(value).exists():
    raise ConfigError(f"vocab={value}: no such file or directory (give full, N, a shipped "
                      f"ranking ({', '.join(SHIPPED_VOCAB)}) or a {VOCAB_FILE} path)")


def resolve(value: str, vocab_size: int, default_dir: str | os.PathLike | None = None
            ) -> np.ndarray | None:
  """A spec's `vocab=` value -> the sorted ids, or None for the full
  vocabulary. "": the set stored in `default_dir` (a head's own), if any."""
  if value == "full" or (value == "" and default_dir is None):
    return None
  if value == "":
    return load(default_dir, vocab_size)
  if value.isdigit():
    for path in SHIPPED_VOCAB.values():
      if path.joinpath(VOCAB_FILE).is_file() and \
          _meta(path / VOCAB_FILE).get("vocab_size") == vocab_size:
        return load(path, vocab_size, int(value))
    raise ConfigError(f"vocab={value}: no shipped ranking for a vocabulary of {vocab_size} "
                      f"ids; give a {VOCAB_FILE} path")
  ids = load(SHIPPED_VOCAB.get(value, value), vocab_size)
  if ids is None:
    raise ConfigError(f"vocab={value}: {VOCAB_FILE} not found there")
  return ids


PARAMS_KEY = "draft_vocab"  # a drafter's params entry: {"ids": [V_d], "table": [V_d, E]}


def head_table(params, ids) -> jnp.ndarray:
  """The LM head's rows of `ids` as [V_d, E] from a LLaMA's params (the tied
  embedding's rows, or the lm_head kernel's columns, int8 dequantized):
  gathered once, when the drafter's params are built, so that a draft step
  multiplies by V_d rows, not V."""
  ids = jnp.asarray(ids, jnp.int32)
  if "lm_head" not in params:
    return jnp.take(params["embed"]["embedding"], ids, axis=0)
  head = params["lm_head"]
  if "kernel" in head:
    return jnp.take(head["kernel"], ids, axis=1).T
  cols = jnp.take(head["kernel_q"], ids, axis=1).T.astype(jnp.float32)  # int8 [V_d, E]
  return cols * jnp.take(head["kernel_scale"], ids)[:, None]


def attach(params: dict, lm_params, ids) -> dict:
  """`params` with PARAMS_KEY added (ids None: `params` as they are): the set
  and the rows of `lm_params`' LM head for it."""
  if ids is None:
    return params
  ids = jnp.asarray(ids, jnp.int32)
  return dict(params, **{PARAMS_KEY: {"ids": ids, "table": head_table(lm_params, ids)}})


def draft_logits(params, hidden, width: int):
  """The reduced head over final-normed `hidden` [..., E], expanded to
  [..., width] target ids; None when `params` carry no set."""
  if PARAMS_KEY not in params:
    return None
  v = params[PARAMS_KEY]
  return expand(logits(v["table"], hidden), v["ids"], width)


def logits(table, hidden) -> jnp.ndarray:
  """float32 logits over the set [..., V_d] of final-normed `hidden` [..., E]
  (llama.head_logits' product, restricted to the set's rows)."""
  return jnp.einsum("...e,ve->...v", hidden.astype(table.dtype), table,
                    preferred_element_type=jnp.float32)


def expand(reduced, ids, width: int) -> jnp.ndarray:
  """[..., V_d] logits over the set -> [..., width] over target ids, every id
  outside the set at llama.MASKED_LOGIT (its q is exactly 0)."""
  full = jnp.full(reduced.shape[:-1] + (width,), llama.MASKED_LOGIT, jnp.float32)
  return full.at[..., ids].set(reduced.astype(jnp.float32))
