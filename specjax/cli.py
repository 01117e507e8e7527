"""Shared plumbing for the absl scripts in experiments/: errors, prompts, output.

Bad input is one line and exit status 1 (`run`): a SpecjaxError, an OSError,
a bad flag, a config file's mistakes; config files and output paths are
checked before the work (preflight.py).
"""

from __future__ import annotations

import json
import os
import sys
from typing import Any, Callable

from absl import app, flags, logging

from specjax import preflight
from specjax.decode import plan
from specjax.errors import ConfigError, SpecjaxError
from specjax.formats import chat as chat_lib
from specjax.model.sampling import SamplingParams
from specjax.metrics import divergence

# Used when a model has no tokenizer and no prompt is given: 32 fixed ids.
DEFAULT_PROMPT_TOKENS = [1] + list(range(100, 131))
DEFAULT_PROMPT_TEXT = "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n"


def fail(message: str) -> None:
  """Bad input: one line on stderr, exit status 1."""
  print(f"error: {message}", file=sys.stderr)
  sys.exit(1)


def _parse_flags(argv: list[str]) -> list[str]:
  """absl's flag parsing, a bad flag reported as one line (not absl's two,
  nor ml_collections' tracebacks: `config_error_line`)."""
  try:
    return flags.FLAGS(argv)
  except flags.Error as e:
    fail(preflight.config_error_line(e, argv) or str(e))
  except Exception as e:  # pylint: disable=broad-except
    line = preflight.config_error_line(e, argv)
    if line is None:
      raise
    fail(line)
  return []


# Every script that runs a model takes these (defined once, here).
_MESH = flags.DEFINE_string(
    "mesh", None, "Device mesh 'data:D,model:M' (batch rows x tensor parallel); "
    "-1 = all remaining devices, e.g. 'model:-1'. Default: one device, no mesh.")
_DRAFT_SHARDING = flags.DEFINE_enum(
    "draft_sharding", "auto", ["auto", "model", "replicated"],
    "The draft on the mesh: split over the model axis like the target "
    "('model'), a full copy on every device ('replicated'), or split when its "
    "head, KV-head, FFN and vocabulary sizes allow it and replicated otherwise "
    "('auto').")
_COORDINATOR = flags.DEFINE_string(
    "coordinator_address", None, "Multi-process runs: host:port of process 0 "
    "(or SPECJAX_COORDINATOR; python -m specjax.parallel.launch sets it).")
_NUM_PROCESSES = flags.DEFINE_integer("num_processes", None,
                                      "Multi-process runs: number of processes.",
                                      lower_bound=1)
_PROCESS_ID = flags.DEFINE_integer("process_id", None,
                                   "Multi-process runs: this process's index.", lower_bound=0)
_LEVER = flags.DEFINE_string(
    "lever", "default", "A GPU lever (specjax/model/levers.py, BUILD.md): default | blocked | "
    "masked | fused (attention kinds) | draft_scan | command_buffers | all; one with XLA flags "
    "needs them in XLA_FLAGS when the process starts (python -m specjax.model.levers NAME).")


DRAFTER_HELP = ("What proposes the drafts: model (the --model_draft model) | ngram[:A-B] "
                "(prompt lookup over the prompt and output, n-gram sizes B down to A; "
                "default 1-4) | layerskip:N (the target's first N layers, sharing its "
                "cache) | layerskip:LIST (listed target layers, e.g. 0-9,12,15) | eagle[:PATH] "
                "(an EAGLE head; bare: the head shipped for the target, stdlib-eagle or smollm2-eagle) | "
                "eagle3[:PATH] (an EAGLE-3 head: three fused target layers, its reduced "
                "vocabulary; bare: smollm2-eagle3 once shipped). The heads draft under "
                "--gamma=auto and --tree=auto too.")


def DEFINE_config_file(name: str, default: str, help_string: str):  # pylint: disable=invalid-name
  """ml_collections' config-file flag (locked: an override must name an
  existing field). Without --NAME on the command line, the default file and
  its overrides are parsed here, at the script's import: a mistake in them
  (--config.gamma=4) is one line and exit 1, as it is from `run`."""
  from ml_collections import config_flags  # pylint: disable=import-outside-toplevel
  try:
    return config_flags.DEFINE_config_file(name, default, help_string, lock_config=True)
  except Exception as e:  # pylint: disable=broad-except
    line = preflight.config_error_line(e, sys.argv)
    if line is None:
      raise
    fail(line)


def define_drafter_flag():
  """--drafter (see specjax.drafters.registry.parse); call at import time of a script."""
  return flags.DEFINE_string("drafter", "model", DRAFTER_HELP)


def setup_devices() -> None:
  """jax.distributed (if asked for), the --lever and the --mesh, before the script runs.
  Processes other than 0 print nothing on stdout and write no files."""
  from specjax.model import levers, sharding  # pylint: disable=import-outside-toplevel
  import jax  # pylint: disable=import-outside-toplevel
  multi = sharding.initialize_distributed(_COORDINATOR.value, _NUM_PROCESSES.value,
                                          _PROCESS_ID.value)
  if multi and jax.process_index() != 0:
    sys.stdout = open(os.devnull, "w")  # pylint: disable=consider-using-with
  levers.use(_LEVER.value, os.environ.get("XLA_FLAGS", ""))
  if _MESH.value is not None:
    sharding.activate(sharding.make_mesh(_MESH.value), _DRAFT_SHARDING.value)
  elif multi:  # several processes and no mesh: all devices on the model axis
    sharding.activate(sharding.make_mesh("model:-1"), _DRAFT_SHARDING.value)


def run(main: Callable[[list[str]], Any]) -> None:
  """absl's app.run, with bad input printed as one line and exit status 1."""
  def wrapped(argv):
    logging.set_verbosity(logging.WARNING)  # hide JAX's backend probing
    if len(argv) > 1:
      fail(f"unexpected arguments: {' '.join(argv[1:])}")
    try:
      preflight.check_config_flags()
      preflight.check_output_flags()
      setup_devices()
      from specjax import workdir as wd  # pylint: disable=import-outside-toplevel
      wd.git_commit()  # the commit this process loaded, read before a long run (cached)
      return main(argv)
    except SpecjaxError as e:
      fail(str(e))
    except OSError as e:
      fail(preflight.os_error_line(e))
    except KeyboardInterrupt:
      print("interrupted", file=sys.stderr)
      sys.exit(130)
  app.run(wrapped, flags_parser=_parse_flags)


# --gamma: the draft length, one meaning on every script.
AUTO = "auto"        # --gamma=auto: chosen at run time (specjax.decode.autogamma)
MAX_GAMMA = 64


def parse_gamma(value: str) -> int | str:
  """One --gamma value: an integer in [1, MAX_GAMMA], or AUTO (chosen at run
  time). Raises SpecjaxError (one line) otherwise."""
  v = str(value).strip().lower()
  if v == AUTO:
    return AUTO
  if plan.parse_rows(v) is not None:  # auto:rows[,..]: checked, kept as spelled
    return v
  try:
    g = int(v)
  except ValueError:
    g = None
  if g is None or not 1 <= g <= MAX_GAMMA:
    raise ConfigError(f"--gamma must be an integer from 1 to {MAX_GAMMA}, '{AUTO}' or "
                       f"'{AUTO}:rows[,max=G][,budget=N]', got {value!r}")
  return g


def parse_gammas(values: list[str]) -> tuple[list[int], bool]:
  """A --gamma list (e.g. 1,2,4,auto): (the fixed gammas, sorted and
  distinct; whether 'auto' is among them)."""
  got = [parse_gamma(v) for v in values]
  if not got:
    raise ConfigError("--gamma is empty")
  if any(isinstance(g, str) and g != AUTO for g in got):
    raise ConfigError("--gamma=auto:rows is one run's setting (experiments/speculative.py), "
                      "not a value of a list of gammas")
  return sorted({g for g in got if g != AUTO}), AUTO in got


def row_records(prompts: list[list[int]], tokens: list[list[int]],
                baseline_tokens: list[list[int]] | None = None,
                equality_claimed: bool = False) -> list[dict[str, Any]]:
  """The `rows` of a --json_out: per row its prompt ids, its output tokens and
  (when a target-only baseline ran) the baseline's tokens, so that a batched
  run can be checked and reused row by row. `equality_claimed` (greedy, the
  real rule: divergence.equality_claimed) adds each row's `first_divergence`
  from its baseline."""
  if len(tokens) != len(prompts) or (baseline_tokens is not None
                                     and len(baseline_tokens) != len(prompts)):
    raise ValueError(f"{len(prompts)} prompts but {len(tokens)} token rows")
  rows = []
  for i, (p, t) in enumerate(zip(prompts, tokens)):
    row = {"prompt_ids": list(p), "tokens": list(t)}
    if baseline_tokens is not None:
      row["baseline_tokens"] = list(baseline_tokens[i])
      if equality_claimed:
        row["first_divergence"] = divergence.first_divergence(t, baseline_tokens[i])
    rows.append(row)
  return rows


class PromptFlags:
  """--prompt, --prompt_tokens, --chat and --system (and, with `file`,
  --prompt_file): how a script's prompt is given. Defined once here (call at
  import time of the script, like any absl flag)."""

  def __init__(self, file: bool = True):
    self._prompt = flags.DEFINE_string("prompt", None, "Prompt text (needs a tokenizer).")
    self._prompt_tokens = flags.DEFINE_string("prompt_tokens", None,
                                              "Prompt as comma-separated token ids.")
    self._chat = flags.DEFINE_bool(
        "chat", False, "Render the prompt as a user turn with the model's chat template "
        "(add_generation_prompt; as transformers' apply_chat_template): for Instruct models.")
    self._system = flags.DEFINE_string("system", None,
                                       "With --chat: a system turn before the prompt.")
    self._prompt_file = None
    if file:
      self._prompt_file = flags.DEFINE_string(
          "prompt_file", None, "The rows of one batch: one prompt per line (text; "
          "comma-separated ids for a model without a tokenizer), or a .jsonl file of "
          '{"prompt": TEXT} or, with --chat, conversations ({"messages": [...]} or a list '
          "of messages).")

  def prompt(self, tokenizer, vocab_size: int) -> list[int]:
    return parse_prompt(self._prompt.value, self._prompt_tokens.value, tokenizer, vocab_size,
                        chat=self._chat.value, system=self._system.value)

  def prompts(self, tokenizer, vocab_size: int) -> list[list[int]]:
    """--prompt_file's prompts, else the one prompt."""
    if self._prompt_file is None or self._prompt_file.value is None:
      return [self.prompt(tokenizer, vocab_size)]
    if self._prompt.value is not None or self._prompt_tokens.value is not None:
      raise ConfigError("give --prompt_file or --prompt / --prompt_tokens, not both")
    return read_prompt_file(self._prompt_file.value, tokenizer, vocab_size,
                            chat=self._chat.value, system=self._system.value)


class GenerationFlags:
  """The flags every generation script shares: prompt(s) (PromptFlags),
  sampling, seed, dtype.

  Defined once here (call at import time of the script, like any absl flag).
  """

  def __init__(self, seed_help: str = "Sampling seed (and random-init seed for presets)."):
    self._prompts = PromptFlags(file=True)
    self._n_parallel = flags.DEFINE_integer("n_parallel", 1, "Rows per prompt: each prompt "
                                            "repeated this many times in the batch.",
                                            lower_bound=1)
    self._temp = flags.DEFINE_float("temp", 0.0, "Sampling temperature; 0 = greedy.",
                                    lower_bound=0.0)
    self._top_k = flags.DEFINE_integer("top_k", 0, "Top-k filter; 0 = off.", lower_bound=0)
    self._top_p = flags.DEFINE_float("top_p", 1.0, "Top-p (nucleus) filter; 1 = off.",
                                     lower_bound=1e-6, upper_bound=1.0)
    self._seed = flags.DEFINE_integer("seed", 0, seed_help)
    self._dtype = flags.DEFINE_enum(
        "dtype", None, ["float32", "bfloat16", "float16", "f32", "bf16", "f16", "bf16-mixed",
                           "int8"],
        "Compute and parameter dtype (bf16-mixed: bf16 weights and matmul operands, f32 "
        "accumulation and the rest in f32; int8: weight-only int8 projections with one "
        "f32 scale per output channel, computed in f32); default: the model's own.")

  @property
  def seed(self) -> int:
    return self._seed.value

  @property
  def dtype(self) -> str | None:
    return self._dtype.value

  def sampling(self) -> SamplingParams:
    return SamplingParams(self._temp.value, self._top_k.value, self._top_p.value)

  def prompt(self, tokenizer, vocab_size: int) -> list[int]:
    return self._prompts.prompt(tokenizer, vocab_size)

  def prompts(self, tokenizer, vocab_size: int) -> list[list[int]]:
    """The batch's rows: --prompt_file's prompts (else the one prompt), each
    repeated --n_parallel times."""
    prompts = self._prompts.prompts(tokenizer, vocab_size)
    return [p for p in prompts for _ in range(self._n_parallel.value)]


class RecordFlags:
  """--json_out and --jsonl_out of the benchmark scripts: each record as a
  JSON line as soon as it is finished, all of them as one JSON object at the
  end; a progress row per record on stderr."""

  def __init__(self, what: str = "test"):
    self._json = flags.DEFINE_string("json_out", None, "Write all results as one JSON object.")
    self._jsonl = flags.DEFINE_string("jsonl_out", None,
                                      f"Append one JSON line per {what}, as each finishes.")

  def on_record(self, progress_row: Callable[[dict[str, Any]], str]):
    """The callback a benchmark calls with each finished record."""
    from specjax import workdir as wd  # pylint: disable=import-outside-toplevel

    def on_record(r):
      print(progress_row(r), file=sys.stderr, flush=True)
      if self._jsonl.value:
        wd.append_jsonl(self._jsonl.value, [r])
    return on_record

  def finish(self, records: list[dict[str, Any]]) -> None:
    """Prints the machine line; writes --json_out."""
    from specjax import workdir as wd  # pylint: disable=import-outside-toplevel
    if records:
      print(f"\nmachine: {wd.machine_line(records[0].get('env') or wd.environment())}")
    if self._json.value:
      wd.write_json(self._json.value, {"flags": flags.FLAGS.flag_values_dict(),
                                       "results": records})


NO_TEMPLATE = ("no chat template (no chat_template.jinja or chat_template in "
               "tokenizer_config.json; no tokenizer.chat_template in a GGUF file)")


def chat_ids(tokenizer, messages, what: str = "--chat") -> list[int]:
  """A conversation's ids through the model's chat template (formats/chat.py);
  `what` (the flag or config field that asked) names the fix when the model
  has no tokenizer or no template."""
  if tokenizer is None:
    raise ConfigError(f"{what} needs the model's tokenizer and chat template, and this model "
                      f"has no tokenizer")
  if tokenizer.chat is None:
    raise ConfigError(f"{what}: {tokenizer.source} has {NO_TEMPLATE}; prompt it as raw text "
                      f"(without {what})")
  return tokenizer.encode_chat(messages)


def parse_prompt(prompt: str | None, prompt_tokens: str | None, tokenizer,
                 vocab_size: int, chat: bool = False, system: str | None = None) -> list[int]:
  """Token ids from --prompt (needs a tokenizer) or --prompt_tokens=1,2,3.
  With `chat`, the prompt (or the default text) is a user turn after an
  optional `system` turn, rendered with the model's chat template."""
  if prompt is not None and prompt_tokens is not None:
    raise SpecjaxError("give --prompt or --prompt_tokens, not both")
  if system is not None and not chat:
    raise ConfigError("--system needs --chat (a system turn exists only in a chat template)")
  if chat and prompt_tokens is not None:
    raise ConfigError("--chat renders text with the chat template; --prompt_tokens are ids "
                      "already: give --prompt or drop --chat")
  if prompt_tokens is not None:
    try:
      ids = [int(t) for t in prompt_tokens.replace(" ", "").split(",") if t]
    except ValueError:
      raise SpecjaxError(f"--prompt_tokens must be comma-separated integers, "
                         f"got {prompt_tokens!r}") from None
  elif chat:
    ids = chat_ids(tokenizer, chat_lib.user_turn(DEFAULT_PROMPT_TEXT if prompt is None
                                                 else prompt, system))
  elif tokenizer is not None:
    ids = tokenizer.encode(DEFAULT_PROMPT_TEXT if prompt is None else prompt)
  elif prompt is not None:
    raise SpecjaxError("this model has no tokenizer (a GGUF file without tokenizer.ggml.tokens, "
                       "or a directory without tokenizer.json or tokenizer.model): "
                       "pass --prompt_tokens")
  else:
    ids = list(DEFAULT_PROMPT_TOKENS)
  return check_ids(ids, vocab_size)


def check_ids(ids: list[int], vocab_size: int) -> list[int]:
  """A prompt's ids: not empty, inside the vocabulary."""
  if not ids:
    raise SpecjaxError("the prompt is empty")
  bad = [t for t in ids if not 0 <= t < vocab_size]
  if bad:
    raise SpecjaxError(f"prompt token ids {bad[:5]} are outside the vocabulary "
                       f"[0, {vocab_size})")
  return ids


def read_prompt_file(path: str, tokenizer, vocab_size: int, chat: bool = False,
                     system: str | None = None) -> list[list[int]]:
  """The rows of --prompt_file; an empty line is an error (it would be an
  empty row).

  A text file: one prompt per line (text with a tokenizer, else
  comma-separated ids), each a user turn with `chat`. A .jsonl file: one JSON
  value per line, {"prompt": TEXT} (as a text line) or a conversation,
  {"messages": [...]} or a bare list of messages, which renders with the
  chat template and so needs `chat` (`system` is put first in a conversation
  that has no system turn).
  """
  try:
    with open(path, encoding="utf-8") as f:
      lines = f.read().splitlines()
  except OSError as e:
    raise ConfigError(f"cannot read --prompt_file {path}: {e.strerror}") from None
  except UnicodeDecodeError as e:
    raise ConfigError(f"--prompt_file {path} is not UTF-8 text (byte 0x{e.object[e.start]:02x} "
                      f"at offset {e.start}); give one prompt per line") from None
  if not lines:
    raise ConfigError(f"--prompt_file {path} holds no prompt")
  jsonl = path.endswith(".jsonl")
  prompts = []
  for i, line in enumerate(lines, 1):
    if not line.strip():
      raise ConfigError(f"--prompt_file {path}: line {i} is empty (one prompt per line)")
    if jsonl:
      prompts.append(_jsonl_prompt(line, f"--prompt_file {path} line {i}", tokenizer,
                                   vocab_size, chat, system))
    elif tokenizer is not None or chat:
      prompts.append(parse_prompt(line, None, tokenizer, vocab_size, chat, system))
    else:
      prompts.append(parse_prompt(None, line, None, vocab_size))
  return prompts


def _jsonl_prompt(line: str, where: str, tokenizer, vocab_size: int, chat: bool,
                  system: str | None) -> list[int]:
  """One line of a .jsonl --prompt_file (read_prompt_file)."""
  try:
    value = json.loads(line)
  except ValueError as e:
    raise ConfigError(f"{where} is not JSON: {e}") from None
  if isinstance(value, dict) and isinstance(value.get("prompt"), str):
    return parse_prompt(value["prompt"], None, tokenizer, vocab_size, chat, system)
  messages = value.get("messages") if isinstance(value, dict) else value
  if not isinstance(messages, list):
    raise ConfigError(f'{where}: expected {{"prompt": TEXT}}, {{"messages": [...]}} or a list '
                      f"of messages")
  if not chat:
    raise ConfigError(f"{where} is a conversation, which renders with the chat template: "
                      f"pass --chat")
  try:
    messages = chat_lib.check_messages(messages, where)
  except SpecjaxError as e:
    raise ConfigError(str(e)) from None
  return check_ids(chat_ids(tokenizer, chat_lib.with_system(messages, system)), vocab_size)


def detokenize(tokenizer, ids: list[int]) -> str:
  """Text for ids; without a tokenizer, the ids themselves ('1 100 101 ')."""
  if tokenizer is None:
    return "".join(f"{t} " for t in ids)
  return tokenizer.decode(ids)


def rate_line(label: str, secs: float, n: int, unit: str) -> str:
  """llama_print_timings style: total ms / n, ms per token, tokens per second."""
  ms = 1e3 * secs
  per = ms / n if n else float("nan")
  tps = n / secs if secs > 0 else float("nan")
  return (f"{label:>18} = {ms:10.2f} ms / {n:5d} {unit:6s} ({per:8.2f} ms per "
          f"token, {tps:9.2f} tokens per second)")
