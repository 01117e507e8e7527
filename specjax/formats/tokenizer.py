"""Text <-> token ids: a thin wrapper over HF `tokenizers` or sentencepiece.

A tokenizer is optional: a checkpoint directory without tokenizer.json /
tokenizer.model yields None, and prompts are then given as ids. Invariant:
the same text gives the same ids as transformers' AutoTokenizer, each format
keeping its own special-token convention (a tokenizer.json's post-processor;
a tokenizer.model's add_bos_token / add_eos_token, else LLaMA's BOS first).
`encode(text, add_special=False)` gives the bare ids; `encode_chat` renders
a conversation with the model's chat template (formats/chat.py) and encodes
it as transformers' apply_chat_template does. The conventions, format by
format: docs/models.md, "Tokenizers".
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Sequence

from specjax.errors import TokenizerError
from specjax.formats import chat as chat_lib

HF_FILE = "tokenizer.json"
SP_FILE = "tokenizer.model"
CONFIG_FILE = "tokenizer_config.json"
# Files that make up a tokenizer, copied along when a checkpoint is converted.
FILES = (HF_FILE, SP_FILE, CONFIG_FILE, chat_lib.TEMPLATE_FILE)
# Fallbacks when neither the model nor tokenizer_config.json names them.
_BOS_NAMES = ("<s>", "<|begin_of_text|>", "<bos>")
_EOS_NAMES = ("</s>", "<|end_of_text|>", "<|endoftext|>", "<eos>")


class Tokenizer:
  """encode/decode plus the special ids that generation needs."""

  def __init__(self, backend: Any, kind: str, bos_id: int | None,
               eos_id: int | None, source: str, add_bos: bool = False,
               add_eos: bool = False, chat: chat_lib.ChatTemplate | None = None):
    self._backend = backend
    self.kind = kind          # 'hf' (tokenizers) or 'sentencepiece'
    self.bos_id = bos_id
    self.eos_id = eos_id
    self.source = source      # the file it was read from
    # sentencepiece only (a tokenizer.json's post-processor decides for itself)
    self.add_bos = add_bos and bos_id is not None
    self.add_eos = add_eos and eos_id is not None
    self.chat = chat          # the model's chat template, if it has one

  @property
  def vocab_size(self) -> int:
    if self.kind == "hf":
      return self._backend.get_vocab_size(with_added_tokens=True)
    return self._backend.get_piece_size()

  def encode(self, text: str, add_special: bool = True) -> list[int]:
    """Token ids of `text`, with the special tokens the format adds (see the
    module docstring) unless add_special=False."""
    if self.kind == "hf":
      return [int(i) for i in self._backend.encode(text, add_special_tokens=add_special).ids]
    ids = [int(i) for i in self._backend.encode(text)]
    if add_special:
      ids = [self.bos_id] * self.add_bos + ids + [self.eos_id] * self.add_eos
    return ids

  def encode_chat(self, messages: Sequence[chat_lib.Message],
                  add_generation_prompt: bool = True) -> list[int]:
    """Token ids of a conversation rendered with the model's chat template,
    encoded without the format's own special tokens (the template writes the
    BOS it wants: never two), as transformers' apply_chat_template(messages,
    add_generation_prompt=True, tokenize=True).

    Raises:
      TokenizerError: the model has no chat template, or the template refuses
        the messages.
    """
    if self.chat is None:
      raise TokenizerError(f"{self.source} has no chat template")
    return self.encode(self.chat.render(messages, add_generation_prompt), add_special=False)

  def decode(self, ids: Sequence[int], skip_special: bool = True) -> str:
    ids = [int(i) for i in ids]
    if self.kind == "hf":
      return self._backend.decode(ids, skip_special_tokens=skip_special)
    return self._backend.decode(ids)

  def special_ids(self) -> list[int]:
    """The ids of the special tokens (BOS, EOS and the format's control
    tokens: an HF tokenizer's added special tokens, sentencepiece's control
    and unknown pieces), sorted."""
    ids = {i for i in (self.bos_id, self.eos_id) if i is not None}
    if self.kind == "hf":
      ids |= {int(i) for i, t in self._backend.get_added_tokens_decoder().items() if t.special}
    else:
      sp = self._backend
      ids |= {i for i in range(sp.get_piece_size()) if sp.is_control(i) or sp.is_unknown(i)}
    return sorted(ids)

  def tokens(self) -> list[str]:
    """Every token's string, by id."""
    if self.kind == "hf":
      by_id = {i: t for t, i in self._backend.get_vocab(with_added_tokens=True).items()}
      return [by_id.get(i, "") for i in range(max(by_id, default=-1) + 1)]
    return [self._backend.id_to_piece(i) for i in range(self._backend.get_piece_size())]

  def __repr__(self) -> str:
    return (f"Tokenizer({self.kind}, vocab={self.vocab_size}, bos={self.bos_id}, "
            f"eos={self.eos_id}, source={self.source!r})")


def _config(directory: Path) -> dict[str, Any]:
  """tokenizer_config.json as a dict ({} when absent)."""
  file = directory / CONFIG_FILE
  if not file.is_file():
    return {}
  try:
    config = json.loads(file.read_text())
  except ValueError as e:
    raise TokenizerError(f"corrupt {file}: {e}") from e
  if not isinstance(config, dict):
    raise TokenizerError(f"corrupt {file}: not a JSON object")
  return config


def _config_token(directory: Path, key: str) -> str | None:
  """The `bos_token`/`eos_token` string of tokenizer_config.json, if any."""
  value = _config(directory).get(key)
  return value.get("content") if isinstance(value, dict) else value


def _hf_special_id(backend, directory: Path, key: str, fallbacks) -> int | None:
  """Id of the token tokenizer_config.json names for `key`, else a known name."""
  name = _config_token(directory, key)
  for candidate in ([name] if name else []) + list(fallbacks):
    token_id = backend.token_to_id(candidate)
    if token_id is not None:
      return token_id
  return None


def _load_hf(file: Path, bos_id, eos_id) -> Tokenizer:
  import tokenizers  # pylint: disable=import-outside-toplevel
  try:
    backend = tokenizers.Tokenizer.from_file(str(file))
  except Exception as e:  # pylint: disable=broad-except
    raise TokenizerError(f"corrupt or unreadable tokenizer {file}: {e}") from e
  if bos_id is None:
    bos_id = _hf_special_id(backend, file.parent, "bos_token", _BOS_NAMES)
  if eos_id is None:
    eos_id = _hf_special_id(backend, file.parent, "eos_token", _EOS_NAMES)
  return Tokenizer(backend, "hf", bos_id, eos_id, str(file))


def _load_sp(file: Path, bos_id, eos_id) -> Tokenizer:
  import sentencepiece  # pylint: disable=import-outside-toplevel
  try:
    backend = sentencepiece.SentencePieceProcessor(model_file=str(file))
  except Exception as e:  # pylint: disable=broad-except
    raise TokenizerError(f"corrupt or unreadable tokenizer {file}: {e}") from e
  own = lambda i: None if i < 0 else int(i)  # sentencepiece says -1 for none
  bos_id = own(backend.bos_id()) if bos_id is None else bos_id
  eos_id = own(backend.eos_id()) if eos_id is None else eos_id
  config = _config(file.parent)
  return Tokenizer(backend, "sentencepiece", bos_id, eos_id, str(file),
                   add_bos=bool(config.get("add_bos_token", True)),
                   add_eos=bool(config.get("add_eos_token", False)))


def load_tokenizer(directory: str | os.PathLike, bos_id: int | None = None,
                   eos_id: int | None = None) -> Tokenizer | None:
  """The tokenizer of a checkpoint directory, or None if it has none.

  Prefers tokenizer.json (HF `tokenizers`) over tokenizer.model
  (sentencepiece). The chat template, if any, comes along (`chat`).

  Args:
    directory: a checkpoint directory.
    bos_id, eos_id: the model's special ids (from its config); when None they
      come from tokenizer_config.json or well-known token names.
  Raises:
    TokenizerError: the tokenizer file is corrupt or unreadable, or its chat
      template is not a string or names no default.
  """
  directory = Path(directory)
  if (directory / HF_FILE).is_file():
    tok = _load_hf(directory / HF_FILE, bos_id, eos_id)
  elif (directory / SP_FILE).is_file():
    tok = _load_sp(directory / SP_FILE, bos_id, eos_id)
  else:
    return None
  tok.chat = chat_lib.hf_template(directory, _config(directory))
  return tok


def check_same_tokens(target: Tokenizer | None, draft: Tokenizer | None) -> None:
  """Speculative decoding compares token ids, so an id must be the same text
  for both models (llama.cpp checks the same). Tokens both tokenizers have
  are compared; a model without a tokenizer is not checked.

  Raises:
    TokenizerError: the first id whose string differs.
  """
  if target is None or draft is None:
    return
  a, b = target.tokens(), draft.tokens()
  for i, (x, y) in enumerate(zip(a, b)):
    if x != y:
      raise TokenizerError(f"draft and target vocabularies differ: token {i} is {x!r} "
                           f"in the target ({target.source}), {y!r} in the draft "
                           f"({draft.source})")
