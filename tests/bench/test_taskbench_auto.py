"""The task suite's auto rows (`DRAFTER@auto[:N1,..]` in config.taskbench_trees):
the drafter's trees sweep runs one auto point choosing among --tree=auto's
own candidates (plan.candidate_trees, bench/sweep/trees.py auto_trees),
none of them a row of its own, next to the drafter's fixed rows; an EAGLE-3
head included (its state carried across candidates)."""

import pytest

from configs import sweep_gamma
from specjax.bench.sweep import taskbench_run
from specjax.bench.sweep import trees as trees_sweep
from specjax.bench.sweep.config import SweepConfig
from specjax.decode import plan
from specjax.errors import ConfigError


def quick(**kw) -> SweepConfig:
  return SweepConfig.from_mapping(sweep_gamma.get_config("taskbench_quick")).replace(**kw)


def test_auto_rows_are_checked():
  """auto and auto:N1,.. are rows; its candidates are --tree=auto's (a name
  a static row holds with another topology kept apart); bad sizes, an
  unknown drafter and two auto rows of one drafter are one line each."""
  c = quick(taskbench_trees=("eagle:smollm2-eagle@auto", "ngram@auto:8,16"))
  sweeps = {s.drafter: s.cfg for s in taskbench_run.sweeps(c, "/nowhere") if s.drafter}
  assert (sweeps["eagle:smollm2-eagle"].trees, sweeps["eagle:smollm2-eagle"].auto_candidates) \
      == (("auto",), "auto")
  assert list(trees_sweep.auto_trees(sweeps["ngram:1-4"])) == list(plan.candidate_trees((8, 16)))
  clash = c.replace(taskbench_trees=(), trees=("sequoia:8,8", "auto"), auto_candidates="auto:8")
  assert "sequoia:8,8 (auto)" in trees_sweep.auto_trees(clash)
  assert list(trees_sweep.auto_trees(clash.replace(auto_candidates=""))) == ["sequoia:8,8"]
  for bad, msg in (("eagle@auto:x", r"^config.taskbench_trees: 'eagle@auto:x': --tree=auto:x"),
                   ("bogus@auto", "unknown drafter"),
                   ("eagle@auto,eagle@auto:8", "one auto row per drafter")):
    with pytest.raises(ConfigError, match=msg):
      c.replace(taskbench_trees=tuple(bad.split(",")))
  with pytest.raises(ConfigError, match="config.auto_candidates must be"):
    c.replace(auto_candidates="sequoia:8,8")


@pytest.fixture(scope="module")
def tiny_head3(tmp_path_factory):
  """A random EAGLE-3 head for the tiny target over every third id."""
  from specjax.drafters import eagle3  # pylint: disable=import-outside-toplevel
  from specjax.model import config  # pylint: disable=import-outside-toplevel
  cfg = config.get_preset("tiny")
  hcfg, ids = eagle3.head_config(cfg), list(range(0, cfg.vocab_size, 3))
  return str(eagle3.save_head3(tmp_path_factory.mktemp("head3") / "tiny-eagle3", hcfg,
                               eagle3.init_head3(hcfg, len(ids)),
                               eagle3.default_layers(cfg.n_layers), ids, cfg, "tiny"))


AUTO = "auto:6"


def test_an_auto_row_runs_among_the_candidates(tmp_path, tiny_head3):
  """The quick config on the tiny target with an EAGLE-3 head's auto row and
  chain:2 row: two leaderboard rows; the auto one chose among --tree=auto's
  candidates for size 6 (none measured as a row); the report lists it."""
  head = f"eagle3:{tiny_head3}"
  c = quick(target="tiny", draft="tiny-draft", chat=False, prompt_tokens="1,5,9,200,3,7,7,7",
            drafters=(), taskbench=("math",), taskbench_trees=(f"{head}@{AUTO}",
                                                             f"{head}@chain:2"),
            n_predict=12, ctx_size=48)
  records = taskbench_run.run_taskbench(c, str(tmp_path / "tb"), progress=False)
  assert sorted(r["drafter"] for r in records) == [f"{head} auto", f"{head} chain:2"]
  auto = next(r for r in records if r["tree"] == "auto")
  assert auto["auto_trees"] == list(plan.candidate_trees((6,)))
  assert auto["trees_used"] and set(auto["trees_used"]) <= set(auto["auto_trees"])
  assert auto["gamma"] == 8 and auto["speedup"] > 0
  text = (tmp_path / "tb" / "taskbench.md").read_text()
  assert f"| {head} auto |" in text
