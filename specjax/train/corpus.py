"""The training corpus: the Python standard library's own source files.

Every machine that runs specjax has them, so a real target/draft pair trains
without a download (experiments/train.py). Invariant: the split into train
and held-out sets is by file and deterministic (the SHA-1 of a file's path
relative to the stdlib root), the same on every machine and Python version.
Also here: the byte-level BPE tokenizer trained on the training split, the
token streams, `batch_at(step)` and the held-out prompts. What is left out
and why, the tokenizer's files: docs/training.md, "The corpus".
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
import sysconfig
from pathlib import Path
from typing import Iterable, Iterator, Sequence

import numpy as np

from specjax.errors import ConfigError

BOS, EOS, PAD = "<s>", "</s>", "<pad>"
SPECIALS = (BOS, EOS, PAD)   # ids 0, 1, 2
_EXCLUDED_DIRS = {"test", "tests", "site-packages", "dist-packages", "idlelib",
                  "lib2to3", "__pycache__", "turtledemo"}


def stdlib_root() -> Path:
  return Path(sysconfig.get_paths()["stdlib"])


def is_heldout(rel_path: str, heldout_per_mille: int) -> bool:
  """Deterministic by-file split: the path's hash decides."""
  h = int.from_bytes(hashlib.sha1(rel_path.encode()).digest()[:4], "big")
  return h % 1000 < heldout_per_mille


def list_files(root: Path | None = None, heldout_per_mille: int = 50
               ) -> tuple[list[Path], list[Path]]:
  """(train files, held-out files) of the stdlib, sorted by relative path."""
  root = stdlib_root() if root is None else Path(root)
  if not root.is_dir():
    raise ConfigError(f"standard library directory {root} not found")
  train, held = [], []
  for p in sorted(root.rglob("*.py")):
    rel = p.relative_to(root)
    if _EXCLUDED_DIRS & set(rel.parts[:-1]):
      continue
    (held if is_heldout(rel.as_posix(), heldout_per_mille) else train).append(p)
  if not train or not held:
    raise ConfigError(f"{root}: no usable .py files for a train/held-out split "
                      f"(train {len(train)}, held-out {len(held)})")
  return train, held


def readable(files: Iterable[Path]) -> Iterator[tuple[Path, str]]:
  """(path, UTF-8 text) of each file that reads as UTF-8."""
  for p in files:
    try:
      yield p, p.read_text(encoding="utf-8")
    except (UnicodeDecodeError, OSError):
      continue  # a handful of stdlib files are latin-1 test data


def read_texts(files: Iterable[Path]) -> list[str]:
  return [text for _, text in readable(files)]


def bos_post_processor():
  """What training feeds the models in front of a text: <s>. A tokenizer.json
  with this post-processor gives the same ids in specjax and transformers."""
  from tokenizers import processors  # pylint: disable=import-outside-toplevel
  return processors.TemplateProcessing(single=f"{BOS} $A", pair=f"{BOS} $A {BOS} $B:1",
                                       special_tokens=[(BOS, SPECIALS.index(BOS))])


def train_tokenizer(texts: Sequence[str], vocab_size: int, out_dir: str | os.PathLike) -> Path:
  """Trains a byte-level BPE and writes tokenizer.json + tokenizer_config.json."""
  from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers  # pylint: disable=import-outside-toplevel
  if vocab_size < 256 + len(SPECIALS):
    raise ConfigError(f"vocab_size must be >= {256 + len(SPECIALS)} for a byte-level BPE, "
                      f"got {vocab_size}")
  tok = Tokenizer(models.BPE())
  tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
  tok.decoder = decoders.ByteLevel()
  trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=list(SPECIALS),
                                initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                show_progress=False)
  tok.train_from_iterator(texts, trainer=trainer)
  tok.post_processor = bos_post_processor()
  out = Path(out_dir)
  out.mkdir(parents=True, exist_ok=True)
  tok.save(str(out / "tokenizer.json"))
  (out / "tokenizer_config.json").write_text(json.dumps(
      {"bos_token": BOS, "eos_token": EOS, "pad_token": PAD, "add_bos_token": True,
       "add_eos_token": False, "model_max_length": 1 << 20,
       "tokenizer_class": "PreTrainedTokenizerFast"},
      indent=2) + "\n")
  return out / "tokenizer.json"


def encode_documents(tokenizer, texts: Sequence[str]) -> np.ndarray:
  """One int32 stream: <s> doc </s> <s> doc </s> ..."""
  if tokenizer.bos_id is None or tokenizer.eos_id is None:
    raise ConfigError(f"tokenizer {tokenizer.source} has no <s> or </s>")
  bos, eos = [tokenizer.bos_id], [tokenizer.eos_id]
  parts = [np.asarray(bos + tokenizer.encode(text, add_special=False) + eos, np.int32)
           for text in texts]
  return np.concatenate(parts) if parts else np.zeros((0,), np.int32)


def batch_at(stream: np.ndarray, step: int, batch: int, length: int, seed: int) -> np.ndarray:
  """Batch `step`: [batch, length] random windows, a pure function of (seed, step).

  Resuming at step s therefore sees exactly the batches an uninterrupted
  run would have seen.
  """
  if len(stream) <= length:
    raise ConfigError(f"corpus of {len(stream)} tokens is shorter than one "
                      f"sequence of {length}")
  rng = np.random.default_rng([seed, step])
  starts = rng.integers(0, len(stream) - length, size=batch)
  return np.stack([stream[s:s + length] for s in starts])


def eval_windows(stream: np.ndarray, n: int, length: int) -> np.ndarray:
  """n evenly spaced, non-random windows of the held-out stream."""
  if len(stream) <= length:
    raise ConfigError(f"held-out stream of {len(stream)} tokens is shorter than "
                      f"one sequence of {length}")
  starts = np.linspace(0, len(stream) - length - 1, n).astype(int)
  return np.stack([stream[s:s + length] for s in starts])


def heldout_prompts(files: Sequence[Path], tokenizer, n: int, n_tokens: int,
                    root: Path | None = None) -> list[dict]:
  """n prompts of about n_tokens tokens: code prefixes cut at a line end.

  Each prompt is the start of a def/class body region of a held-out file,
  so continuations are real code the models never trained on.
  """
  root = stdlib_root() if root is None else Path(root)
  out = []
  for p, text in readable(files):
    lines = text.splitlines(keepends=True)
    starts = [i for i, l in enumerate(lines) if l.lstrip().startswith(("def ", "class "))]
    if not starts:
      continue
    mid = len(starts) // 2  # prefer definitions from the middle of the file
    by_distance = sorted(range(len(starts)), key=lambda n: abs(n - mid))
    for i in (starts[n] for n in by_distance):
      prompt = ""
      for line in lines[i:]:
        if len(tokenizer.encode(prompt + line, add_special=False)) > n_tokens:
          break
        prompt += line
      if len(tokenizer.encode(prompt, add_special=False)) >= n_tokens // 2:
        out.append({"file": p.relative_to(root).as_posix(), "line": i + 1, "text": prompt})
        break
    if len(out) == n:
      break
  return out


EDIT_INSTRUCTIONS = (
    "# The same function, rewritten with type hints:",
    "# The same function, with a docstring:",
    "# The same function, with clearer variable names:",
    "# The same function, refactored for readability:",
)


def function_blocks(text: str) -> list[tuple[int, str]]:
  """(line number, dedented source) of every complete `def` in a file: the
  def line, and each following line that is blank or indented deeper."""
  lines = text.splitlines(keepends=True)
  out = []
  for i, line in enumerate(lines):
    if not line.lstrip().startswith("def "):
      continue
    indent = len(line) - len(line.lstrip())
    j = i + 1
    while j < len(lines) and (not lines[j].strip()
                              or len(lines[j]) - len(lines[j].lstrip()) > indent):
      j += 1
    body = lines[i:j]
    while body and not body[-1].strip():
      body.pop()
    if len(body) < 3 or not body[0].rstrip().endswith(":"):  # one-liners, multi-line headers
      continue
    out.append((i + 1, "".join(l[indent:] if l.strip() else "\n" for l in body)))
  return out


def editing_prompts(files: Sequence[Path], tokenizer, n: int, max_tokens: int,
                    root: Path | None = None) -> list[dict]:
  """n code-editing prompts: a complete held-out function, an instruction
  comment asking for a rewrite, and the function's def line again.

  A model continuing such a prompt repeats much of the function: the case
  where prompt lookup (the `ngram` drafter) finds long matches, next to the
  plain continuation prompts of `heldout_prompts`. One function per file,
  the one nearest the file's middle that fits in `max_tokens`; the
  instruction cycles through EDIT_INSTRUCTIONS.
  """
  root = stdlib_root() if root is None else Path(root)
  out = []
  for p, text in readable(files):
    blocks = function_blocks(text)
    mid = len(blocks) // 2
    for k in sorted(range(len(blocks)), key=lambda k: abs(k - mid)):
      line, src = blocks[k]
      head = src.splitlines(keepends=True)[0]
      instruction = EDIT_INSTRUCTIONS[len(out) % len(EDIT_INSTRUCTIONS)]
      prompt = f"{src}\n\n{instruction}\n{head}"
      n_tok = len(tokenizer.encode(prompt, add_special=False))
      if max_tokens // 3 <= n_tok <= max_tokens:
        out.append({"file": p.relative_to(root).as_posix(), "line": line, "text": prompt,
                    "kind": "editing"})
        break
    if len(out) == n:
      break
  return out


def describe(train_files: Sequence[Path], held_files: Sequence[Path], n_train_tokens: int,
             n_held_tokens: int, vocab_size: int, heldout_per_mille: int) -> dict:
  """What the README states about the corpus."""
  size = lambda fs: int(sum(p.stat().st_size for p in fs))
  return {"source": "Python standard library (*.py)", "root": str(stdlib_root()),
          "python": sys.version.split()[0],
          "excluded_dirs": sorted(_EXCLUDED_DIRS),
          "heldout_per_mille": heldout_per_mille,
          "train_files": len(train_files), "heldout_files": len(held_files),
          "train_bytes": size(train_files), "heldout_bytes": size(held_files),
          "train_tokens": int(n_train_tokens), "heldout_tokens": int(n_held_tokens),
          "vocab_size": vocab_size}
