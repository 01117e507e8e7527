"""Chat templates: a conversation -> the text an Instruct model was trained on.

An Instruct checkpoint carries a Jinja template that turns messages
([{"role": "user", "content": "..."}, ...]) into its prompt format; prompting
it with raw text measures another distribution than the one it is used on.
The template comes from an HF directory or a GGUF file (`hf_template`,
`gguf_template`) and renders as transformers' `apply_chat_template` renders
it. Invariants: the ids equal transformers' (the text is encoded without the
tokenizer's own special tokens, `Tokenizer.encode_chat`: one BOS, never
two); a template is input, not trusted code: sandboxed, bounded in time and
output (RENDER_SECONDS, RENDER_CHARS), and whatever it raises is one
TokenizerError. Where a template is looked for, the rendering environment,
the bounds: docs/models.md, "Chat models".
"""

from __future__ import annotations

import dataclasses
import datetime
import functools
import json
import sys
import time
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

from specjax.errors import TokenizerError

TEMPLATE_FILE = "chat_template.jinja"   # an HF directory's template (newer transformers)
GGUF_KEY = "tokenizer.chat_template"
# The special tokens transformers hands a template (its special_tokens_map).
SPECIAL_KEYS = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token",
                "mask_token")
# GGUF: the id key of each special token whose string a template may use.
_GGUF_IDS = {"bos_token": "tokenizer.ggml.bos_token_id",
             "eos_token": "tokenizer.ggml.eos_token_id",
             "unk_token": "tokenizer.ggml.unknown_token_id",
             "sep_token": "tokenizer.ggml.seperator_token_id",  # sic: llama.cpp's spelling
             "pad_token": "tokenizer.ggml.padding_token_id"}

Message = Mapping[str, Any]
# Rendering bounds: a real template renders a conversation in milliseconds,
# and its text is shorter than any context.
RENDER_SECONDS = 5.0
RENDER_CHARS = 1 << 22


@dataclasses.dataclass(frozen=True)
class ChatTemplate:
  """A model's chat template and the special-token strings it may write."""
  template: str
  special: Mapping[str, str]  # SPECIAL_KEYS -> the token's text (those the model names)
  source: str                 # where it was read from (errors name it)

  @property
  def bos_token(self) -> str | None:
    return self.special.get("bos_token")

  @property
  def eos_token(self) -> str | None:
    return self.special.get("eos_token")

  def render(self, messages: Sequence[Message], add_generation_prompt: bool = True) -> str:
    """The prompt text of a conversation, as transformers'
    apply_chat_template(messages, add_generation_prompt=..., tokenize=False).

    Raises:
      TokenizerError: bad messages, or the template refuses them (its
        raise_exception) or fails; one line naming the source.
    """
    messages = check_messages(messages, self.source)
    compiled = _compile(self.template, self.source)
    import jinja2  # pylint: disable=import-outside-toplevel
    try:
      return bounded_render(compiled, dict(
          messages=messages, tools=None, documents=None,
          add_generation_prompt=add_generation_prompt, **self.special))
    except jinja2.TemplateError as e:
      raise TokenizerError(f"{self.source}: the chat template failed: "
                           f"{_one_line(e)}") from None
    except Exception as e:  # pylint: disable=broad-except
      # 1/0, a type error, {% include %} without a loader, runaway recursion:
      # the template's mistake, said in one line like a TemplateError.
      raise TokenizerError(f"{self.source}: the chat template failed: "
                           f"{type(e).__name__}: {_one_line(e)}") from None


def check_messages(messages: Any, source: str = "conversation") -> list[dict[str, Any]]:
  """A conversation as plain dicts, None-valued keys dropped (transformers'
  normalisation): a non-empty list of {"role": str, "content": ...}.

  Raises:
    TokenizerError: anything else, in one line.
  """
  if not isinstance(messages, (list, tuple)) or not messages:
    raise TokenizerError(f"{source}: a conversation is a non-empty list of messages, "
                         f"got {_short(messages)}")
  out = []
  for i, m in enumerate(messages):
    if not isinstance(m, Mapping) or not isinstance(m.get("role"), str) or "content" not in m:
      raise TokenizerError(f"{source}: message {i} must be an object with a string 'role' "
                           f"and a 'content', got {_short(m)}")
    out.append({k: v for k, v in m.items() if v is not None})
  return out


def user_turn(prompt: str, system: str | None = None) -> list[dict[str, str]]:
  """A prompt as one user turn, after a system turn when `system` is given."""
  head = [] if system is None else [{"role": "system", "content": system}]
  return head + [{"role": "user", "content": prompt}]


def with_system(messages: Sequence[Message], system: str | None) -> list[Message]:
  """`messages` with a system turn first, unless `system` is None or the
  conversation already opens with one."""
  messages = list(messages)
  if system is None or (messages and isinstance(messages[0], Mapping)
                        and messages[0].get("role") == "system"):
    return messages
  return [{"role": "system", "content": system}] + messages


# ----------------------------------------------------------------- reading

def _pick(value: Any, source: str) -> str | None:
  """tokenizer_config.json's chat_template: a string, or named templates
  (a list of {"name", "template"}, or a dict) of which "default" is used."""
  if value is None or isinstance(value, str):
    return value or None
  if isinstance(value, list) and all(isinstance(x, Mapping) for x in value):
    value = {x.get("name"): x.get("template") for x in value}
  if isinstance(value, Mapping):
    if "default" not in value:
      raise TokenizerError(f"{source}: several chat templates ({', '.join(map(str, value))}) "
                           f"and none named 'default'")
    return _pick(value["default"], source)
  raise TokenizerError(f"{source}: chat_template is neither a string nor a list of named "
                       f"templates")


def _special_text(value: Any) -> str | None:
  """A tokenizer_config.json special token: a string or an AddedToken dict."""
  if isinstance(value, Mapping):
    value = value.get("content")
  return value if isinstance(value, str) else None


def hf_template(directory: str | Path, config: Mapping[str, Any]) -> ChatTemplate | None:
  """The chat template of an HF directory (`config`: its tokenizer_config.json
  as a dict), or None when it has none."""
  directory = Path(directory)
  file = directory / TEMPLATE_FILE
  if file.is_file():
    template, source = file.read_text(encoding="utf-8"), str(file)
  else:
    source = str(directory / "tokenizer_config.json")
    template = _pick(config.get("chat_template"), source)
  if not template:
    return None
  special = {k: _special_text(config.get(k)) for k in SPECIAL_KEYS}
  return ChatTemplate(template, {k: v for k, v in special.items() if v is not None}, source)


def gguf_template(get: Callable[[str], Any], tokens: Sequence[str],
                  source: str) -> ChatTemplate | None:
  """The chat template of a GGUF file's metadata, or None when it has none.

  Args:
    get: metadata key -> value (None when absent).
    tokens: tokenizer.ggml.tokens (the special tokens' strings, by id).
    source: the file (errors name it).
  """
  template = get(GGUF_KEY)
  if not template:
    return None
  special = {}
  for name, key in _GGUF_IDS.items():
    i = get(key)
    if i is not None and 0 <= int(i) < len(tokens):
      special[name] = str(tokens[int(i)])
  return ChatTemplate(str(template), special, f"{source} ({GGUF_KEY})")


# ------------------------------------------------------------- rendering

def bounded_render(compiled, variables: Mapping[str, Any]) -> str:
  """compiled.render(**variables), stopped with a SecurityError once the
  template's own code has run RENDER_SECONDS (checked at each of its lines,
  through a trace function on the compiled template's frames only) or its
  output passes RENDER_CHARS characters."""
  from jinja2.exceptions import SecurityError  # pylint: disable=import-outside-toplevel
  seconds, chars = RENDER_SECONDS, RENDER_CHARS
  deadline = time.monotonic() + seconds

  def on_line(frame, event, arg):
    del frame, event, arg
    if time.monotonic() > deadline:
      raise SecurityError(f"rendering ran past {seconds:g} s (a loop without end?)")
    return on_line

  def on_call(frame, event, arg):
    return on_line(frame, event, arg) if frame.f_code.co_filename == "<template>" else None

  previous, out, n = sys.gettrace(), [], 0
  sys.settrace(on_call)
  try:
    for piece in compiled.generate(**variables):
      n += len(piece)
      if n > chars:
        raise SecurityError(f"the rendered text passed {chars:,} characters")
      out.append(piece)
  finally:
    sys.settrace(previous)
  return "".join(out)


def _one_line(e: Exception) -> str:
  return " ".join(str(e).split()) or type(e).__name__


def _short(x: Any) -> str:
  text = repr(x)
  return text if len(text) <= 80 else text[:77] + "..."


@functools.lru_cache(maxsize=16)
def _compile(template: str, source: str):
  """The template compiled in transformers' environment (module docstring)."""
  import jinja2  # pylint: disable=import-outside-toplevel
  from jinja2 import ext, nodes  # pylint: disable=import-outside-toplevel
  from jinja2.sandbox import ImmutableSandboxedEnvironment  # pylint: disable=import-outside-toplevel

  class Generation(ext.Extension):
    """{% generation %}...{% endgeneration %} (transformers marks the
    assistant's tokens with it): renders its body."""
    tags = {"generation"}

    def parse(self, parser):
      lineno = next(parser.stream).lineno
      body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
      return nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

    def _body(self, caller):
      return caller()

  class Namespace(jinja2.utils.Namespace):
    """namespace() that refuses underscore names (no way into internals)."""

    def __init__(*args, **kwargs):  # pylint: disable=no-method-argument
      self, attrs = args[0], dict(*args[1:], **kwargs)
      for name in attrs:
        Namespace.check(name)
      jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, name, value):
      Namespace.check(name)
      jinja2.utils.Namespace.__setitem__(self, name, value)

    @staticmethod
    def check(name):
      if isinstance(name, str) and name.startswith("_"):
        raise jinja2.exceptions.SecurityError(f"namespace attribute {name!r}")

  def raise_exception(message):
    raise jinja2.exceptions.TemplateError(message)

  def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                      sort_keys=sort_keys)

  class Env(ImmutableSandboxedEnvironment):
    """transformers' sandbox, with `*` and `**` refused past RENDER_CHARS
    (a string times 10**9 would allocate before any bound could look)."""
    intercepted_binops = frozenset({"*", "**"})

    def call_binop(self, context, operator, left, right):
      if operator == "*":
        for seq, k in ((left, right), (right, left)):
          if isinstance(seq, (str, list, tuple)) and isinstance(k, int) and \
              len(seq) * k > RENDER_CHARS:
            raise jinja2.exceptions.SecurityError(f"{operator} would make {len(seq) * k:,} "
                                                  f"items")
      elif isinstance(left, int) and isinstance(right, int) and abs(left) > 1 and \
          right * abs(left).bit_length() > RENDER_CHARS:
        raise jinja2.exceptions.SecurityError("** would make a number past the bound")
      return super().call_binop(context, operator, left, right)

  env = Env(trim_blocks=True, lstrip_blocks=True, extensions=[Generation, ext.loopcontrols])
  env.filters["tojson"] = tojson
  env.globals["raise_exception"] = raise_exception
  env.globals["strftime_now"] = lambda fmt: datetime.datetime.now().strftime(fmt)
  env.globals["namespace"] = Namespace
  try:
    return env.from_string(template)
  except jinja2.TemplateError as e:
    raise TokenizerError(f"{source}: the chat template does not parse: {_one_line(e)}") from None
