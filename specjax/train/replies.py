"""The data of specjax/train/selfdistill.py: the prompt mix written here,
the target's replies to it (resumable batches), second-turn follow-ups, raw
stdlib documents, and one target pass per sequence storing each position's
feature and top-K soft label (why: docs/training.md)."""

from __future__ import annotations

import functools
import json
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
INSTRUCTIONS = (
    "Explain {t} in simple terms.",
    "Write a short paragraph about {t}.",
    "Give three key facts about {t}.",
    "What are the main ideas behind {t}? Answer in a few sentences.",
    "Explain {t} to a ten-year-old.",
    "List the advantages and disadvantages of {t}.",
    "Write a short quiz question about {t}, with its answer.",
    "Compare {t} and {u} in a few sentences.",
    "Write a haiku about {t}.",
    "Why is {t} important? Give two reasons.")
CODE_ASKS = {
    "complete": "Complete this Python function:\n\n```python\n{head}\n```",
    "explain": "Explain what this Python function does:\n\n```python\n{code}\n```",
    "edit": ("Rewrite this Python function with clearer variable names and a short "
             "docstring:\n\n```python\n{code}\n```"),
    "test": "Write a unit test for this Python function:\n\n```python\n{code}\n```"}
PROSE_ASKS = (
    "Summarize the following text in two sentences.\n\n{p}",
    "Read the text and answer the question.\n\nText: {p}\n\nQuestion: What is the main "
    "purpose of what the text describes?",
    "Rewrite the following text in plain English.\n\n{p}",
    "List the key terms in this text and explain each briefly.\n\n{p}")
# Targeted edits that return the whole function (the kind "edit", added after
# the first mixes): what a code-editing request asks, in wordings of our own.
# {name} the function's name, {p} its first parameter (self / cls skipped);
# the asks that need {p} are skipped for a function without parameters.
EDIT_ASKS = (
    "Add type hints to this function.",
    "Rename the function to `{name}_v2`.",
    "Rename the parameter `{p}` to `{p}_arg` everywhere in the function.",
    "Add a check at the start that raises TypeError when `{p}` is None.",
    "Remove the docstring and all comments.",
    "Give the function a one-line docstring saying what it returns.",
    "Make `{p}` a keyword-only parameter.",
    "Log the call with `logging.debug` at the start of the function.")
EDIT_REPLY = ("Reply with the edited code only.", "Show only the new code.",
              "Return the whole edited function.")
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


def edit_prompts(funcs: list[str], n: int, seed: int) -> list[dict[str, Any]]:
  """n targeted-edit requests (EDIT_ASKS) over the functions funcs, in turn;
  a function that does not parse, or lacks the parameter an ask names, is
  passed over. The code comes bare or fenced, in turn."""
  rng = random.Random(seed)
  out: list[dict[str, Any]] = []
  for code in funcs:
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
    out.append({"kind": "edit", "messages": [
        {"role": "user", "content": f"{ask} {rng.choice(EDIT_REPLY)}\n\n{body}\n"}]})
  return out


def _docstring_paragraphs(text: str) -> list[str]:
  """Prose paragraphs (200-900 characters) of a module's docstring."""
  try:
    import ast  # pylint: disable=import-outside-toplevel
    doc = ast.get_docstring(ast.parse(text)) or ""
  except (SyntaxError, ValueError):
    return []
  paras = [" ".join(p.split()) for p in doc.split("\n\n")]
  return [p for p in paras if 200 <= len(p) <= 900 and p.count(">>>") == 0]


def prompt_mix(counts: dict[str, int], seed: int, heldout_every: int,
               max_files: int = 0) -> list[dict[str, Any]]:
  """The prompt mix (module docstring): counts per kind (code, prose,
  instruct, math, edit); each record {"messages", "kind", "heldout"}. Seeded,
  built from the stdlib's training split only, never from taskbench."""
  rng = random.Random(seed)
  files, _ = corpus.list_files()
  if max_files:
    files = files[:max_files]
  funcs, paras = [], []
  for _, text in corpus.readable(files):
    funcs += [c for _, c in corpus.function_blocks(text) if 120 <= len(c) <= 1400]
    paras += _docstring_paragraphs(text)
  rng.shuffle(funcs)
  rng.shuffle(paras)
  out: list[dict[str, Any]] = []
  asks = list(CODE_ASKS)
  for i, code in enumerate(funcs[:counts.get("code", 0)]):
    ask = asks[i % len(asks)]
    out.append({"kind": f"code_{ask}", "messages": [{"role": "user", "content": CODE_ASKS[
        ask].format(code=code.rstrip(), head=_function_head(code))}]})
  for i, p in enumerate(paras[:counts.get("prose", 0)]):
    out.append({"kind": "prose", "messages": [
        {"role": "user", "content": PROSE_ASKS[i % len(PROSE_ASKS)].format(p=p)}]})
  for i in range(counts.get("instruct", 0)):
    t, u = rng.sample(TOPICS, 2)
    out.append({"kind": "instruct", "messages": [
        {"role": "user", "content": INSTRUCTIONS[i % len(INSTRUCTIONS)].format(t=t, u=u)}]})
  suite = {json.dumps(r["messages"]) for r in mathgen.math_problems()}
  for r in mathgen.math_problems(counts.get("math", 0), seed=seed + 1000):
    if json.dumps(r["messages"]) not in suite:
      out.append({"kind": "math", "messages": r["messages"]})
  rng.shuffle(out)
  for i, r in enumerate(out):
    r["heldout"] = i % heldout_every == 0
  # Edits come last, from the functions after the code kind's, with their
  # own seed and split: a mix without them is the same mix as before.
  edits = edit_prompts(funcs[counts.get("code", 0):], counts.get("edit", 0), seed + 2000)
  for i, r in enumerate(edits):
    r["heldout"] = i % heldout_every == 0
  return out + edits


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


def stdlib_documents(tok, n_tokens: int, length: int, max_files: int = 0) -> list[list[int]]:
  """Raw stdlib training-split documents in the target's tokens, cut into
  pieces of `length`, up to n_tokens in all (the corpus part of the data)."""
  files, _ = corpus.list_files()
  if max_files:
    files = files[:max_files]
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
