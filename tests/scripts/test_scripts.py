"""The scripts end to end: one clear line and exit 1 on bad input, JSON out."""

import atexit
import json
import os
import pathlib
import re
import subprocess
import sys
import tempfile

import pytest

import forkrun
from specjax.formats import checkpoint
from specjax.model import config
from specjax.model import llama as model
from specjax.metrics import schema

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


_FORKED: list = []  # run()'s fork server, started on first use (one per test process)


def run(script, *args, timeout=300, env=None):
  """experiments/SCRIPT ARGS from ROOT: forked from one python that imported
  jax (tests/forkrun.py), or, with its own `env` (read when jax starts), a
  new process."""
  if env is None:
    if not _FORKED:
      _FORKED.append(forkrun.ForkRunner(ROOT, pathlib.Path(tempfile.mkdtemp())))
      atexit.register(_FORKED[0].close)
    return _FORKED[0].run(os.path.join(ROOT, "experiments", script), *args, timeout=timeout)
  return subprocess.run([sys.executable, os.path.join(ROOT, "experiments", script), *args],
                        capture_output=True, text=True, timeout=timeout, cwd=ROOT,
                        env=None if env is None else {**os.environ, **env})


def assert_one_line_error(proc, pattern):
  assert proc.returncode != 0, proc.stdout
  assert "Traceback" not in proc.stderr, proc.stderr
  lines = [l for l in proc.stderr.splitlines() if l.strip()]
  errors = [l for l in lines if re.search(pattern, l)]
  assert errors, proc.stderr
  assert len(errors[0]) < 600


@pytest.fixture(scope="module")
def other_vocab_dir(tmp_path_factory):
  cfg = config.get_preset("tiny").replace(name="tiny-v300", vocab_size=300)
  path = tmp_path_factory.mktemp("v300")
  checkpoint.save(path, cfg, model.init_params(cfg))
  return str(path)


def test_generate_writes_json(tmp_path):
  out = tmp_path / "gen.json"
  proc = run("generate.py", "--model=tiny", "--n_predict=6", "--prompt_tokens=1,2,3",
             f"--json_out={out}")
  assert proc.returncode == 0, proc.stderr
  assert "prompt eval time" in proc.stdout and "compile time" in proc.stdout
  rec = json.loads(out.read_text())
  assert len(rec["tokens"]) == 6 and rec["prompt_tokens"] == [1, 2, 3]
  assert rec["env"]["cpu"]["model"] and rec["env"]["git_commit"]


def test_speculative_writes_json(tmp_path):
  out = tmp_path / "spec.json"
  proc = run("speculative.py", "--model=tiny", "--model_draft=tiny-draft", "--n_predict=12",
             "--gamma=3", "--accept=bernoulli:0.5", "--prompt_tokens=4,5,6", "--reps=2",
             f"--json_out={out}")
  assert proc.returncode == 0, proc.stderr
  for word in ("n_draft", "n_predict", "n_drafted", "n_accept", "accept", "speedup",
               "median of 2"):
    assert word in proc.stdout
  rec = json.loads(out.read_text())
  for key in ("tokens", "gamma", "n_predict", "n_drafted", "n_accept", "accept_rate", "n_steps",
              "tokens_per_step", "alpha", "accept_hist", "alpha_at_pos", "speedup",
              "baseline_tps", "spec_tps", "capacity", "env"):
    assert key in rec, key
  assert set(rec) <= set(schema.FIELDS)  # rows included: per row, next to the run's fields
  # the rule and the rate are two fields, not one overwriting the other
  assert rec["accept_rule"] == "bernoulli:0.5" and 0 <= rec["accept_rate"] <= 1
  assert rec["n_predict"] == 12 and len(rec["tokens"]) == 12
  assert rec["rows"] == [{"prompt_ids": [4, 5, 6], "tokens": rec["tokens"],
                          "baseline_tokens": rec["baseline_tokens"]}]
  assert rec["env"]["cpu"]["model"] and rec["env"]["git_commit"]


def test_gamma_has_one_meaning():
  """--gamma on every script: an integer from 1 to 64, or auto; a list of them
  where a script sweeps gamma."""
  from specjax import cli  # pylint: disable=import-outside-toplevel
  from specjax.errors import ConfigError  # pylint: disable=import-outside-toplevel
  assert cli.parse_gamma("4") == 4 and cli.parse_gamma(" Auto ") == cli.AUTO
  for bad in ("0", "65", "four", "", "2.5", "-1"):
    with pytest.raises(ConfigError, match="--gamma"):
      cli.parse_gamma(bad)
  assert cli.parse_gammas(["4", "1", "auto", "4"]) == ([1, 4], True)
  assert cli.parse_gammas(["2"]) == ([2], False)


PROMPTS = [[4, 5, 6], [7, 8, 9, 10, 11]]  # one per line of a --prompt_file


@pytest.fixture
def prompt_file(tmp_path):
  path = tmp_path / "prompts.txt"
  path.write_text("".join(",".join(map(str, p)) + "\n" for p in PROMPTS))
  return path


def _rows_hold_every_prompt(rows, n_predict, baseline):
  """Every row of a --prompt_file run with --n_parallel=2: its prompt ids in
  file order, n_predict tokens, the baseline's tokens when one ran."""
  assert [r["prompt_ids"] for r in rows] == [p for p in PROMPTS for _ in range(2)]
  assert all(len(r["tokens"]) == n_predict for r in rows)
  assert all(("baseline_tokens" in r) == baseline for r in rows)
  assert rows[0]["tokens"] == rows[1]["tokens"] != rows[2]["tokens"]  # rows not mixed up


def test_speculative_eagle_graft_reports_the_heads_own_params():
  """The head's own parameters (fc and layer), not its config's count with the
  target's embedding (1.8 M); a grafted tree from the command line, greedy-exact."""
  proc = run("speculative.py", "--model=stdlib-target", "--dtype=float32", "--drafter=eagle",
             "--tree=dynamic:2,3,5+ngram:4", "--prompt=def main(", "--n_predict=8", "--reps=1")
  assert proc.returncode == 0, proc.stderr
  assert "draft: stdlib-target-eagle (0.9 M params of its own;" in proc.stdout, proc.stdout[-800:]
  assert "greedy equality: the speculative tokens equal the target-only tokens" in proc.stdout


def test_speculative_eagle3_tree_auto(tmp_path):
  """--drafter=eagle3:PATH --tree=auto on a tiny random head: the tree is
  chosen at run time among the candidates (the head's pending pairs as wide
  as the deepest), greedy-exact; the flag's help lists eagle3."""
  from specjax.drafters import eagle3  # pylint: disable=import-outside-toplevel
  cfg = config.get_preset("tiny")
  ids = list(range(0, cfg.vocab_size, 3))
  head = eagle3.save_head3(tmp_path / "head", eagle3.head_config(cfg),
                           eagle3.init_head3(eagle3.head_config(cfg), len(ids)),
                           eagle3.default_layers(cfg.n_layers), ids, cfg, "tiny")
  out = tmp_path / "spec.json"
  proc = run("speculative.py", "--model=tiny", f"--drafter=eagle3:{head}", "--tree=auto:4",
             "--n_predict=12", "--prompt_tokens=4,5,6", "--reps=1", f"--json_out={out}")
  assert proc.returncode == 0, proc.stderr[-2000:]
  assert "greedy equality: the speculative tokens equal the target-only tokens" in proc.stdout
  rec = json.loads(out.read_text())
  assert rec["drafter"] == f"eagle3:{head}" and rec["auto_trees"], rec
  assert "eagle3[:PATH]" in run("speculative.py", "--helpfull").stdout


@pytest.mark.parametrize("gamma", ["3", "auto", "auto:rows,max=2,budget=auto"])
def test_speculative_prompt_file_json_keeps_every_row(tmp_path, prompt_file, gamma):
  """A batched run's record holds every row's prompt ids, tokens and
  target-only tokens; greedy in float32 they are the same tokens. Per-row
  lengths also keep the run step by step (rows_theory.step_table)."""
  out = tmp_path / "spec.json"
  proc = run("speculative.py", "--model=tiny", "--model_draft=tiny-draft", "--dtype=float32",
             f"--prompt_file={prompt_file}", "--n_parallel=2", f"--gamma={gamma}",
             "--auto_set=1,2", "--n_predict=10", "--reps=1", f"--json_out={out}")
  assert proc.returncode == 0, proc.stderr
  rec = json.loads(out.read_text())
  assert rec["batch"] == 4 and "tokens" not in rec  # no single-prompt fields for a batch
  _rows_hold_every_prompt(rec["rows"], 10, baseline=True)
  for r in rec["rows"]:
    assert r["tokens"] == r["baseline_tokens"], r
  steps = rec.get("per_row_steps")
  assert (steps is not None) == gamma.startswith("auto:rows")
  if steps:
    assert [s["step"] for s in steps] == list(range(rec["per_row"]["steps"]))
    assert sum(r["kept"] for s in steps for r in s["rows"]) == rec["n_kept"]
    assert all(s["budget"] >= 4 and sum(r["given"] for r in s["rows"]) <= s["budget"] - 4
               for s in steps)


def test_generate_prompt_file_json_keeps_every_row(tmp_path, prompt_file):
  """generate.py's batch: every row in the record, each row's tokens those of
  the prompt run alone (greedy)."""
  from specjax.decode import generation  # pylint: disable=import-outside-toplevel
  from specjax.model import steps  # pylint: disable=import-outside-toplevel
  out = tmp_path / "gen.json"
  proc = run("generate.py", "--model=tiny", "--dtype=float32", f"--prompt_file={prompt_file}",
             "--n_parallel=2", "--n_predict=7", f"--json_out={out}")
  assert proc.returncode == 0, proc.stderr
  rec = json.loads(out.read_text())
  assert rec["batch"] == 4 and "tokens" not in rec
  _rows_hold_every_prompt(rec["rows"], 7, baseline=False)
  cfg, params, _ = checkpoint.load_model("tiny", dtype="float32")
  m = steps.Runner(cfg, params)
  for r in rec["rows"]:
    assert r["tokens"] == generation.generate(m, [r["prompt_ids"]], 7).tokens[0]


@pytest.mark.parametrize("script,args,pattern", [
    ("generate.py", ["--model=/no/such/dir"], r"error: .*no/such/dir"),
    ("generate.py", ["--model=llama-9000"], r"error: .*preset"),
    ("generate.py", ["--model=tiny", "--prompt_tokens=" + ",".join(["1"] * 140)],
     r"error: .*exceeds the context"),
    ("generate.py", ["--model=tiny", "--n_predict=500"], r"error: .*exceeds the context"),
    ("generate.py", ["--model=tiny", "--n_predict=0"], r"n_predict"),
    ("generate.py", ["--model=tiny", "--top_p=1.5"], r"top_p"),
    ("generate.py", ["--model=tiny", "--prompt=hello"], r"error: .*no tokenizer"),
    ("speculative.py", ["--model=tiny", "--model_draft=tiny", "--accept=sometimes"],
     r"error: .*acceptance rule"),
    ("speculative.py", ["--model=tiny", "--model_draft=tiny", "--gamma=0"], r"error: --gamma"),
    ("speculative.py", ["--model=tiny", "--model_draft=tiny", "--gamma=four"], r"error: --gamma"),
    ("speculative.py", ["--model=tiny", "--model_draft=tiny", "--draft=65"], r"error: --gamma"),
    ("generate.py", ["--model=tiny", "--prompt_file=/no/such/file"], r"error: .*prompt_file"),
    ("speculative.py", ["--model=tiny", "--drafter=layerskip:0,5"], r"error: .*out of range"),
    ("loop_overhead.py", ["--model=tiny", "--drafter=ngram:3-1"], r"error: .*ngram_min"),
    ("speculative.py", ["--model=tiny", "--drafter=eagle"],
     r"error: no shipped EAGLE head fits target tiny \(dim 64, vocab 256\); shipped: "),
    ("speculative.py", ["--model=tiny", "--drafter=eagle:stdlib-eagle"],
     r"error: EAGLE head .* does not fit target tiny \(dim 64"),
    ("speculative.py", ["--model=tiny", "--model_draft=tiny-draft", "--gamma=auto",
                        "--auto_set=0,2"], r"error: .*auto"),
    ("speculative.py", ["--model=tiny", "--model_draft=tiny-draft", "--tree=auto",
                        "--loop=host"], r"error: --tree=auto runs the device loop"),
    ("speculative.py", ["--model=tiny", "--drafter=ngram", "--tree=dynamic:2,2,3"],
     r"error: drafter ngram:1-4 drafts static trees only; dynamic:2,2,3 needs"),
    ("speculative.py", ["--model=tiny", "--drafter=ngram:vocab=full"],
     r"error: .*ngram has no LM head to reduce"),
    ("speculative.py", ["--model=tiny", "--drafter=model:vocab=/no/such/vocab"],
     r"error: vocab=/no/such/vocab: no such file"),
    ("speculative.py", ["--model=tiny", "--model_draft=tiny-draft", "--drafter=model:vocab=64",
                        "--n_predict=8", "--prompt_tokens=1,2"],
     r"error: vocab=64: no shipped ranking for a vocabulary of 256 ids"),
    ("vocab_cost.py", ["--model=tiny", "--sizes=full,lots"], r"error: --sizes: 'lots'"),
    ("cost_surface.py", ["--model=tiny", "--drafter=ngram", "--workdir=/tmp/specjax_cs_bad"],
     r"error: drafter ngram:1-4: the surface times streaming, eagle, model"),
    ("draft_vocab.py", ["--n_train=0"], r"error: --n_train"),
    ("heldout_alpha.py", ["--temps=hot"], r"error: --temps"),
    ("heldout_alpha.py", ["--drafters=eagle:nowhere"], r"error: EAGLE head 'nowhere'"),
])
def test_bad_input_is_one_line(script, args, pattern):
  assert_one_line_error(run(script, *args), pattern)


def test_speculative_with_a_reduced_vocabulary_and_its_cost(tmp_path):
  """--drafter=model:vocab=PATH end to end (greedy: the target-only run's
  tokens, from the same process), and vocab_cost.py's table over the full head."""
  from specjax.drafters import vocab  # pylint: disable=import-outside-toplevel
  vocab.save(tmp_path, list(range(0, 256, 3)), 256, [0])
  proc = run("speculative.py", "--model=tiny", "--model_draft=tiny-draft", "--n_predict=10",
             "--gamma=3", "--prompt_tokens=4,5,6", f"--drafter=model:vocab={tmp_path}",
             "--reps=1", f"--json_out={tmp_path / 'o.json'}")
  assert proc.returncode == 0, proc.stderr
  b = json.loads((tmp_path / "o.json").read_text())
  assert len(b["tokens"]) == 10 and b["tokens"] == b["baseline_tokens"]
  assert b["drafter"] == f"model:vocab={tmp_path}" and b["n_drafted"] > 0
  proc = run("vocab_cost.py", "--model=tiny", "--model_draft=tiny-draft", "--drafters=model",
             "--sizes=full", "--reps=1", "--depth=8", f"--plot={tmp_path / 'c.png'}")
  assert proc.returncode == 0, proc.stderr
  assert (tmp_path / "c.png").stat().st_size > 1000
  assert re.search(r"model\s+full\s+[0-9.]+\s+[0-9.]+", proc.stdout), proc.stdout


def test_vocab_mismatch_is_one_line(other_vocab_dir):
  proc = run("speculative.py", "--model=tiny", f"--model_draft={other_vocab_dir}",
             "--n_predict=4")
  assert_one_line_error(proc, r"error: .*vocabularies differ")


def test_corrupt_checkpoint_is_one_line(tmp_path):
  (tmp_path / "config.json").write_text("{not json")
  assert_one_line_error(run("generate.py", f"--model={tmp_path}"), r"error: .*config.json")


def test_readme_quickstart_and_ci_agree():
  readme = open(os.path.join(ROOT, "README.md")).read()
  block = readme.split("## Quickstart", 1)[1].split("\n## ", 1)[0]
  commands = re.findall(r"```bash\n(.*?)\n```", block, re.S)
  assert len(commands) == 2, commands
  assert "experiments/" in commands[0]
  assert "pytest" in commands[1]
  ci = open(os.path.join(ROOT, ".ci", "run")).read()
  assert commands[1].strip() in ci


def test_long_batch_check_refuses_bad_batches_and_a_folder_of_other_settings(tmp_path):
  """experiments/long_batch_check.py: one line before any model loads, and an
  --out holding another run's records is never appended to."""
  assert_one_line_error(run("long_batch_check.py", "--batches=a,2", f"--out={tmp_path}/a"),
                        r"--batches must be whole numbers")
  out = tmp_path / "b"
  out.mkdir()
  (out / "records.jsonl").write_text('{"batch": 1}\n')
  (out / "settings.json").write_text(json.dumps(dict(
      context=2048, drafter="streaming:256,4", gamma=4, n_predict=64, reps=2, prompts=6,
      model="smollm2-135m", dtype="float32", engine="xla")))
  assert_one_line_error(run("long_batch_check.py", f"--out={out}"),
                        r"made with other settings \(context: 2048 -> 4096\)")
  assert (out / "records.jsonl").read_text() == '{"batch": 1}\n'
  assert_one_line_error(run("long_batch_check.py", "--engine=torch", "--drafter=ngram",
                            f"--out={tmp_path}/c"), r"--engine=torch runs the streaming draft")
