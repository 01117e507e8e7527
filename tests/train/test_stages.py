"""A resumable stage reuses its outputs only for the settings it was made
with (workdir.check_stage): the EAGLE pipeline's corpus and acceptance here;
the pair's in tests/scripts/test_scripts.py (its end-to-end run), the
self-distillation's in test_selfdistill.py. Before, a rerun with other
settings silently reused the old corpus and printed the old acceptance."""

import pytest

from configs import train as train_configs
from specjax.errors import ConfigError
from specjax.train import eagle


def _config(**kw):
  c = train_configs.get_config("eagle_tiny")
  c.eagle_drafts = ()  # the head alone: its acceptance is the stage under test
  for k, v in kw.items():
    c[k] = v
  return c


@pytest.fixture(scope="module")
def eagle_work(tmp_path_factory):
  work = tmp_path_factory.mktemp("eagle")
  summary = eagle.run(_config(), work, None, progress=False, log=lambda s: None)
  return work, summary


def test_eagle_pipeline_reuses_only_what_its_settings_made(eagle_work):
  work, first = eagle_work
  lines = []
  again = eagle.run(_config(), work, None, progress=False, log=lines.append)
  assert again["alpha"] == first["alpha"]
  assert not any("measuring" in l for l in lines)  # same settings: reused
  with pytest.raises(ConfigError, match=r"alpha.json was made with other settings "
                     r"\(alpha_gamma: 4 -> 3\); delete .*alpha.json to measure again"):
    eagle.run(_config(alpha_gamma=3), work, None, progress=False, log=lines.append)
  with pytest.raises(ConfigError, match=r"train.npy was made with other settings "
                     r"\(max_files: 4 -> 5\); use a new --workdir"):
    eagle.run(_config(max_files=5), work, None, progress=False, log=lines.append)
  # refused, the stage measures again once its result is moved away
  (work / "alpha.json").rename(work / "alpha-gamma4.json")
  third = eagle.run(_config(alpha_gamma=3), work, None, progress=False, log=lines.append)
  assert third["alpha"]["gamma"] == 3 and any("measuring" in l for l in lines)
