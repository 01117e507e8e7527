"""A GGUF file's tokenizer, from its `tokenizer.ggml.*` metadata.

    tok = gguf_tokenizer(gguf.open_reader(path), str(path))

llama.cpp's 'llama' (SentencePiece BPE) and 'gpt2' (byte-level BPE)
vocabularies rebuilt as `tokenizers` backends (formats/tokenizer.py's
Tokenizer); the pre-tokenizer table is formats/pretokenizers.py. The
weights are read by gguf_weights.py, the metadata by gguf.py.
"""

from __future__ import annotations

from absl import logging

from specjax.errors import TokenizerError
from specjax.formats import chat, pretokenizers
from specjax.formats import gguf as gguf_file
from specjax.formats.tokenizer import Tokenizer

# gguf.TokenType values
NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 2, 3, 4, 5, 6


def _spm_merges(tokens: list[str], scores: list[float], types: list[int]):
  """SentencePiece BPE as BPE merges: every split of a normal piece into two
  normal pieces, ranked by the merged piece's score (highest first), ties by
  the halves' ids (transformers' SentencePieceExtractor does the same)."""
  ids = {t: i for i, t in enumerate(tokens) if types[i] == NORMAL}
  merges = []
  for piece, i in ids.items():
    local = [(piece[:k], piece[k:]) for k in range(1, len(piece))
             if piece[:k] in ids and piece[k:] in ids]
    local.sort(key=lambda lr: (ids[lr[0]], ids[lr[1]]))
    merges += [(l, r, scores[i]) for l, r in local]
  merges.sort(key=lambda m: -m[2])  # stable: ties keep the id order
  return [(l, r) for l, r, _ in merges]


def _post_processor(tokens, bos, eos, add_bos: bool, add_eos: bool):
  """BOS / EOS around each sequence, as the file's add_*_token say."""
  from tokenizers import processors  # pylint: disable=import-outside-toplevel
  add_bos, add_eos = add_bos and bos is not None, add_eos and eos is not None
  if not (add_bos or add_eos):
    return None
  around = lambda seq: ([f"{tokens[bos]}:{seq}"] * add_bos + [f"${'AB'[seq]}:{seq}"]
                        + [f"{tokens[eos]}:{seq}"] * add_eos)
  special = [(tokens[bos], bos)] * add_bos + [(tokens[eos], eos)] * add_eos
  return processors.TemplateProcessing(single=around(0), pair=around(0) + around(1),
                                       special_tokens=special)


def _add_tokens(backend, tokens, types) -> None:
  """Control tokens as special tokens (matched in text, skipped when
  decoding); user-defined ones as plain added tokens (matched in text)."""
  from tokenizers import AddedToken  # pylint: disable=import-outside-toplevel
  pick = lambda kind: [AddedToken(t, special=kind == CONTROL, normalized=False)
                       for i, t in enumerate(tokens) if types[i] == kind]
  backend.add_special_tokens(pick(CONTROL))
  backend.add_tokens(pick(USER_DEFINED))


def _spm_tokenizer(tokens, scores, types, merges, unk, add_prefix):
  """llama.cpp's 'llama' (SentencePiece BPE) vocabulary as `tokenizers`:
  spaces as '▁', a '▁' prepended (add_space_prefix), byte fallback."""
  import tokenizers  # pylint: disable=import-outside-toplevel
  from tokenizers import decoders, models, normalizers  # pylint: disable=import-outside-toplevel
  vocab = {t: i for i, t in enumerate(tokens)}
  if merges is None:
    merges = _spm_merges(tokens, scores, types)
  has_bytes = BYTE in types
  tok = tokenizers.Tokenizer(models.BPE(
      vocab, merges, unk_token=None if unk is None else tokens[unk],
      fuse_unk=True, byte_fallback=has_bytes))
  norm = [normalizers.Replace(" ", "\u2581")]
  if add_prefix:
    norm.insert(0, normalizers.Prepend("\u2581"))
  tok.normalizer = normalizers.Sequence(norm)
  dec = [decoders.Replace("\u2581", " ")] + [decoders.ByteFallback()] * has_bytes
  dec += [decoders.Fuse()] + [decoders.Strip(" ", 1, 0)] * add_prefix
  tok.decoder = decoders.Sequence(dec)
  return tok


def _bpe_tokenizer(tokens, merges, fam: pretokenizers.Family):
  """llama.cpp's 'gpt2' (byte-level BPE) vocabulary as `tokenizers`, split
  by the family's regexes (formats/pretokenizers.py)."""
  import tokenizers  # pylint: disable=import-outside-toplevel
  from tokenizers import decoders, models  # pylint: disable=import-outside-toplevel
  vocab = {t: i for i, t in enumerate(tokens)}
  tok = tokenizers.Tokenizer(models.BPE(vocab, merges, ignore_merges=fam.ignore_merges))
  tok.pre_tokenizer = pretokenizers.pre_tokenizer(fam)
  tok.decoder = decoders.ByteLevel()
  return tok


class _UnsplitTokenizer(Tokenizer):
  """A byte-level BPE vocabulary whose pre-tokenizer specjax does not know:
  it decodes (the weights load, prompts may be given as ids), and encoding
  raises the reason in one line."""

  def __init__(self, backend, bos_id, eos_id, source: str, reason: str):
    super().__init__(backend, "hf", bos_id, eos_id, source)
    self.reason = reason

  def encode(self, text: str, add_special: bool = True) -> list[int]:
    raise TokenizerError(f"{self.reason}: give the prompt as token ids")


def gguf_tokenizer(reader, source: str) -> Tokenizer | None:
  """The tokenizer of a GGUF file's `tokenizer.ggml.*` metadata, or None
  when the file has no token list.

  `llama` (SentencePiece BPE: scores decide the merges, '▁' for spaces,
  byte tokens <0xNN>) and `gpt2` (byte-level BPE with tokenizer.ggml.merges,
  split first as tokenizer.ggml.pre says: llama.cpp's table, in
  formats/pretokenizers.py; without the key, llama.cpp's 'default'). BOS /
  EOS are added as `add_bos_token` / `add_eos_token` say; without the key,
  llama.cpp's defaults: BOS for `llama` and for the pre-tokenizers llama.cpp
  adds it with (llama-bpe, tekken, chameleon), else nothing. Control tokens
  are special (matched in text, skipped in decoding), user-defined ones are
  matched too.

  A `gpt2` vocabulary whose pre-tokenizer is not in the table still gives a
  tokenizer, one that decodes but raises TokenizerError (naming the value and
  the supported ones) when asked to encode: the weights load, and prompts can
  be given as ids.

  Raises:
    TokenizerError: an unknown tokenizer model, or a `gpt2` vocabulary
      without merges.
  """
  field = gguf_file.field  # the module's, at call time (tests patch it)
  tokens = field(reader, "tokenizer.ggml.tokens")
  if not tokens:
    return None
  kind = field(reader, "tokenizer.ggml.model", "llama")
  types = field(reader, "tokenizer.ggml.token_type") or [NORMAL] * len(tokens)
  merges = field(reader, "tokenizer.ggml.merges")
  merges = None if merges is None else [tuple(m.split(" ", 1)) for m in merges]
  opt = lambda key: None if field(reader, key) is None else int(field(reader, key))
  bos, eos = opt("tokenizer.ggml.bos_token_id"), opt("tokenizer.ggml.eos_token_id")
  unk = opt("tokenizer.ggml.unknown_token_id")
  if kind == "llama":
    scores = field(reader, "tokenizer.ggml.scores") or [0.0] * len(tokens)
    backend = _spm_tokenizer(tokens, scores, types, merges, unk,
                             bool(field(reader, "tokenizer.ggml.add_space_prefix", True)))
    add_bos_default = True
  elif kind == "gpt2":
    pre = field(reader, "tokenizer.ggml.pre")
    if pre is None:
      logging.warning("%s: no tokenizer.ggml.pre; splitting as llama.cpp's %r",
                      source, pretokenizers.MISSING)
    try:
      fam, reason = pretokenizers.family(pre, source), None
    except TokenizerError as e:  # the weights still load; prompts as ids
      fam, reason = pretokenizers.FAMILIES["gpt2"], str(e)
      logging.warning("%s", reason)
    if not merges:
      raise TokenizerError(f"{source}: a gpt2 tokenizer without tokenizer.ggml.merges")
    backend = _bpe_tokenizer(tokens, merges, fam)
    add_bos_default = fam.add_bos
  else:
    raise TokenizerError(f"{source}: tokenizer model {kind!r} is not supported "
                         f"(only 'llama' and 'gpt2')")
  _add_tokens(backend, tokens, types)
  backend.post_processor = _post_processor(
      tokens, bos, eos, bool(field(reader, "tokenizer.ggml.add_bos_token", add_bos_default)),
      bool(field(reader, "tokenizer.ggml.add_eos_token", False)))
  tok = (_UnsplitTokenizer(backend, bos, eos, source, reason) if kind == "gpt2" and reason
         else Tokenizer(backend, "hf", bos, eos, source))
  tok.chat = chat.gguf_template(lambda key: field(reader, key), tokens, source)
  return tok
