"""llama.cpp's pre-tokenizers: the regex splits before byte-level BPE, by the
value of a GGUF file's `tokenizer.ggml.pre`.

The table (each family's regexes; the aliases with their `ignore_merges`
and `add_bos` flags) is llama.cpp's src/llama-vocab.cpp at LLAMA_CPP_COMMIT,
written down as data. Each regex splits every piece the previous one left,
and BPE merges within pieces only. llama.cpp does not run these regexes as
written (hand-written splitters for GPT-2 and LLaMA-3; std::regex, with
Unicode categories collapsed to bytes, for the rest), so `compile_regex`
rewrites each for Oniguruma (the `tokenizers` engine) to split as llama.cpp
does. Invariant: the rewrite splits as a re-implementation of llama.cpp's
splitting does (tests/formats/test_pretokenizers.py). The collapsing, the
rewrite rules, the families left out: docs/gguf_int8.md, "Pre-tokenizers".
"""

from __future__ import annotations

import dataclasses
import re

from specjax.errors import TokenizerError

LLAMA_CPP_COMMIT = "00ad355e009e83abf98f96a6ded7193b95763681"

# The two regexes llama.cpp splits with hand-written code (unicode.cpp,
# unicode_regex_split_custom_gpt2 / _llama3): the code also splits by the
# trailing `\s+` that GPT-2's string here lacks, which changes no split (a
# whitespace that `\s+(?!\S)` leaves is followed by a non-space, so it is a
# piece of its own either way); written here with it, as GPT-2 has it.
GPT2 = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)"
_CONTRACTIONS = r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])"
LLAMA3 = (_CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
          r"|\s*[\r\n]+|\s+(?!\S)|\s+")
CUSTOM = {GPT2: GPT2 + r"|\s+", LLAMA3: LLAMA3}

_QWEN2 = (_CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
          r"|\s*[\r\n]+|\s+(?!\S)|\s+")
_CJK = "[\u4e00-\u9fa5\u0800-\u4e00\uac00-\ud7ff]+"          # deepseek-llm / -coder
_HAN_KANA = "[\u4e00-\u9fa5\u3040-\u309f\u30a0-\u30ff]+"    # deepseek-v3, spark2_5, youtu
_DEEPSEEK3_HEAD = (r"""[!"#$%&'()*+,\-./:;<=>?@\[\\\]^_`{|}~][A-Za-z]+"""
                   r"|[^\r\n\p{L}\p{P}\p{S}]?[\p{L}\p{M}]+")
# Cased letters (deepseek-llm's tokenizer.json), code points as llama.cpp spells them.
_DEEPSEEK_LETTERS = (
    "A-Za-z\u00b5\u00c0-\u00d6\u00d8-\u00f6\u00f8-\u01ba\u01bc-\u01bf\u01c4-\u0293"
    "\u0295-\u02af\u0370-\u0373\u0376\u0377\u037b-\u037d\u037f\u0386\u0388-\u038a\u038c"
    "\u038e-\u03a1\u03a3-\u03f5\u03f7-\u0481\u048a-\u052f\u0531-\u0556\u10a0-\u10c5"
    "\u13a0-\u13f5\u13f8-\u13fd\u1c90-\u1cba\u1cbd-\u1cbf\u1d00-\u1d2b\u1d6b-\u1d77"
    "\u1d79-\u1d9a\u1e00-\u1f15\u1f18-\u1f1d\u1f20-\u1f45\u1f48-\u1f4d\u1f50-\u1f57\u1f59"
    "\u1f5b\u1f5d\u1f5f-\u1f7d\u1f80-\u1fb4\u1fb6-\u1fbc\u1fbe\u1fc2-\u1fc4\u1fc6-\u1fcc"
    "\u1fd0-\u1fd3\u1fd6-\u1fdb\u1fe0-\u1fec\u1ff2-\u1ff4\u1ff6-\u1ffc\u2102\u2107"
    "\u210a-\u2113\u2115\u2119-\u211d\u2124\u2126\u2128\u212a-\u212d\u212f-\u2134\u2139"
    "\u213c-\u213f\u2145-\u2149\u214e\u2183\u2184\u2c00-\u2c7b\u2c7e-\u2ce4\u2ceb-\u2cee"
    "\u2cf2\u2cf3\ua640-\ua66d\ua680-\ua69b\ua722-\ua76f\ua771-\ua787\ua78b-\ua78e"
    "\uab70-\uabbf\ufb00-\ufb06\ufb13-\ufb17\uff21-\uff3a\uff41-\uff5a\U00010400-\U0001044f"
    "\U000104b0-\U000104d3\U000104d8-\U000104fb\U00010c80-\U00010cb2\U00010cc0-\U00010cf2"
    "\U000118a0-\U000118df\U0001e900-\U0001e943")
# The letter runs of tekken / gpt-4o, with llama.cpp's lookaheads for \p{Lu}-ish
# ("a letter that is not a-z") and \p{Ll}-ish ("a letter that is not A-Z").
_UPPERISH, _LOWERISH = r"((?=[\p{L}])([^a-z]))", r"((?=[\p{L}])([^A-Z]))"
_CASED_WORDS = (r"[^\r\n\p{L}\p{N}]?" + _UPPERISH + "*" + _LOWERISH + "+{c}"
                r"|[^\r\n\p{L}\p{N}]?" + _UPPERISH + "+" + _LOWERISH + "*{c}")
_TAIL_SLASH = r"| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
_SUBCATS = r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]"


@dataclasses.dataclass(frozen=True)
class Family:
  """One `LLAMA_VOCAB_PRE_TYPE_*`: its regexes (as llama.cpp writes them,
  applied in order) and the flags `load` sets with it."""
  name: str
  regexes: tuple[str, ...]
  ignore_merges: bool = False
  add_bos: bool = False


_FAMILIES = (
    # case LLAMA_VOCAB_PRE_TYPE_DEFAULT (the `default:` branch)
    Family("default", (r"[\p{P}\$\+<=>\^~\|]+", GPT2, r"\p{N}+", "[0-9][0-9][0-9]")),
    # case LLAMA3 (the adapted regex; load: ignore_merges, add_bos)
    Family("llama3", (LLAMA3,), ignore_merges=True, add_bos=True),
    # case JAIS2: LLaMA-3's with cascading whitespace runs
    Family("jais2", (_CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
                     r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+" + "".join(
                         rf"|\s{{{n}}}(?!\S)" for n in (512, 256, 128, 64, 32, 16, 8, 4))
                     + r"|\s{1,2}(?!\S)|\s{1}",)),
    # case DBRX, SMAUG: "same as llama3" (without load's flags)
    Family("dbrx", (LLAMA3,)),
    Family("smaug", (LLAMA3,)),
    # case DEEPSEEK_LLM
    Family("deepseek_llm", ("[\r\n]", r"\s?[" + _DEEPSEEK_LETTERS + "]+",
                            "\\s?[!-/:-~\uff01-\uff0f\uff1a-\uff5e\u2018-\u201f\u3000-\u3002]+",
                            r"\s+$", _CJK, r"\p{N}+")),
    # case DEEPSEEK3_LLM, HUNYUAN_DENSE, JOYAI_LLM, HY_V4
    Family("deepseek3_llm", (r"\p{N}{1,3}", _HAN_KANA, _DEEPSEEK3_HEAD
                             + r"| ?[\p{P}\p{S}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")),
    # case SPARK2_5
    Family("spark2_5", (r"\p{N}{1,3}", _HAN_KANA, _DEEPSEEK3_HEAD
                        + r"| ?[\p{P}\p{S}]+|[\r\n]|\s+(?!\S)|\s+", r"\p{N}")),
    # case YOUTU (load: ignore_merges)
    Family("youtu", (
        "[\uac00-\ud7a3\u3131-\u318e]+|[\uff01\u2026\u201c\u201d\u2018\u2019\u2014\uff1a"
        "\uff1b\uff0c\u3001-\u303f\ufe30-\ufe4f]+|[\u3105-\u312f]+|" + _HAN_KANA,
        _SUBCATS + r"*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+" + _CONTRACTIONS + "?|"
        + _SUBCATS + r"+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*" + _CONTRACTIONS + "?"
        r"|\p{N}" + _TAIL_SLASH), ignore_merges=True),
    # case DEEPSEEK_CODER
    Family("deepseek_coder", ("[\r\n]", r"\s?\p{L}+", r"\s?\p{P}+", _CJK, r"\p{N}")),
    # case FALCON
    Family("falcon", (r"[\p{P}\$\+<=>\^~\|`]+", GPT2, "[0-9][0-9][0-9]")),
    # case STARCODER, REFACT, COMMAND_R, SMOLLM, CODESHELL, EXAONE, MINERVA, MELLUM2
    Family("starcoder", (r"\p{N}", GPT2)),
    # case GPT2, MPT, OLMO, JAIS, TRILLION, GRANITE_DOCLING
    Family("gpt2", (GPT2,)),
    # case STABLELM2, QWEN2, HUNYUAN, SOLAR_OPEN
    Family("qwen2", (_QWEN2,)),
    # case QWEN35
    Family("qwen35", (_CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}"
                      r"| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+",)),
    # case PORO, BLOOM, GPT3_FINNISH
    Family("poro", (" ?[^(\\s|.,!?\u2026\u3002\uff0c\u3001\u0964\u06d4\u060c)]+",)),
    # case CHATGLM4: the same string as LLAMA3 (load: no default BOS id)
    Family("chatglm4", (LLAMA3,)),
    # case VIKING
    Family("viking", (" ?[^(\\s|.,!?\u2026\u3002\uff0c\u3001\u0964\u06d4\u060c)]+", r"\p{N}")),
    # case TEKKEN (load: ignore_merges, add_bos)
    Family("tekken", (_CASED_WORDS.replace("{c}", "") + r"|\p{N}" + _TAIL_SLASH,),
           ignore_merges=True, add_bos=True),
    # case CHAMELEON (load: add_bos)
    Family("chameleon", ("<sentinel:[0-9]+>", "(IMGIMG)((A|B|C|D|E|F|G|H|I){1,4})Z",
                         "([\\t\\n]|    |  )", r"\p{N}", r"[\p{P}!-/:-@\[-`{-~]", GPT2),
           add_bos=True),
    # case GPT4O, MINIMAX_M2
    Family("gpt4o", (_CASED_WORDS.replace("{c}", _CONTRACTIONS + "?") + r"|\p{N}{1,3}" + _TAIL_SLASH,)),
    # case GRANITE_EMB_MULTI: gpt-4o's with \p{M} beside \p{L} (load: ignore_merges)
    Family("granite_emb_multi", (
        _CASED_WORDS.replace(r"[\p{L}]", r"[\p{L}\p{M}]").replace("{c}", _CONTRACTIONS + "?")
        + r"|\p{N}{1,3}" + _TAIL_SLASH,), ignore_merges=True),
    # case TINY_AYA
    Family("tiny_aya", (r"\d{1,3}(?=(?:\d{3})*\b)",
                        _SUBCATS + r"*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+" + _CONTRACTIONS + "?|"
                        + _SUBCATS + r"+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*" + _CONTRACTIONS + "?"
                        r"|\p{N}{1,3}" + _TAIL_SLASH)),
    # case SUPERBPE: digit runs, then cut before each group of three from the right
    Family("superbpe", (r"\p{N}+", r"(?=(\d{3})+(?!\d))")),
    # case BAILINGMOE (llama.cpp's greedy form of the possessive original)
    Family("bailingmoe", (r"'(?:[sSdDmMtT]|[lL][lL]|[vV][eE]|[rR][eE])|[^\r\n\p{L}\p{N}]?\p{L}+"
                          r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]|\s+(?!\S)|\s+",)),
    # case SEED_CODER
    Family("seed_coder", (_CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1}"
                          r"| ?[^\s\p{L}\p{N}\r\n]+|\s*[\r\n]+|\s+(?!\S)|\s+",)),
    # case UFAKZEKA: qwen2's without the contractions
    Family("ufakzeka", (r"[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
                        r"|\s*[\r\n]+|\s+(?!\S)|\s+",)),
    # case GROK_2: qwen2's string
    Family("grok_2", (_QWEN2,)),
    # case AFMOE. Its first entry, "\p{AFMoE_digits}", names a hand-written
    # splitter (unicode_regex_split_custom_afmoe: a digit run as its leading
    # len % 3 digits, then threes); here the regex that splits the same.
    Family("afmoe", (r"\p{N}{1,3}(?=(?:\p{N}{3})*(?!\p{N}))",
                     "[\u4e00-\u9fff\u3400-\u4dbf\uf900-\ufaff\u3040-\u309f\u30a0-\u30ff"
                     "\uff65-\uff9f\u2f00-\u2fdf\u0e00-\u0e7f\u0e80-\u0eff\u1780-\u17ff"
                     "\u1000-\u109f\uaa60-\uaa7f\ua9e0-\ua9ff\uac00-\ud7af\u1100-\u11ff]+",
                     _DEEPSEEK3_HEAD + r"| ?[\p{P}\p{S}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")),
    # case LAGUNA
    Family("laguna", (r"[^\n]+|[\n]+", _QWEN2)),
    # case EXAONE_MOE
    Family("exaone_moe", (_CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?(?:\p{L}\p{M}*(?: \p{L}\p{M}*)*)+"
                          r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]?|\s*[\r\n]|\s+(?!\S)|\s+",)),
    # case MINICPM5 (load: ignore_merges)
    Family("minicpm5", (r"\p{N}{1,3}", _CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}+"
                        r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"),
           ignore_merges=True),
)
FAMILIES = {f.name: f for f in _FAMILIES}

# llama_vocab::impl::load: tokenizer.ggml.pre -> family.
ALIASES = {
    "default": "default", "minicpm5": "minicpm5",
    **dict.fromkeys(("llama3", "llama-v3", "llama-bpe", "falcon3", "falcon-h1", "pixtral",
                     "midm-2.0", "lfm2", "jina-v5-nano"), "llama3"),
    "deepseek-llm": "deepseek_llm", "deepseek-coder": "deepseek_coder",
    **dict.fromkeys(("deepseek-v3", "hunyuan-dense", "hy_v4", "joyai-llm"), "deepseek3_llm"),
    "spark2_5": "spark2_5", "youtu": "youtu", "falcon": "falcon", "mpt": "gpt2",
    **dict.fromkeys(("starcoder", "refact", "command-r", "smollm", "codeshell", "exaone",
                     "minerva-7b", "mellum2"), "starcoder"),
    **dict.fromkeys(("gpt-2", "phi-2", "jina-es", "jina-de", "gigachat", "jina-v2-es",
                     "jina-v2-de", "a.x-4.0", "mellum", "modern-bert", "jina-v1-en",
                     "jina-v2-code", "roberta-bpe", "exaone4", "olmo", "jais", "trillion",
                     "granite-docling"), "gpt2"),
    "jais-2": "jais2",
    **dict.fromkeys(("qwen2", "deepseek-r1-qwen", "kormo", "f2llmv2", "megrez", "stablelm2",
                     "hunyuan", "solar-open"), "qwen2"),
    "qwen35": "qwen35", "dbrx": "dbrx", "smaug-bpe": "smaug",
    **dict.fromkeys(("poro-chat", "bloom", "gpt3-finnish"), "poro"),
    **dict.fromkeys(("glm4", "chatglm-bpe"), "chatglm4"),
    "viking": "viking", "tekken": "tekken", "chameleon": "chameleon",
    **dict.fromkeys(("gpt-4o", "llama4", "kanana2", "talkie", "minimax-m2"), "gpt4o"),
    "granite-embed-multi-97m": "granite_emb_multi",
    **dict.fromkeys(("tiny_aya", "cohere2moe"), "tiny_aya"),
    "superbpe": "superbpe",
    **dict.fromkeys(("bailingmoe", "bailingmoe2", "llada-moe"), "bailingmoe"),
    "seed-coder": "seed_coder", "ufakzeka": "ufakzeka", "grok-2": "grok_2", "afmoe": "afmoe",
    "laguna": "laguna", "exaone-moe": "exaone_moe",
}
# Values llama.cpp knows that are not byte-level BPE splits.
NOT_BYTE_LEVEL = {
    "kimi-k2": "llama.cpp splits it with hand-written code and it has no merges",
    "gemma4": "SentencePiece-style BPE on raw UTF-8",
    "granite-embed-multi-311m": "SentencePiece-style BPE on raw UTF-8",
    "sarvam-moe": "SentencePiece-style BPE on raw UTF-8",
    "whitespace": "a whitespace split on raw UTF-8",
}
# A file without tokenizer.ggml.pre (written before the key existed).
MISSING = "default"


def family(pre: str | None, source: str) -> Family:
  """The family of a tokenizer.ggml.pre value (None: the key is absent).

  Raises:
    TokenizerError: a value llama.cpp does not know, or one that is not a
      byte-level BPE split; the message names the supported values.
  """
  name = ALIASES.get(MISSING if pre is None else pre)
  if name is not None:
    return FAMILIES[name]
  why = NOT_BYTE_LEVEL.get(pre, "not a value llama.cpp knows")
  raise TokenizerError(f"{source}: pre-tokenizer tokenizer.ggml.pre={pre!r} is not supported "
                       f"({why}); supported: {', '.join(sorted(ALIASES))}")


_SUBCATEGORY = re.compile(r"\\p\{L[ultmo]\}")
_CATEGORY = re.compile(r"\\p\{[LNPMS][ultmo]?\}")
# Unicode's non-ASCII White_Space: llama.cpp turns these into \v before
# matching, so no literal of a bracket matches them.
_WIDE_SPACES = "\x85\xa0\u1680\u2000-\u200a\u2028\u2029\u202f\u205f\u3000"
_ASCII_BOUNDARY = r"(?:(?<=\w)(?!\w)|(?<!\w)(?=\w))".replace(r"\w", "[0-9A-Za-z_]")


def _amend_brackets(regex: str, amend, bare=None) -> str:
  """`regex` with `amend(parts)` (a string) added before the `]` of each
  bracket (parts: its characters and escapes, '[' first), and each escape
  outside a bracket replaced by `bare(escape)` (itself if None)."""
  out, bracket = [], None  # bracket: the open class's parts, None outside one
  i = 0
  while i < len(regex):
    part = regex[i:i + 5] if regex.startswith(r"\p{", i) else regex[i:i + 1 + (regex[i] == "\\")]
    i += len(part)
    if bracket is None:
      if part == "[":
        bracket = [part]
      else:
        out.append(bare(part) if bare else part)
    elif part == "]" and len(bracket) > 1 + (bracket[-1] == "^"):
      out += bracket + [amend(bracket), part]
      bracket = None
    else:
      bracket.append(part)
  return "".join(out + (bracket or []))


def compile_regex(regex: str) -> str:
  """`regex` rewritten for Oniguruma to split as llama.cpp does (see the
  module docstring): the hand-written splitters' regexes in full; with a
  \\p{..}, the letter subcategories as \\p{L} and \\p{S} without '~'; else
  (llama.cpp's std::wregex) \\d and \\b ASCII, `$` the end of the piece, and
  no non-ASCII whitespace in a bracket that lists non-ASCII characters."""
  if regex in CUSTOM:
    return CUSTOM[regex]
  if not _CATEGORY.search(regex):
    regex = regex.replace(r"\d", "[0-9]").replace(r"\b", _ASCII_BOUNDARY)
    if regex.endswith("$") and not regex.endswith(r"\$"):
      regex = regex[:-1] + r"\z"
    wide = lambda parts: (f"&&[^{_WIDE_SPACES}]" if parts[1:2] != ["^"]
                          and any(ord(p[-1]) > 127 for p in parts) else "")
    return _amend_brackets(regex, wide)
  regex = _SUBCATEGORY.sub(r"\\p{L}", regex)
  if r"\p{S}" not in regex:
    return regex
  return _amend_brackets(regex, lambda parts: "&&[^~]" if r"\p{S}" in parts else "",
                         lambda part: r"[\p{S}&&[^~]]" if part == r"\p{S}" else part)


def pre_tokenizer(fam: Family, byte_level: bool = True):
  """The `tokenizers` pre-tokenizer of a family: its regexes (compiled as
  above) as isolated splits, in order, then (byte_level) the byte-level
  alphabet, GPT-2's bytes_to_unicode."""
  from tokenizers import Regex, pre_tokenizers  # pylint: disable=import-outside-toplevel
  splits = [pre_tokenizers.Split(Regex(compile_regex(r)), behavior="isolated")
            for r in fam.regexes]
  return pre_tokenizers.Sequence(
      splits + [pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)] * byte_level)
