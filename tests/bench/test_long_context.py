"""The long-context suite (bench/sweep/longsuite.py) and the contexts
dimension (bench/sweep/contexts.py): the shipped prompts sit in their
context's bounds with the lengths recorded, every answer quotes its
document, the manifest names this Python's files (a changed or missing file
is one line), a banned run never reaches a document, bad contexts are one
line, :long_context_quick runs end to end on the tiny pair (each context's
rows dropped before the next, every record with the process's memory), and a
context that would not fit is refused before any work."""

import json
import re

import pytest

from configs import sweep_gamma
from specjax.bench import memory
from specjax.bench.sweep import contexts, harness, longsuite, prompts, taskbench
from specjax.bench.sweep import stdlib_reference as ref
from specjax.bench.sweep.config import SweepConfig
from specjax.errors import ConfigError, SpecjaxError
from specjax.train import corpus


@pytest.fixture(scope="module")
def tok():
  try:
    return longsuite.tokenizer()
  except SpecjaxError as e:
    pytest.skip(f"SmolLM2's tokenizer: {e}")


@pytest.fixture(scope="module")
def suite():
  return {c: taskbench.load_category(c, longsuite.DIR) for c in longsuite.CATEGORIES}


def document(rec) -> str:
  return rec["messages"][0]["content"].split("\n\n", 1)[1].rsplit("\n\n", 1)[0]


def test_every_prompt_fills_its_context_and_records_its_length(suite, tok):
  for cat, recs in suite.items():
    assert sorted({r["context"] for r in recs}) == list(longsuite.CONTEXTS), cat
    assert len(recs) == len(longsuite.CONTEXTS) * longsuite.DOCS
    for r in recs:
      low, high = longsuite.bounds(r["context"])
      assert r["context_tokens"] == len(tok.encode_chat(r["messages"]))
      assert low < r["context_tokens"] <= high, (cat, r["context"], r["context_tokens"])
  # a document asked twice: once for a summary, once a question
  assert [document(r) for r in suite["summarization"]] == [document(r) for r in suite["qa"]]


def test_every_answer_quotes_its_document(suite):
  flat = lambda s: " ".join(s.split())
  for r in suite["qa"]:
    doc = document(r)
    assert flat(r["answer"]) in flat(doc), r["needle"]
    if "exact signature" in r["messages"][0]["content"].rsplit("\n\n", 1)[1]:
      assert re.search(rf"^{re.escape(r['answer'])}$", doc, re.M), r["answer"]
    assert r["modules"] and set(r["modules"]) <= set(longsuite.MODULES)


def test_the_manifest_names_this_python_and_refuses_another():
  manifest = longsuite.read_manifest()
  assert set(manifest["modules"]) == set(longsuite.MODULES)
  try:
    sources = longsuite.read_sources(corpus.stdlib_root())
    longsuite.check_python(manifest, sources)
  except ConfigError as e:
    pytest.skip(f"another Python: {e}")  # the refusal itself, as a user sees it
  # Deliberate bugs, each refused in one line naming both Pythons: a file changed, one missing.
  changed = dict(sources, **{"bdb.py": sources["bdb.py"] + "\n"})
  with pytest.raises(ConfigError, match=r"built from cpython .* bdb.py differs in this one"):
    longsuite.check_python(manifest, changed)
  with pytest.raises(ConfigError, match="nowhere.py is not in"):
    longsuite.read_sources(corpus.stdlib_root(), ("bdb.py", "nowhere.py"))


def test_a_banned_run_never_reaches_a_document(tok, monkeypatch):
  sources = longsuite.read_sources(corpus.stdlib_root(), ("bdb.py", "textwrap.py"))
  build = lambda banned: longsuite.build(sources, tok, banned, "t", contexts=(1024,), docs=1)
  first, manifest = build(set())
  assert build(set()) == (first, manifest)  # deterministic
  # ban one run of a docstring in the summary's document: its docstring is left out
  b = next(b for b in ref.page("bdb.py", sources["bdb.py"])[1:]
           if b.doc and b.text in document(first["summarization"][0]))
  ids = tok.encode(b.text)
  banned = {tuple(ids[-longsuite.RUN:])}
  got, manifest = build(banned)
  assert f"bdb:{b.name}" in manifest["docstrings_left_out"]
  assert not longsuite.has_run(tok.encode(document(got["summarization"][0])), banned)
  # Deliberate bug, found: the filter off.
  monkeypatch.setattr(longsuite, "has_run", lambda ids, banned: False)
  leaked, _ = build(banned)
  assert b.text in document(leaked["summarization"][0])


def test_context_prompts_and_bad_contexts_are_one_line(tok):
  c = SweepConfig.from_mapping(sweep_gamma.get_config("long_context"))
  got = prompts.sweep_prompts(c.replace(contexts=(), context=2048), tok, 49152)
  assert len(got) == 6 and all(longsuite.bounds(2048)[0] < len(p) <= 2048 - 256 for p in got)
  assert got[0][-20:] != got[1][-20:]  # a summary, then the question on the same document
  quick = SweepConfig.from_mapping(sweep_gamma.get_config("long_context_quick"))
  tiled = prompts.sweep_prompts(quick.replace(contexts=(), context=64), None, 256)
  assert [len(p) for p in tiled] == [64 - quick.n_predict]
  for kw, msg in ((dict(contexts=(1024, 1024)), "names a context twice"),
                  (dict(contexts=(3000,)), "no prompts at context 3000"),
                  (dict(taskbench_suite="dev"), "set config.taskbench_suite=long"),
                  (dict(trees=("chain:2",)), "leave config.taskbench and config.trees empty"),
                  (dict(contexts=(0,)), "config.contexts must be >= 1")):
    with pytest.raises(ConfigError, match=msg):
      c.replace(**kw)


def test_long_context_quick_runs_end_to_end(tmp_path, monkeypatch):
  cfg = SweepConfig.from_mapping(sweep_gamma.get_config("long_context_quick"))
  assert cfg.runner == "contexts"
  memos = []
  forget = contexts.forget
  monkeypatch.setattr(contexts, "forget",
                      lambda p: (forget(p), memos.append(dict(p.setup.loop.target.memo))))
  records = contexts.run_contexts(cfg, str(tmp_path), progress=False)
  assert memos == [{}, {}]  # each context's prefilled rows dropped when it is done
  assert all(r["env"]["peak_rss_bytes"] >= r["env"]["rss_bytes"] > 0 for r in records)
  got = sorted((r["context"], r["drafter"], r["batch"]) for r in records)
  assert got == sorted((c, d, b) for c in cfg.contexts for d in cfg.drafters for b in cfg.batches)
  for r in records:
    assert r["capacity"] == r["context"] + max(cfg.gammas)  # the cache sized to the context
    assert r["prompt_lens"] == [r["context"] - cfg.n_predict] and r["speedup"] > 0
  assert [json.loads(x)["context"] for x in (tmp_path / contexts.RECORDS).read_text()
          .splitlines()] == [r["context"] for r in records]
  text = (tmp_path / contexts.REPORT).read_text()
  assert "| 128 | 1 | 0 |" in text and (tmp_path / contexts.PLOT).stat().st_size > 0
  assert (tmp_path / "ctx-64" / "results.jsonl").is_file()


def refusal(tmp_path, monkeypatch) -> str:
  """run_contexts on the quick config with 1 KiB available: its one line,
  or 'work started' if it got as far as running a point."""
  monkeypatch.setattr(memory, "available_bytes", lambda: 1 << 10)

  def started(*a, **k):
    raise SpecjaxError("work started")
  monkeypatch.setattr(harness, "execute", started)
  cfg = SweepConfig.from_mapping(sweep_gamma.get_config("long_context_quick"))
  with pytest.raises(SpecjaxError) as e:
    contexts.run_contexts(cfg, str(tmp_path / "w"), progress=False)
  return str(e.value)


def test_a_context_that_would_not_fit_is_refused_before_any_work(tmp_path, monkeypatch):
  line = refusal(tmp_path, monkeypatch)
  assert re.fullmatch(r"context 64 at batch 1 needs about [0-9.]+ GiB, 0\.0 GiB available: "
                      r"drop it from config\.contexts or lower config\.batches", line), line
  assert not list((tmp_path / "w").glob("*/results.jsonl"))


def test_memory_left_unchecked_fails(tmp_path, monkeypatch):
  monkeypatch.setattr(contexts, "check_memory", lambda c, p: None)
  assert refusal(tmp_path, monkeypatch) == "work started"
