"""The selfdistill data leaks into nothing it is judged on (issue 38, part 7),
checked on the shipped mix (configs/train.py:smollm2, train/replies.py):

- the split: no held-out prompt is a training prompt, by text or by group
  ((template, topic), skeleton, source file), at about the same held-out
  share as before (1/heldout_every);
- the task suites (the development suite and the evaluation suite): no
  conversation shares a run of RUN tokens with a training prompt or a
  training stdlib document (message contents, so the chat template is not
  compared), apart from runs of Python syntax alone (keywords, builtins,
  self/cls, dunders, one-letter names: `def __init__(self):` is the
  language, not a leak); and no suite instruction line is a training one
  with one word changed;
- the held-out code and prose prompts' sources are in no training document
  or prompt.

Tokens: SmolLM2's tokenizer, read from its packaged GGUF (about 3 s); without
the package, words and punctuation marks (`WordTokenizer`). Each check runs
on deliberate bugs too (the first split, the first templates, documents
from held-out files) and must find them.
"""

import builtins
import json
import keyword
import re

import pytest

from configs import train as train_configs
from specjax.bench.sweep import taskbench
from specjax.train import corpus, replies

RUN = 8
SYNTAX = set(keyword.kwlist) | set(dir(builtins)) | {"self", "cls"}


class WordTokenizer:
  """Words and punctuation marks as tokens (the fallback; ids made up as met)."""

  def __init__(self):
    self.ids: dict[str, int] = {}
    self.words: list[str] = []

  def encode(self, text: str) -> list[int]:
    out = []
    for w in words(text):
      if w not in self.ids:
        self.ids[w] = len(self.words)
        self.words.append(w)
      out.append(self.ids[w])
    return out

  def decode(self, ids) -> str:
    return " ".join(self.words[i] for i in ids)


def words(text: str) -> list[str]:
  return re.findall(r"\w+|[^\w\s]", text)


def _tokenizer():
  try:
    import gguf  # pylint: disable=import-outside-toplevel
    from specjax.formats import checkpoint, gguf_tokenizer  # pylint: disable=import-outside-toplevel
    path = checkpoint.packaged_path("smollm2-135m")
    return gguf_tokenizer.gguf_tokenizer(gguf.GGUFReader(str(path)), str(path)), "smollm2"
  except Exception:  # pylint: disable=broad-except
    return WordTokenizer(), "words"


@pytest.fixture(scope="module")
def data():
  """The shipped mix, its training documents (held-out files left out) and a tokenizer."""
  c = train_configs.get_config("smollm2")
  mix = replies.prompt_mix(dict(c.mix), int(c.seed), int(c.heldout_every), int(c.max_files))
  tok, kind = _tokenizer()
  docs = replies.stdlib_documents(tok, int(c.stdlib_tokens), int(c.doc_len), int(c.max_files),
                                  exclude=replies.heldout_files(mix))
  return c, mix, docs, tok, kind


# ---------------------------------------------------------------- the split


def split_leaks(mix: list[dict]) -> list[str]:
  """What a held-out record shares with the training side: its text, its group."""
  train = [r for r in mix if not r["heldout"]]
  texts = {json.dumps(r["messages"]) for r in train}
  groups = {r["group"] for r in train}
  return [f"{r['kind']}: {'text' if json.dumps(r['messages']) in texts else 'group'} "
          f"{r['group']}" for r in mix if r["heldout"] and (
              json.dumps(r["messages"]) in texts or r["group"] in groups)]


def test_the_split_keeps_held_out_apart_at_the_same_share(data):
  c, mix, _, _, _ = data
  assert not split_leaks(mix)
  assert len({json.dumps(r["messages"]) for r in mix}) == len(mix)  # deduplicated
  held = [r for r in mix if r["heldout"]]
  assert 0.04 <= len(held) / len(mix) <= 0.07, len(held)  # 1/20 before
  assert {r["group"].split(":")[0] for r in held} == {"file", "instruct", "math"}
  assert len(held) >= int(c.alpha_prompts)  # the acceptance measurement's prompts
  assert replies.split(mix, int(c.heldout_every), int(c.seed)) == mix  # a pure function
  # Deliberate bugs, each found: the first split (every 20th record, with
  # the instructions drawn with replacement), and no deduplication.
  by_index = [{**r, "heldout": i % int(c.heldout_every) == 0} for i, r in enumerate(mix)]
  assert any("group" in x for x in split_leaks(by_index))
  trained = next(r for r in mix if not r["heldout"])
  again = mix + [dict(trained, group="file:elsewhere.py", heldout=True)]
  assert any(": text " in x for x in split_leaks(again))


def test_the_split_is_by_group_with_a_quota_per_family():
  recs = ([{"group": f"file:{i % 7}", "messages": [i]} for i in range(40)]
          + [{"group": "math:0", "messages": [i]} for i in range(3)])
  got = replies.split(recs, 10, 0)
  held = {r["group"] for r in got if r["heldout"]}
  assert all(r["heldout"] == (r["group"] in held) for r in got)
  assert 4 <= sum(r["heldout"] for r in got if r["group"] != "math:0") <= 9  # ceil(40/10)
  assert not any(r["heldout"] for r in got if r["group"] == "math:0")  # its only group trains
  held_by_seed = {tuple(r["heldout"] for r in replies.split(recs, 10, seed)) for seed in range(6)}
  assert len(held_by_seed) > 1  # seeded


# ---------------------------------------------------------------- the suites


def suites() -> dict[str, dict[str, list[dict]]]:
  return {name: taskbench.load_suite(d) for name, d in taskbench.SUITES.items()}


def syntax_only(text: str) -> bool:
  """A run of Python syntax alone (module docstring): no word of content."""
  return all(w in SYNTAX or re.fullmatch(r"__\w+__|[A-Za-z]", w)
             for w in re.findall(r"[A-Za-z_]\w*", text))


def index(tok, texts) -> dict[tuple, str]:
  """Every RUN-token run of the token lists or texts -> where it comes from."""
  out: dict[tuple, str] = {}
  for where, ids in texts:
    ids = tok.encode(ids) if isinstance(ids, str) else ids
    for i in range(len(ids) - RUN + 1):
      out.setdefault(tuple(ids[i:i + RUN]), where)
  return out


def shared_runs(tok, grams: dict, the_suites) -> list[str]:
  """Each (suite conversation, training source) pair sharing a run that is
  not syntax alone, with the run."""
  found = {}
  for name, suite in the_suites.items():
    for cat, recs in suite.items():
      for j, r in enumerate(recs):
        for m in r["messages"]:
          ids = tok.encode(m["content"])
          for i in range(len(ids) - RUN + 1):
            where = grams.get(tuple(ids[i:i + RUN]))
            run = tok.decode(ids[i:i + RUN])
            if where and not syntax_only(run):
              found.setdefault((name, cat, j, where), run)
  return [f"{n} {c}#{j} <- {w}: {run!r}" for (n, c, j, w), run in found.items()]


def train_texts(mix):
  """(source, text) of every training user turn: the mix's and the follow-ups'."""
  return ([(f"{r['kind']} prompt", m["content"]) for r in mix if not r["heldout"]
           for m in r["messages"]] + [("followup", f) for f in replies.FOLLOWUPS])


def test_no_suite_shares_a_run_with_the_training_data(data):
  _, mix, docs, tok, kind = data
  grams = index(tok, train_texts(mix) + [("stdlib document", d) for d in docs])
  the_suites = suites()
  assert set(the_suites) == {"dev", "eval"}
  assert not shared_runs(tok, grams, the_suites), kind
  # Deliberate bugs, each found: the first wordings of an instruction, an
  # edit's closing phrase, a math skeleton.
  old = [("instruct", "Explain recursion to a ten-year-old."),
         ("edit", "Add type hints to this function. Reply with the edited code only.\n\n"
                  "def f(x):\n    return x\n"),
         ("math", "A baker makes 7 trays of rolls with 9 rolls on each tray and sells 3 rolls. "
                  "How many rolls are left? Think step by step, then give the final answer "
                  "as a number.")]
  got = shared_runs(tok, index(tok, old), the_suites)
  assert {x.split(" <- ")[1].split(":")[0] for x in got} == {"instruct", "edit", "math"}, got
  assert not syntax_only("Explain recursion to a") and syntax_only("    def __init__(self):")


def near_lines(suite_lines: set[str], train_lines: set[str]) -> list[str]:
  """Suite lines equal to a training line up to one word substituted."""
  by_len: dict[int, list[list[str]]] = {}
  for t in train_lines:
    by_len.setdefault(len(t.split()), []).append(t.split())
  out = []
  for s in suite_lines:
    w = s.split()
    for t in by_len.get(len(w), []):
      if len(w) >= 4 and sum(a != b for a, b in zip(w, t)) <= 1:
        out.append(f"{s!r} ~ {' '.join(t)!r}")
  return out


def test_no_suite_instruction_is_a_training_one_with_a_word_changed(data):
  _, mix, _, _, _ = data
  first = lambda text: text.strip().split("\n")[0]
  suite_lines = {first(m["content"]) for s in suites().values() for recs in s.values()
                 for r in recs for m in r["messages"]}
  train_lines = {first(t) for _, t in train_texts(mix)}
  assert not near_lines(suite_lines, train_lines)
  # the first summarisation wording: "passage" for "text"
  assert near_lines(suite_lines, {"Summarize the following text in two sentences."})


# ---------------------------------------------------------------- held-out sources


def source_part(r: dict) -> str:
  """A held-out file-group prompt's copy of its source: the fenced code, a
  bare edit's code (before the request), or a prose prompt's paragraph."""
  text = r["messages"][0]["content"]
  fenced = re.search(r"```python\n(.*?)\n```", text, re.S)
  if fenced:
    return fenced.group(1)
  if r["kind"] == "edit":
    return text.rsplit("\n\n", 1)[0]
  return max(text.split("\n\n"), key=len)


def in_documents(mix, doc_words: str) -> list[str]:
  """The held-out file-group prompts whose source is in the documents' text (words)."""
  return [r["group"] for r in mix if r["heldout"] and r["group"].startswith("file:")
          and " ".join(words(source_part(r))) in doc_words]


def test_held_out_code_and_prose_are_in_no_training_document(data):
  c, mix, docs, tok, _ = data
  held = [r for r in mix if r["heldout"] and r["group"].startswith("file:")]
  assert len(held) > 40 and {r["kind"] for r in held} >= {"edit", "prose", "code_complete"}
  doc_words = " ".join(words(tok.decode([t for d in docs for t in d])))
  assert not in_documents(mix, doc_words)
  prompt_words = " | ".join(" ".join(words(t)) for _, t in train_texts(mix))
  assert not in_documents(mix, prompt_words)  # nor in a training prompt (a shared head)
  # Deliberate bug, found: documents read from the held-out files.
  files, _ = corpus.list_files()
  root = corpus.stdlib_root()
  others = {f.relative_to(root).as_posix() for f in files} - replies.heldout_files(mix)
  leaked = replies.stdlib_documents(tok, 40_000, int(c.doc_len), exclude=others)
  got = in_documents(mix, " ".join(words(tok.decode([t for d in leaked for t in d]))))
  assert len(got) >= 3, got
