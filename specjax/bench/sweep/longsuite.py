"""The long-context suite: summarisation and question answering over
reference pages of stdlib modules, 1 K-8 K tokens (issue 39, part 4).

Documents are stdlib_reference pages of MODULES, files no training mix reads
(corpus.list_files' held-out split and the directories it leaves out),
filled block by block up to a context: a prompt at context C has at most
C - RESERVE tokens in the target's chat template (RESERVE: the reply and the
drafts) and more than 0.8 C - RESERVE. Per context, DOCS documents, each
asked once for a summary and once a question whose answer quotes it (an
entry's exact signature, or a docstring's first sentence). A block sharing a
run of RUN tokens with the training data (`banned`) is left out. Built by
experiments/make_long_prompts.py into specjax/assets/taskbench_long/, with
manifest.json naming the Python and each source file's SHA-256: a rebuild
under another Python is refused, naming both (`check_python`).
docs/taskbench.md, "The long-context suite".
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import random
import sys
from pathlib import Path
from typing import Iterable

from specjax.bench.sweep import stdlib_reference as ref
from specjax.errors import ConfigError

DIR = Path(__file__).resolve().parents[2] / "assets" / "taskbench_long"
MANIFEST = "manifest.json"
CATEGORIES = ("summarization", "qa")
CONTEXTS = (1024, 2048, 4096, 8192)  # SmolLM2-135M-Instruct's context is 8 K
RESERVE = 256  # slots a prompt leaves free: n_predict + gamma + 1 must fit in them
DOCS = 3       # documents per context
SEED = 39
RUN = 8        # the leak tests' run length (tests/train/test_leaks.py)
TOKENIZER = "smollm2-135m"  # the preset whose packaged GGUF tokenizer counts the tokens
# Modules with a page of >= 300 tokens and >= 3 documented entries, in no
# training split (checked by `check_modules` and tests/train/test_long_leaks.py).
MODULES = (
    "asyncio/timeouts.py", "bdb.py", "email/policy.py", "locale.py", "selectors.py",
    "textwrap.py", "unittest/case.py", "idlelib/autocomplete.py", "idlelib/browser.py",
    "idlelib/calltip.py", "idlelib/calltip_w.py", "idlelib/codecontext.py",
    "idlelib/colorizer.py", "idlelib/config.py", "idlelib/config_key.py",
    "idlelib/configdialog.py", "idlelib/debugger.py", "idlelib/editor.py", "idlelib/format.py",
    "idlelib/grep.py", "idlelib/help.py", "idlelib/help_about.py", "idlelib/history.py",
    "idlelib/hyperparser.py", "idlelib/macosx.py", "idlelib/outwin.py", "idlelib/parenmatch.py",
    "idlelib/pyparse.py", "idlelib/pyshell.py", "idlelib/query.py", "idlelib/redirector.py",
    "idlelib/replace.py", "idlelib/rpc.py", "idlelib/run.py", "idlelib/search.py",
    "idlelib/searchbase.py", "idlelib/searchengine.py", "idlelib/sidebar.py",
    "idlelib/squeezer.py", "idlelib/textview.py", "idlelib/tooltip.py", "idlelib/tree.py",
    "lib2to3/fixer_base.py", "lib2to3/fixer_util.py", "lib2to3/main.py", "lib2to3/pgen2/conv.py",
    "lib2to3/pgen2/driver.py", "lib2to3/pgen2/grammar.py", "lib2to3/pgen2/parse.py",
    "lib2to3/pgen2/tokenize.py", "lib2to3/pytree.py", "lib2to3/refactor.py")

OPENING = "Read this reference of Python modules, then answer the {what} after it."
SUMMARY = ("Request: Summarise the reference above in four to six sentences. Name its main "
           "classes and functions as they are written there, and quote the one sentence that "
           "best says what it is for.")
ASK_SIGNATURE = ("Question: Which entry of the reference above is described as \"{s}\"? Answer "
                 "with its exact signature, as the reference writes it.")
ASK_SENTENCE = "Question: Quote, word for word, the first sentence of the documentation of {n}."


def bounds(context: int) -> tuple[int, int]:
  """(low, high]: the prompt lengths a document at `context` may have."""
  return int(0.8 * context) - RESERVE, context - RESERVE


# ---------------------------------------------------------------- the sources


def python_version() -> str:
  return f"{sys.implementation.name} {sys.version.split()[0]}"


def read_sources(root: Path, modules: Iterable[str] = MODULES) -> dict[str, str]:
  """rel path -> source text of each module; a missing one is refused."""
  out = {}
  for rel in modules:
    path = Path(root) / rel
    if not path.is_file():
      raise ConfigError(f"{rel} is not in {root} ({python_version()}): the long suite's modules "
                        f"are those of the Python in {MANIFEST}")
    out[rel] = path.read_text(encoding="utf-8")
  return out


def fingerprint(sources: dict[str, str]) -> dict[str, str]:
  return {rel: hashlib.sha256(text.encode()).hexdigest() for rel, text in sources.items()}


def check_python(manifest: dict, sources: dict[str, str]) -> None:
  """The sources are the files the manifest was built from; else one line
  naming both Pythons and the first file that differs."""
  got = fingerprint(sources)
  for rel, sha in manifest["modules"].items():
    if got.get(rel) != sha:
      raise ConfigError(f"the long suite was built from {manifest['python']}'s stdlib and "
                        f"{rel} differs in this one ({python_version()}); run it under that "
                        f"Python, or rebuild with --other_python to record this one")


def check_modules(modules: Iterable[str], training: Iterable[str]) -> None:
  """No module is a file a training mix reads (paths under the stdlib root)."""
  both = sorted(set(modules) & set(training))
  if both:
    raise ConfigError(f"the long suite's modules {both[:3]} are training files")


def tokenizer():
  """SmolLM2's tokenizer, read from its packaged GGUF (no weights loaded)."""
  import gguf  # pylint: disable=import-outside-toplevel
  from specjax.formats import checkpoint, gguf_tokenizer  # pylint: disable=import-outside-toplevel
  path = checkpoint.packaged_path(TOKENIZER)
  return gguf_tokenizer.gguf_tokenizer(gguf.GGUFReader(str(path)), str(path))


def runs(id_lists: Iterable[list[int]]) -> set:
  """Every run of RUN tokens in the lists."""
  return {tuple(ids[i:i + RUN]) for ids in id_lists for i in range(len(ids) - RUN + 1)}


# ---------------------------------------------------------------- documents


def has_run(ids: list[int], banned: set) -> bool:
  return any(tuple(ids[i:i + RUN]) in banned for i in range(len(ids) - RUN + 1))


def pages(sources: dict[str, str], tok, banned: set) -> tuple[dict, list[str]]:
  """rel -> [(block, its token count)], none sharing a banned run: a block
  that does keeps its signature line alone (or is left out if that does);
  and the names of the blocks whose docstrings were left out."""
  out, dropped = {}, []
  for rel, source in sources.items():
    kept = []
    for b in ref.page(rel, source):
      ids = tok.encode(b.text)
      if has_run(ids, banned):
        dropped.append(f"{ref.module_name(rel)}:{b.name}")
        b = dataclasses.replace(b, doc="")
        ids = tok.encode(b.text)
      if not has_run(ids, banned):
        kept.append((b, len(ids)))
    out[rel] = kept
  return out, dropped


def messages(doc: str, ask: str) -> list[dict]:
  what = "request" if ask.startswith("Request") else "question"
  return [{"role": "user", "content": f"{OPENING.format(what=what)}\n\n{doc}\n\n{ask}"}]


def fill(the_pages: dict, order: list[str], budget: int) -> list[tuple[str, ref.Block]]:
  """Blocks in page order, modules in `order`, while their token counts
  (plus 2 per join) fit `budget`; a block too long is skipped."""
  out, used = [], 0
  for rel in order:
    for b, n in the_pages[rel]:
      if used + n + 2 <= budget:
        out.append((rel, b))
        used += n + 2
  return out


def question(blocks: list[tuple[str, ref.Block]], rng: random.Random, k: int
             ) -> tuple[str, str, ref.Block]:
  """(question, answer, the entry asked about): an entry with a first sentence
  of >= 5 words whose name and sentence occur once in the document; k even
  asks its signature, odd its first sentence."""
  names = [b.name for _, b in blocks]
  firsts = [b.first_sentence for _, b in blocks]
  ok = [b for _, b in blocks if not b.signature.startswith("Module ")
        and len(b.first_sentence.split()) >= 5 and names.count(b.name) == 1
        and firsts.count(b.first_sentence) == 1]
  if not ok:
    raise ConfigError("a long-suite document has no entry to ask about")
  b = rng.choice(ok)
  if k % 2 == 0:
    return ASK_SIGNATURE.format(s=b.first_sentence), b.signature, b
  return ASK_SENTENCE.format(n=b.name), b.first_sentence, b


def document(the_pages: dict, tok, context: int, rng: random.Random, k: int) -> list[dict]:
  """The summary record and the question record of one document at `context`."""
  low, high = bounds(context)
  order = sorted(the_pages)
  rng.shuffle(order)
  overhead = len(tok.encode_chat(messages("", ASK_SIGNATURE.format(s="x" * 200))))
  blocks = fill(the_pages, order, high - overhead)
  pick = rng.random()  # the entry asked about: the same draw while the document is trimmed
  while True:
    doc = ref.text([b for _, b in blocks])
    ask, answer, needle = question(blocks, random.Random(pick), k)
    recs = [{"messages": messages(doc, SUMMARY)}, {"messages": messages(doc, ask),
                                                    "answer": answer}]
    lens = [len(tok.encode_chat(r["messages"])) for r in recs]
    if max(lens) <= high:
      break
    blocks = blocks[:-1]
  if min(lens) <= low:
    raise ConfigError(f"a long-suite document at context {context} has {min(lens)} tokens, "
                      f"not more than {low}")
  mods = sorted({rel for rel, _ in blocks})
  at = doc.index(needle.text) / len(doc)
  return [dict(r, context=context, context_tokens=n, modules=mods, **extra)
          for r, n, extra in zip(recs, lens, ({}, {"needle": needle.name,
                                                   "needle_at": round(at, 3)}))]


def build(sources: dict[str, str], tok, banned: set, tokenizer: str, seed: int = SEED,
          contexts: tuple[int, ...] = CONTEXTS, docs: int = DOCS) -> tuple[dict, dict]:
  """({category: records}, manifest): DOCS documents per context (module
  docstring); the same sources, tokenizer, banned runs and seed give the
  same suite."""
  the_pages, dropped = pages(sources, tok, banned)
  out: dict[str, list] = {c: [] for c in CATEGORIES}
  for context in contexts:
    for k in range(docs):
      summary, qa = document(the_pages, tok, context, random.Random(f"{seed}:{context}:{k}"), k)
      out["summarization"].append(summary)
      out["qa"].append(qa)
  manifest = {"python": python_version(), "seed": seed, "contexts": list(contexts),
              "docs": docs, "reserve": RESERVE, "run": RUN, "tokenizer": tokenizer,
              "modules": fingerprint(sources), "docstrings_left_out": dropped,
              "prompts": {c: len(r) for c, r in out.items()}}
  return out, manifest


def write(records: dict, manifest: dict, directory: Path = DIR) -> None:
  directory = Path(directory)
  directory.mkdir(parents=True, exist_ok=True)
  for cat, recs in records.items():
    (directory / f"{cat}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs))
  (directory / MANIFEST).write_text(json.dumps(manifest, indent=1) + "\n")


def read_manifest(directory: Path = DIR) -> dict:
  path = Path(directory) / MANIFEST
  if not path.is_file():
    raise ConfigError(f"{path} is missing (experiments/make_long_prompts.py builds it)")
  return json.loads(path.read_text())
