"""The data of specjax/train/selfdistill.py: the prompt mix written here,
the target's replies to it (resumable batches), second-turn follow-ups, raw
stdlib documents, and one target pass per sequence storing each position's
feature and top-K soft label (why: docs/training.md).

Invariant of the mix: deduplicated, then split by group (`split`): an
instruction's (template, topic), a math problem's skeleton, a code or prose
prompt's source file (whose text no stdlib document repeats), so no held-out
prompt or its source is trained on. Its templates share no phrasing with the
task suites (tests/train/test_leaks.py)."""

from __future__ import annotations

import collections
import functools
import hashlib
import json
import math
import random
from pathlib import Path
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np

from specjax import workdir as wd
from specjax.decode import generation
from specjax.model import llama as model_lib
from specjax.model import steps
from specjax.model.config import ModelConfig
from specjax.train import corpus, mathgen

# ---------------------------------------------------------------- the prompt mix

# The mix's version, recorded with the data (selfdistill.DATA_FIELDS): 2 is
# deduplicated, split by group, with templates apart from the suites'; a
# workdir built by another version is other data.
MIX_VERSION = 2

TOPICS = (
    "photosynthesis", "compound interest", "the water cycle", "binary search", "recursion",
    "how vaccines work", "supply and demand", "plate tectonics", "hash tables", "gravity",
    "the French Revolution", "machine learning", "climate change", "the immune system",
    "public key cryptography", "how a compiler works", "inflation", "black holes",
    "version control", "the scientific method", "time management", "healthy sleep",
    "renewable energy", "the printing press", "unit testing", "garbage collection",
    "the Roman Empire", "ocean currents", "electric circuits", "sorting algorithms",
    "regular expressions", "volcanoes", "the stock market", "nutrition", "databases",
    "the internet", "migration of birds", "operating systems", "probability", "bread baking")
# The templates' wording is our own and shares no phrase with the task
# suites (the first wording did: issue 38).
INSTRUCTIONS = (
    "Describe {t} in plain language for a newcomer.",
    "Write one paragraph on {t}.",
    "Name three facts worth knowing about {t}.",
    "Sum up the core ideas of {t} in a few sentences.",
    "How would you teach {t} to a child? Keep it short.",
    "Weigh the pros and cons of {t}.",
    "Pose a short quiz question on {t} and give the answer.",
    "How are {t} and {u} alike, and how do they differ?",
    "Compose a haiku on the theme of {t}.",
    "Give two reasons why {t} matters.")
CODE_ASKS = {
    "complete": "Finish writing this Python function:\n\n```python\n{head}\n```",
    "explain": "Walk me through what this Python function does:\n\n```python\n{code}\n```",
    "edit": ("Tidy up this Python function: better variable names and a brief "
             "docstring.\n\n```python\n{code}\n```"),
    "test": "Write a unit test for this Python function:\n\n```python\n{code}\n```"}
PROSE_ASKS = (
    "Condense this text into a two-sentence summary.\n\n{p}",
    "Here is a text:\n\n{p}\n\nIn one sentence, what is the thing it describes for?",
    "Restate the text below in everyday words.\n\n{p}",
    "Pick out the technical terms in this text and define each one briefly.\n\n{p}")
# Targeted edits that return the whole function (the kind "edit"): the code
# first, then the request (a layout the suites do not use). {name} the
# function's name, {p} its first parameter (self / cls skipped); the asks
# that need {p} are skipped for a function without parameters.
EDIT_ASKS = (
    "Annotate the parameters and the return type of this function with type hints.",
    "Give this function the new name `{name}_v2`.",
    "Change the parameter name `{p}` to `{p}_arg` throughout.",
    "Insert a guard at the top: if `{p}` is None, raise TypeError.",
    "Strip out the docstring and every comment.",
    "Put a one-line docstring on the function describing its return value.",
    "Turn `{p}` into a keyword-only parameter.",
    "Emit a `logging.debug` message when the function is entered.")
EDIT_REPLY = ("Output just the revised code.", "Answer with the new version and nothing else.",
              "Give back the complete function after the change.")
FOLLOWUPS = ("Can you explain that more simply?", "Give an example.", "Make it shorter.",
             "Thanks! What should I learn next?", "Can you say it as a bulleted list?",
             "Why is that?")


def _function_head(code: str) -> str:
  """A function's def line and docstring (or first two lines): what to complete."""
  lines = code.splitlines()
  body = "\n".join(lines[1:])
  for q in ('"""', "'''"):
    s = body.find(q)
    if 0 <= s < 40:
      e = body.find(q, s + 3)
      if e > 0:
        return lines[0] + "\n" + body[:e + 3]
  return "\n".join(lines[:2])


def _first_param(code: str) -> tuple[str, str | None] | None:
  """(name, first parameter or None) of a function's source; None if it does not parse."""
  import ast  # pylint: disable=import-outside-toplevel
  try:
    fn = ast.parse(code).body[0]
  except (SyntaxError, ValueError, IndexError):
    return None
  if not isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
    return None
  args = [a.arg for a in fn.args.posonlyargs + fn.args.args if a.arg not in ("self", "cls")]
  return fn.name, (args[0] if args else None)


def edit_prompts(funcs: list[tuple[str, str]], n: int, seed: int) -> list[dict[str, Any]]:
  """n targeted-edit requests (EDIT_ASKS) over the functions funcs ((group,
  code) pairs), in turn; a function that does not parse, or lacks the
  parameter an ask names, is passed over. The code comes bare or fenced, in
  turn, before the request."""
  rng = random.Random(seed)
  out: list[dict[str, Any]] = []
  for group, code in funcs:
    if len(out) >= n:
      break
    got = _first_param(code)
    if got is None:
      continue
    name, param = got
    asks = [a for a in EDIT_ASKS if param is not None or "{p}" not in a]
    ask = asks[len(out) % len(asks)].format(name=name, p=param)
    body = code.rstrip()
    if len(out) % 2:
      body = f"```python\n{body}\n```"
    out.append({"kind": "edit", "group": group, "messages": [
        {"role": "user", "content": f"{body}\n\n{ask} {rng.choice(EDIT_REPLY)}"}]})
  return out


def _module_docstring(text: str) -> str:
  """A module's docstring as ast.get_docstring gives it, from its first
  tokens only (parsing every stdlib file took half the mix's time)."""
  import ast, inspect, io, tokenize  # pylint: disable=import-outside-toplevel,multiple-imports
  skip = (tokenize.COMMENT, tokenize.NL, tokenize.NEWLINE, tokenize.ENCODING)
  parts: list[str] = []
  try:
    for t in tokenize.generate_tokens(io.StringIO(text).readline):
      if t.type == tokenize.STRING:
        parts.append(t.string)
      elif parts and t.type in (tokenize.NEWLINE, tokenize.ENDMARKER):
        break
      elif t.type not in skip and t.string not in ("(", ")"):
        return ""
    doc = ast.literal_eval(" ".join(parts)) if parts else ""
  except (tokenize.TokenError, SyntaxError, ValueError):
    return ""
  return inspect.cleandoc(doc) if isinstance(doc, str) else ""


def _docstring_paragraphs(text: str) -> list[str]:
  """Prose paragraphs (200-900 characters) of a module's docstring."""
  doc = _module_docstring(text)
  paras = [" ".join(p.split()) for p in doc.split("\n\n")]
  return [p for p in paras if 200 <= len(p) <= 900 and p.count(">>>") == 0]


def _flat(text: str) -> str:
  """Text with every run of whitespace one space: code compared across indentation."""
  return " ".join(text.split())


def sources(max_files: int = 0) -> tuple[list[tuple[str, str]], list[tuple[str, str]]]:
  """(functions, docstring paragraphs) of the stdlib's training split as
  (group, text), group "file:<path>": only those whose text (and a
  function's def line, the start of what "complete" shows) occurs once, so
  a held-out file's prompts are nowhere else."""
  files, _ = corpus.list_files()
  files = files[:max_files] if max_files else files
  root = corpus.stdlib_root()
  found: dict[str, list[tuple[str, str, str]]] = {}  # flat text -> (kind, group, text)
  def_line = lambda code: _flat(code.split("\n", 1)[0])
  defs: collections.Counter = collections.Counter()
  for path, text in corpus.readable(files):
    group = f"file:{path.relative_to(root).as_posix()}"
    funcs = [c for _, c in corpus.function_blocks(text) if 120 <= len(c) <= 1400]
    defs.update(def_line(c) for c in funcs)
    for kind, t in [("func", c) for c in funcs] + [("para", p) for p in _docstring_paragraphs(text)]:
      found.setdefault(_flat(t), []).append((kind, group, t))
  once = [v[0] for v in found.values() if len(v) == 1
          and (v[0][0] == "para" or defs[def_line(v[0][2])] == 1)]
  return ([(g, t) for k, g, t in once if k == "func"],
          [(g, t) for k, g, t in once if k == "para"])


def dedup(records: list[dict]) -> list[dict]:
  """The records without a repeat of an earlier one's messages."""
  seen, out = set(), []
  for r in records:
    key = json.dumps(r["messages"], sort_keys=True)
    if key not in seen:
      seen.add(key)
      out.append(r)
  return out


def split(records: list[dict], heldout_every: int, seed: int) -> list[dict]:
  """Each record with "heldout" set by its "group", a whole group on one side.
  Per family (the group's prefix: file, instruct, math) the groups, in the
  order of a seeded hash, are held out until the family has
  ceil(n / heldout_every) held-out records, keeping at least one group for
  training. Pure: the same records give the same split."""
  fams: dict[str, dict[str, int]] = {}
  for r in records:
    g = fams.setdefault(r["group"].split(":", 1)[0], {})
    g[r["group"]] = g.get(r["group"], 0) + 1
  held: set[str] = set()
  for groups in fams.values():
    quota, n_held = math.ceil(sum(groups.values()) / heldout_every), 0
    order = sorted(groups, key=lambda g: hashlib.sha1(f"{seed}:{g}".encode()).hexdigest())
    for g in order[:-1]:
      if n_held >= quota:
        break
      held.add(g)
      n_held += groups[g]
  return [{**r, "heldout": r["group"] in held} for r in records]


def heldout_files(mix: list[dict]) -> set[str]:
  """The stdlib files (paths under its root) of the mix's held-out prompts:
  `stdlib_documents` leaves them out."""
  return {r["group"].split(":", 1)[1] for r in mix
          if r["heldout"] and r["group"].startswith("file:")}


def prompt_mix(counts: dict[str, int], seed: int, heldout_every: int,
               max_files: int = 0) -> list[dict[str, Any]]:
  """The prompt mix (module docstring): counts per kind (code, prose,
  instruct, math, edit); each record {"messages", "kind", "group",
  "heldout"}. Seeded, built from the stdlib's training split only, never
  from the task suites; deduplicated, then `split`."""
  rng = random.Random(seed)
  funcs, paras = sources(max_files)
  rng.shuffle(funcs)
  rng.shuffle(paras)
  out: list[dict[str, Any]] = []
  asks = list(CODE_ASKS)
  for i, (group, code) in enumerate(funcs[:counts.get("code", 0)]):
    ask = asks[i % len(asks)]
    out.append({"kind": f"code_{ask}", "group": group, "messages": [{"role": "user", "content":
                CODE_ASKS[ask].format(code=code.rstrip(), head=_function_head(code))}]})
  for i, (group, p) in enumerate(paras[:counts.get("prose", 0)]):
    out.append({"kind": "prose", "group": group, "messages": [
        {"role": "user", "content": PROSE_ASKS[i % len(PROSE_ASKS)].format(p=p)}]})
  pairs = [(k, t) for k in range(len(INSTRUCTIONS)) for t in TOPICS]
  rng.shuffle(pairs)  # distinct (template, topic) pairs, then again if more are asked
  for i in range(counts.get("instruct", 0)):
    k, t = pairs[i % len(pairs)]
    u = rng.choice([x for x in TOPICS if x != t])
    out.append({"kind": "instruct", "group": f"instruct:{k}:{t}", "messages": [
        {"role": "user", "content": INSTRUCTIONS[k].format(t=t, u=u)}]})
  for r in mathgen.training_problems(counts.get("math", 0), seed=seed + 1000):
    out.append({"kind": "math", "group": f"math:{r['template']}", "messages": r["messages"]})
  rng.shuffle(out)
  # Edits last, from the functions after the code kind's, with their own seed.
  out += edit_prompts(funcs[counts.get("code", 0):], counts.get("edit", 0), seed + 2000)
  return split(dedup(out), heldout_every, seed)


# ---------------------------------------------------------------- the target's replies


def _chunks(items: list, n: int):
  for i in range(0, len(items), n):
    yield i // n, items[i:i + n]


def generate_replies(target: steps.Runner, tok, convs: list[dict], n_new: int, batch: int,
                     gen_dir: Path, tag: str, log: Callable[[str], None] = print
                     ) -> list[list[int]]:
  """The target's greedy reply (up to EOS or n_new tokens) to each
  conversation, in batches of similar prompt length; batch i is written to
  gen_dir/<tag>-<i>.json and read back on a resumed run. Returns the replies
  in `convs` order (token ids, EOS included when reached)."""
  gen_dir.mkdir(parents=True, exist_ok=True)
  ids = [tok.encode_chat(c["messages"]) for c in convs]
  order = sorted(range(len(ids)), key=lambda i: len(ids[i]))
  replies: list[list[int] | None] = [None] * len(ids)
  n_batches = (len(order) + batch - 1) // batch
  for b, idx in _chunks(order, batch):
    path = gen_dir / f"{tag}-{b:04d}.json"
    if path.is_file():
      got = wd.read_json(path)
    else:
      res = generation.generate(target, [ids[i] for i in idx], n_new, eos_id=tok.eos_id)
      got = [r[:n_new] for r in res.tokens]
      wd.write_json(path, got)
      log(f"replies {tag}: batch {b + 1}/{n_batches} ({len(idx)} prompts, "
          f"{sum(map(len, got))} tokens, {res.eval_s:.1f} s)")
    for i, r in zip(idx, got):
      replies[i] = [int(t) for t in r]
  return replies  # type: ignore[return-value]


def with_followups(convs: list[dict], replies: list[list[int]], tok, n: int, seed: int
                   ) -> list[dict]:
  """Second-turn conversations: the first n (conversation, reply) pairs with
  the reply as the assistant's turn and a follow-up question."""
  rng = random.Random(seed)
  out = []
  for c, r in list(zip(convs, replies))[:n]:
    text = tok.decode([t for t in r if t != tok.eos_id]).strip()
    if not text:
      continue
    out.append({"kind": "followup", "heldout": c.get("heldout", False), "messages": [
        *c["messages"], {"role": "assistant", "content": text},
        {"role": "user", "content": rng.choice(FOLLOWUPS)}]})
  return out


# ---------------------------------------------------------------- features and soft labels


@functools.partial(jax.jit, static_argnames=("cfg", "k"))
def _labels(params, hidden, *, cfg: ModelConfig, k: int):
  """hidden [B, T, E] -> (top-k ids [B, T, k] int32, their probabilities f16)."""
  p = jax.nn.softmax(model_lib.head_logits(params, hidden, cfg), -1)
  top_p, top_i = jax.lax.top_k(p, k)
  return top_i.astype(jnp.int32), top_p.astype(jnp.float16)


def features(target: steps.Runner, seqs: list[list[int]], k: int, batch: int,
             log: Callable[[str], None] = print) -> dict[str, np.ndarray]:
  """One target pass per sequence: per position the feature (f16) and the
  top-k soft label; the sequences concatenated in the given order."""
  cfg = target.cfg
  feats = [None] * len(seqs)
  order = sorted(range(len(seqs)), key=lambda i: len(seqs[i]))
  for b, idx in _chunks(order, batch):
    rows = [seqs[i] for i in idx]
    cache = target.new_cache(len(rows), steps.prefill_bucket(max(map(len, rows))))
    _, _, hidden = target.prefill(rows, cache, return_hidden=True)
    top_i, top_p = _labels(target.params, hidden, cfg=cfg, k=k)
    hidden, top_i, top_p = (np.asarray(x) for x in (hidden.astype(jnp.float16), top_i, top_p))
    for j, i in enumerate(idx):
      n = len(seqs[i])
      feats[i] = (hidden[j, :n], top_i[j, :n], top_p[j, :n])
    if b % 10 == 0:
      log(f"features: {min(len(order), (b + 1) * batch)}/{len(order)} sequences")
  return {"tokens": np.concatenate([np.asarray(s, np.int32) for s in seqs]),
          "feats": np.concatenate([f[0] for f in feats]),
          "top_i": np.concatenate([f[1] for f in feats]),
          "top_p": np.concatenate([f[2] for f in feats]),
          "starts": np.cumsum([0] + [len(s) for s in seqs[:-1]]).astype(np.int64)}


def stdlib_documents(tok, n_tokens: int, length: int, max_files: int = 0,
                     exclude: set[str] | frozenset[str] = frozenset()) -> list[list[int]]:
  """Raw stdlib training-split documents in the target's tokens, cut into
  pieces of `length`, up to n_tokens in all (the corpus part of the data);
  the files in `exclude` (paths under the stdlib root: `heldout_files`) left out."""
  files, _ = corpus.list_files()
  if max_files:
    files = files[:max_files]
  root = corpus.stdlib_root()
  files = [f for f in files if f.relative_to(root).as_posix() not in exclude]
  out, total = [], 0
  for _, text in corpus.readable(files):
    ids = tok.encode(text)
    for s in range(0, max(1, len(ids) - 16), length):
      piece = ids[s:s + length]
      out.append(piece)
      total += len(piece)
      if total >= n_tokens:
        return out
  return out
