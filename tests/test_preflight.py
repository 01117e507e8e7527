"""Bad input is one line, found before the work (specjax/preflight.py,
workdir.check_output_*, cli.run): config mistakes, output paths that cannot
be written, binary prompt files, any OSError. Each command is run as a new
user would run it; each case failed before (a traceback, or an error after
the whole run)."""

import os
import re
import subprocess
import sys
import tempfile

import pytest

import forkrun
from specjax import workdir as wd
from specjax.errors import ConfigError, OutputError

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CONFIGS = os.path.join(ROOT, "configs")


def run(*args, code=None):
  cmd = [sys.executable, "-c", code] if code else [sys.executable, *args]
  return subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=ROOT)


@pytest.fixture(scope="module")
def run_script(tmp_path_factory):
  """run(script, *args) forked from one python that imported jax
  (tests/forkrun.py: the child is the script as a user runs it)."""
  runner = forkrun.ForkRunner(ROOT, tmp_path_factory.mktemp("forked"))
  yield runner.run
  runner.close()


def one_line(proc) -> str:
  """The error line of a run that must fail with exactly one."""
  assert proc.returncode == 1, (proc.returncode, proc.stdout, proc.stderr)
  assert "Traceback" not in proc.stderr, proc.stderr
  lines = [l for l in proc.stderr.splitlines() if l.strip()]
  assert len(lines) == 1 and lines[0].startswith("error: "), proc.stderr
  return lines[0]


@pytest.fixture(scope="module")
def paths(tmp_path_factory):
  root = tmp_path_factory.mktemp("preflight")
  (root / "a_dir").mkdir()
  (root / "a_file").write_text("x")
  (root / "binary.txt").write_bytes(b"\xff\xfe\x00prompt\x80\n")
  return root


def script(name):
  return os.path.join(ROOT, "experiments", name)


@pytest.mark.parametrize("args,expected", [
    (["train.py", f"--config={CONFIGS}/train.py:nosuch"],
     "unknown train variant 'nosuch'"),
    (["train_smollm2.py", "--config.seeds=4"],  # parsed at import (no --config given)
     "--config.seeds: the config has no field 'seeds' (did you mean 'seed'?)"),
    (["train.py", "--config.gamma=4"], "--config.gamma: the config has no field 'gamma'"),
    (["train.py", f"--config={CONFIGS}/train.py:tiny", "--config.target.num_layerz=1"],
     "--config.target.num_layerz: the config has no field 'num_layerz' (did you mean "
     "'n_layers'?)"),
    (["train_eagle.py", "--config=/no/such/config.py"], "No such file or directory"),
    (["train.py", "--config=/no/such/config.py:tiny"], "No such file or directory"),
    (["train_smollm2.py", "--config.n_new=abc"], "--config.n_new=abc: invalid literal"),
])
def test_config_mistakes_are_one_line(run_script, args, expected):
  assert expected in one_line(run_script(script(args[0]), *args[1:]))


def test_output_paths_are_refused_before_the_work(run_script, paths):
  cases = [
      (["generate.py", "--model=tiny", f"--json_out={paths / 'a_dir'}"], "is a directory"),
      (["generate.py", "--model=tiny", f"--json_out={paths / 'a_file' / 'x.json'}"],
       "a_file is a file, not a folder"),
      (["generate.py", "--model=tiny", "--json_out="], "--json_out is empty"),
      (["train.py", f"--config={CONFIGS}/train.py:tiny", f"--workdir={paths / 'a_file'}"],
       "--workdir .*a_file is a file, not a folder"),
      (["divergence_study.py", f"--out_dir={paths / 'a_file' / 'sub'}"], "not a folder"),
      (["train.py", f"--config={CONFIGS}/train.py:tiny", f"--workdir={paths / 'w'}",
        f"--export_dir={paths / 'a_file'}"], "--export_dir .* is a file"),
  ]
  for args, expected in cases:
    line = one_line(run_script(script(args[0]), *args[1:]))
    assert re.search(expected, line), (args, line)
  assert not (paths / "w").exists()  # refused before the work: nothing was made


def test_a_binary_prompt_file_is_one_line(run_script, paths):
  line = one_line(run_script(script("generate.py"), "--model=tiny",
                             f"--prompt_file={paths / 'binary.txt'}"))
  assert "is not UTF-8 text (byte 0xff at offset 0)" in line


def test_an_os_error_in_main_is_one_line(paths):
  code = ("from specjax import cli\n"
          f"cli.run(lambda argv: open({str(paths / 'a_dir')!r}, 'w'))\n")
  assert one_line(run(code=code)) == f"error: Is a directory: {paths / 'a_dir'}"


def test_check_output_file_and_dir(tmp_path):
  (tmp_path / "d").mkdir()
  (tmp_path / "f.json").write_text("{\"kept\": 1}")
  wd.check_output_file(tmp_path / "f.json", "--json_out")  # an existing file: fine,
  assert (tmp_path / "f.json").read_text() == "{\"kept\": 1}"  # and untouched
  wd.check_output_file(tmp_path / "new" / "deeper" / "x.json", "--json_out")
  wd.check_output_dir(tmp_path / "new" / "w", "--workdir")
  assert sorted(p.name for p in tmp_path.iterdir()) == ["d", "f.json"]  # nothing made
  for check, path, what in (
      (wd.check_output_file, tmp_path / "d", "is a directory"),
      (wd.check_output_file, tmp_path / "f.json" / "x", "is a file, not a folder"),
      (wd.check_output_dir, tmp_path / "f.json", "is a file, not a folder"),
      (wd.check_output_dir, tmp_path / "f.json" / "a" / "b", "is a file, not a folder"),
      (wd.check_output_dir, " ", "is empty")):
    with pytest.raises(OutputError, match=what):
      check(path, "--flag")


def test_a_folder_without_write_access_is_refused(tmp_path):
  ro = tmp_path / "ro"
  ro.mkdir()
  ro.chmod(0o500)
  try:
    if os.access(ro, os.W_OK):
      pytest.skip("running as root: a mode cannot take write access away")
    with pytest.raises(OutputError, match="cannot write in .*ro"):
      wd.check_output_dir(ro / "w", "--workdir")
    with pytest.raises(OutputError, match="cannot write in"):
      wd.check_output_file(ro / "x.json", "--json_out")
  finally:
    ro.chmod(0o700)


def test_a_read_only_system_folder_is_refused():
  """As root a mode takes nothing away; /sys refuses new files even then."""
  try:
    with tempfile.TemporaryFile(dir="/sys"):
      pass
  except OSError:
    with pytest.raises(OutputError, match="cannot write in /sys"):
      wd.check_output_dir("/sys/specjax_workdir", "--workdir")
    return
  pytest.skip("/sys takes new files here")


def test_a_stage_is_reused_only_with_its_settings(tmp_path):
  out, rec = tmp_path / "alpha.json", tmp_path / "alpha.settings.json"
  want = {"gamma": 4, "temps": (0.0, 1.0), "model": {"dim": 32}}
  assert not wd.check_stage(rec, want, [out], "delete it")  # to run; settings recorded
  out.write_text("{}")
  assert wd.check_stage(rec, want, [out], "delete it")  # same settings: reused
  with pytest.raises(ConfigError, match=r"alpha.json was made with other settings "
                     r"\(model.dim: 32 -> 64\); delete it$"):
    wd.check_stage(rec, {**want, "model": {"dim": 64}}, [out], "delete it")
  with pytest.raises(ConfigError, match=r"temps: \[0.0, 1.0\] -> \[0.0\]"):
    wd.check_stage(rec, {**want, "temps": (0.0,)}, [out], "delete it")
  rec.unlink()  # outputs of an older run, which recorded nothing: not trusted
  with pytest.raises(ConfigError, match="did not record its settings"):
    wd.check_stage(rec, want, [out], "delete it")
  assert out.read_text() == "{}"  # refusals touch nothing



def commit_after_a_new_commit(monkeypatch, read=None) -> tuple[str, str]:
  """`read` (wd.git_commit) before and after `git` starts answering another commit."""
  read = read or wd.git_commit
  wd.git_commit.cache_clear()
  first = read()

  class Moved:
    stdout = "abc1234"
  monkeypatch.setattr(wd.subprocess, "run", lambda *a, **k: Moved())
  try:
    return first, read()
  finally:
    monkeypatch.undo()
    wd.git_commit.cache_clear()


def test_a_run_names_the_commit_it_started_with(monkeypatch):
  first, later = commit_after_a_new_commit(monkeypatch)
  assert later == first != "abc1234"


def test_the_commit_read_when_a_run_ends_fails(monkeypatch):
  first, later = commit_after_a_new_commit(monkeypatch, read=wd.git_commit.__wrapped__)
  assert later != first
