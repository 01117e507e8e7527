"""The long-context suite (bench/sweep/longsuite.py) is in no training mix:

- by file: none of its modules is a file of the stdlib's training split,
  which the stdlib pair, the self-distillation prompts and its documents
  read (`stdlib_tokens`);
- by text: no conversation shares a run of 8 tokens with a training prompt
  or document of the shipped mix (configs/train.py:smollm2), apart from runs
  of Python syntax alone, checked as tests/train/test_leaks.py checks the
  other suites; nor is an instruction line a training one with a word changed;
- the shipped files are what experiments/make_long_prompts.py builds from
  this Python's stdlib (skipped, naming both, under another Python).

Deliberate bug, found by both checks: a document drawn from a module the
training documents read.
"""

import pytest

import test_leaks
from configs import train as train_configs
from specjax.bench.sweep import longsuite, taskbench
from specjax.errors import ConfigError, SpecjaxError
from specjax.train import corpus, replies


@pytest.fixture(scope="module")
def data():
  """The shipped mix, its training documents' and prompts' runs, a tokenizer."""
  c = train_configs.get_config("smollm2")
  mix = replies.prompt_mix(dict(c.mix), int(c.seed), int(c.heldout_every), int(c.max_files))
  try:
    tok, kind = longsuite.tokenizer(), "smollm2"
  except SpecjaxError:
    tok, kind = test_leaks.WordTokenizer(), "words"
  docs = replies.stdlib_documents(tok, int(c.stdlib_tokens), int(c.doc_len), int(c.max_files),
                                  exclude=replies.heldout_files(mix))
  grams = test_leaks.index(tok, test_leaks.train_texts(mix)
                           + [("stdlib document", d) for d in docs])
  return mix, docs, tok, kind, grams


def long_suite():
  return {"long": {c: taskbench.load_category(c, longsuite.DIR) for c in longsuite.CATEGORIES}}


def training_files() -> list[str]:
  root = corpus.stdlib_root()
  return [p.relative_to(root).as_posix() for p in corpus.list_files()[0]]


def test_the_long_suite_shares_no_run_with_the_training_data(data):
  mix, docs, tok, kind, grams = data
  longsuite.check_modules(longsuite.MODULES, training_files())
  assert not test_leaks.shared_runs(tok, grams, long_suite()), kind
  first = lambda text: text.strip().split("\n")[0]
  lines = {first(m["content"]) for recs in long_suite()["long"].values() for r in recs
           for m in r["messages"]}
  assert not test_leaks.near_lines(lines, {first(t) for _, t in test_leaks.train_texts(mix)})
  # Deliberate bug, found by both checks: a document from a module the
  # training documents read (the first such file with a page long enough),
  # built without the filter (as a suite written by hand would be).
  root = corpus.stdlib_root()
  read = {tuple(d) for d in docs}
  for rel in training_files()[:40]:
    ids = tok.encode((root / rel).read_text(encoding="utf-8"))
    if tuple(ids[:len(docs[0])]) in read:
      try:
        got, _ = longsuite.build(longsuite.read_sources(root, (rel,)), tok, set(), "t",
                                 contexts=(1024,), docs=1)
        break
      except ConfigError:
        continue  # too short a page for a document
  else:
    pytest.fail("no training file makes a document")
  assert test_leaks.shared_runs(tok, grams, {"bug": got}), rel
  with pytest.raises(ConfigError, match="are training files"):
    longsuite.check_modules(longsuite.MODULES + (rel,), training_files())


def test_the_shipped_files_are_the_build(data):
  mix, docs, tok, kind, _ = data
  if kind != "smollm2":
    pytest.skip("the suite's token counts are SmolLM2's; its tokenizer is not installed")
  manifest = longsuite.read_manifest()
  sources = longsuite.read_sources(corpus.stdlib_root())
  try:
    longsuite.check_python(manifest, sources)
  except ConfigError as e:
    pytest.skip(str(e))
  texts = [t for _, t in test_leaks.train_texts(mix)]
  banned = longsuite.runs([tok.encode(t) for t in texts] + docs)
  records, built = longsuite.build(sources, tok, banned, manifest["tokenizer"])
  assert built == manifest
  assert records == long_suite()["long"]
