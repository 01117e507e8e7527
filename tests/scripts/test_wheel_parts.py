"""experiments/wheel_parts.py: a file split into parts, the calls before the
last stashing theirs outside the checkout, the last joining them, each part
and the whole checked by sha256; a missing or damaged part, or an output in
the way, is one line and exit 1."""

import hashlib
import importlib.util
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SCRIPT = os.path.join(ROOT, "experiments", "wheel_parts.py")


def _module():
  spec = importlib.util.spec_from_file_location("wheel_parts_under_test", SCRIPT)
  mod = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(mod)
  return mod


def run(*args):
  return subprocess.run([sys.executable, SCRIPT, *map(str, args)], capture_output=True,
                        text=True, timeout=120, cwd=ROOT)


def one_line_error(proc, text):
  assert proc.returncode == 1, proc.stdout
  assert "Traceback" not in proc.stderr
  lines = [l for l in proc.stderr.splitlines() if l.strip()]
  assert len(lines) == 1 and lines[0].startswith("error: ") and text in lines[0], proc.stderr


@pytest.fixture
def wheel(tmp_path):
  """A random 3 MB file with a wheel's name."""
  path = tmp_path / "llm_x-0.1-py3-none-any.whl"
  path.write_bytes(os.urandom(3_000_001))  # odd: the parts differ in size
  return path


def _digest(path):
  return hashlib.sha256(path.read_bytes()).hexdigest()


def test_two_calls_put_the_file_back(wheel, tmp_path):
  parts, stash, out = tmp_path / "parts", tmp_path / "device_tmp", tmp_path / "wheels"
  assert run("split", wheel, parts, "--parts=2").returncode == 0
  assert sorted(os.listdir(parts)) == ["part1", "part2"]
  assert sorted(os.listdir(parts / "part1")) == [f"{wheel.name}.part1", f"{wheel.name}.parts.json"]
  sizes = [os.path.getsize(parts / f"part{k}" / f"{wheel.name}.part{k}") for k in (1, 2)]
  assert sizes == [1_500_001, 1_500_000]
  proc = run("stash", parts / "part1", stash)  # call 1: part 1 out of the checkout
  assert proc.returncode == 0 and "stashed" in proc.stdout, proc.stderr
  proc = run("join", stash, parts / "part2", "--out", out)  # call 2
  assert proc.returncode == 0, proc.stderr
  assert _digest(out / wheel.name) == _digest(wheel)
  assert run("join", stash, parts / "part2", "--out", out).returncode == 0  # same file: kept


def test_a_damaged_part_is_refused(wheel, tmp_path):
  parts, out = tmp_path / "parts", tmp_path / "wheels"
  run("split", wheel, parts, "--parts=2")
  bad = parts / "part2" / f"{wheel.name}.part2"
  data = bytearray(bad.read_bytes())
  data[1000] ^= 1  # one bit
  bad.write_bytes(bytes(data))
  one_line_error(run("join", parts / "part1", parts / "part2", "--out", out),
                 "part 2 of 2 is damaged")
  assert not out.exists() or not os.listdir(out)
  one_line_error(run("stash", parts / "part2", tmp_path / "stash"), "part 2 of 2 is damaged")


def test_a_missing_part_is_refused(wheel, tmp_path):
  parts, out = tmp_path / "parts", tmp_path / "wheels"
  run("split", wheel, parts, "--parts=3")
  one_line_error(run("join", parts / "part1", parts / "part3", "--out", out),
                 f"part 2 of 3 ({wheel.name}.part2) is in none of")
  assert not (out / wheel.name).exists()


def test_nothing_is_overwritten(wheel, tmp_path):
  parts, out = tmp_path / "parts", tmp_path / "wheels"
  run("split", wheel, parts, "--parts=2")
  one_line_error(run("split", wheel, parts, "--parts=2"), "is not an empty folder")
  out.mkdir()
  (out / wheel.name).write_bytes(b"another file")
  one_line_error(run("join", parts / "part1", parts / "part2", "--out", out),
                 "exists and is not")
  assert (out / wheel.name).read_bytes() == b"another file"
  one_line_error(run("join", tmp_path / "nowhere", "--out", out), "no *.parts.json manifest")


def test_the_count_fits_the_checkout(wheel, tmp_path):
  """Without --parts, each part fits beside what a call sends: the SmolLM2
  wheel (92,871,040 bytes) beside a 46.8 MB checkout needs 5 parts, beside
  a 10 MB one 2."""
  mod = _module()
  room = lambda checkout: mod.TRANSFER_LIMIT - mod.MARGIN - checkout
  assert mod.parts_needed(92_871_040, room(46_808_201)) == 5
  assert mod.parts_needed(92_871_040, room(10_000_000)) == 2
  with pytest.raises(mod.SpecjaxError, match="no room"):
    mod.parts_needed(1, room(mod.TRANSFER_LIMIT))
  assert mod.checkout_bytes(ROOT) > 1_000_000  # the tracked assets at least
  proc = run("split", wheel, tmp_path / "p", f"--checkout={ROOT}")
  assert proc.returncode == 0 and "in 1 part(s)" in proc.stdout, proc.stderr


def test_parts_the_checkout_would_send_are_refused(wheel, tmp_path):
  """Parts written inside the checkout must be ignored by git, or every
  device call would carry all of them."""
  repo = tmp_path / "repo"
  subprocess.run(["git", "init", "-q", str(repo)], check=True)
  one_line_error(run("split", wheel, repo / ".parts", f"--checkout={repo}"),
                 "is inside the checkout and not ignored")
  assert not (repo / ".parts").exists()
  (repo / ".git" / "info").mkdir(exist_ok=True)
  (repo / ".git" / "info" / "exclude").write_text("/.parts/\n")
  proc = run("split", wheel, repo / ".parts", f"--checkout={repo}")
  assert proc.returncode == 0 and "in 1 part(s)" in proc.stdout, proc.stderr
