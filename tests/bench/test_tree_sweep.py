"""The trees sweep (bench/sweep/trees.py, tree_report.py): the crossover batch
and the best tree/chain/auto per batch on synthetic records; the rule's p;
the sweep on tiny models, interrupted and resumed without losing or redoing
a finished point; a dynamic tree drafted on the target's own cache
(layerskip) measured, each tree a drafter cannot draft skipped with one
line and its other trees still run. MUTATIONS are deliberate bugs, each
failing a check."""

import functools
import json

import jax
import jax.numpy as jnp
import pytest

from configs import sweep_gamma
from specjax.bench.sweep import engine, harness, points, tree_report
from specjax.bench.sweep import trees as tree_sweep
from specjax.bench.sweep.config import SweepConfig
from specjax.drafters import registry
from specjax.errors import ConfigError
from specjax.metrics import schema
from specjax.model import llama, steps
from specjax.model import tree as trees
from specjax.model.config import get_preset


def config(variant: str, **kw) -> SweepConfig:
  return SweepConfig.from_mapping(sweep_gamma.get_config(variant)).replace(**kw)


def run(cfg: SweepConfig, workdir, only: int | None = None, **kw):
  """The trees sweep into workdir; `only`: at most that many new points (an
  interrupted run)."""
  plan = harness.prepare(tree_sweep.RUNNER, cfg, str(workdir), **kw)
  plan.todo = plan.todo[:only]
  return harness.execute(plan, progress=False)


def _rec(batch, tree, speedup, nodes=None):
  return {"batch": batch, "tree": tree, "speedup": speedup, "drafter": "model",
          "accept_rule": "real", "temperature": 0.0, "tree_nodes": nodes, "gamma": 1,
          "tokens_per_step": 2.0, "tokens_per_step_predicted": 2.1}


# B:            1            4            16           32
SYNTH = ([_rec(b, "chain:4", s) for b, s in ((1, 2.0), (4, 1.8), (16, 1.2), (32, 0.9))]
         + [_rec(b, "chain:1", s) for b, s in ((1, 1.5), (4, 1.4), (16, 1.3), (32, 1.1))]
         + [_rec(b, "sequoia:16,8", s, 16) for b, s in ((1, 2.6), (4, 2.0), (16, 1.25),
                                                        (32, 0.7))]
         + [_rec(b, "sequoia:64,8", s, 64) for b, s in ((1, 2.4), (4, 1.5), (16, 0.5),
                                                        (32, 0.3))]
         + [_rec(b, "auto", s) for b, s in ((1, 2.5), (4, 1.9), (16, 1.3), (32, 1.0))])


def check_crossover():
  best = tree_report.best_per_batch(SYNTH)
  assert {b: (v["tree"]["tree"], v["chain"]["tree"]) for b, v in best.items()} == {
      1: ("sequoia:16,8", "chain:4"), 4: ("sequoia:16,8", "chain:4"),
      16: ("sequoia:16,8", "chain:1"), 32: ("sequoia:16,8", "chain:1")}
  sp = {b: {k: v[k]["speedup"] for k in ("tree", "chain")} for b, v in best.items()}
  # the tree wins at 1, 4 (2.6 > 2.0, 2.0 > 1.8); the chain from 16 on (1.3 > 1.25)
  assert tree_report.crossover(sp) == 16
  # a tree that wins again at the largest batch: no crossover in range
  assert tree_report.crossover({**sp, 32: {"tree": 2.0, "chain": 1.0}}) is None
  # a chain that wins everywhere: the smallest batch; a tie counts for the chain
  assert tree_report.crossover({1: {"tree": 1.0, "chain": 1.0}, 4: {"tree": 1, "chain": 2}}) == 1
  # a chain win at B=4 that the tree takes back at 16 is no crossover at 4
  assert tree_report.crossover({1: {"tree": 2, "chain": 1}, 4: {"tree": 1, "chain": 2},
                                16: {"tree": 2, "chain": 1}, 32: {"tree": 1, "chain": 2}}) == 32
  # a "tree" of chain topology (4 nodes, depth 4) is a chain
  assert tree_report.is_chain({**_rec(1, "sequoia:4,8", 1.0, 4), "gamma": 4})
  assert not tree_report.is_chain({**_rec(1, "sequoia:8,8", 1.0, 8), "gamma": 7})
  lines = "\n".join(tree_report.summary_lines(SYNTH, ["drafter eagle: skipped (cannot)"]))
  assert "Crossover batch" in lines and "here on): 16" in lines
  assert "| 1 | sequoia:16,8 | 2.600 | chain:4 | 2.000 | 1.300 | 2.500 | 0.962 |" in lines
  assert "- drafter eagle: skipped (cannot)" in lines


def test_crossover_and_best_per_batch_on_synthetic_records():
  check_crossover()


def test_rule_p_and_config():
  # as tree_acceptance.accept_table reads them
  assert tree_sweep.rule_p("siblings:0.8,0.4", 3) == [0.8, 0.4, 0.4]
  assert tree_sweep.rule_p("bernoulli:0.7", 2) == [0.7, 0.7]
  assert tree_sweep.rule_p("always", 1) == [1.0]
  assert tree_sweep.rule_p("real") is None
  c = config("trees")
  tree_sweep.RUNNER.check(c)
  assert {t.n for t in tree_sweep.fixed_trees(c).values()} == {1, 2, 4, 8, 16, 32, 64}
  assert c.batches == (1, 4, 16, 32) and set(c.drafters) == {"model", "eagle"}
  assert set(c.temps) == {0.0, 1.0}
  assert config("trees_quick").trees[-1] == "auto"
  with pytest.raises(ConfigError, match="fixed trees"):
    tree_sweep.RUNNER.check(c.replace(trees=("auto",)))
  # a dynamic tree runs as a point of its own, never auto's
  with pytest.raises(ConfigError, match="fixed trees"):
    tree_sweep.RUNNER.check(c.replace(trees=("dynamic:2,2,4", "auto")))
  c = c.replace(trees=("dynamic:2,2,4",))
  tree_sweep.RUNNER.check(c)
  assert tree_sweep.static_trees(tree_sweep.fixed_trees(c)) == {}
  with pytest.raises(ConfigError, match="not a fixed tree"):
    c.replace(trees=("auto:4,8",))


def _micro() -> SweepConfig:
  return config("trees_quick", trees=("chain:2", "kary:2,2", "auto"), batches=(2,),
                n_predict=10, ctx_size=48, reps=1)


def check_resume(tmp_path):
  c = _micro()
  first = run(c, tmp_path, only=2)
  assert [r["tree"] for r in first] == ["chain:2", "kary:2,2"]
  path = tmp_path / "results.jsonl"
  lines = path.read_text().splitlines()
  path.write_text(lines[0] + "\n" + lines[1][:30])  # killed while writing the second
  records = run(c, tmp_path, resume=True)
  assert [r["tree"] for r in records] == ["chain:2", "kary:2,2", "auto"]
  kept = [json.loads(l) for l in path.read_text().splitlines()]
  assert len(kept) == 3 and kept[0] == json.loads(lines[0])  # not redone
  return records


def test_tree_sweep_resumes_after_an_interruption(tmp_path):
  records = check_resume(tmp_path)
  for r in records:
    assert set(r) <= set(schema.FIELDS)
  kary = records[1]
  assert kary["tree_nodes"] == 6 and kary["tokens_per_step_predicted"] == pytest.approx(
      1 + 0.8 + 0.2 * 0.4 + 0.8 * (0.8 + 0.08) + 0.08 * (0.8 + 0.08))
  assert kary["p_by_rank"][0] == pytest.approx(0.8, abs=0.25)
  assert records[2]["auto_trees"] == ["chain:2", "kary:2,2"]
  summary = (tmp_path / "summary.md").read_text()
  assert "Crossover batch" in summary and "Machine: " in summary and "## Noise" in summary
  assert (tmp_path / "trees.png").stat().st_size > 0


GRAFT = "dynamic:2,2,3+ngram:2"


def check_skips(tmp_path):
  """layerskip:1's plain dynamic tree measured at both temperatures, the
  trees it and n-gram cannot draft skipped."""
  c = _micro().replace(target="tiny", drafters=("ngram", "layerskip:1"),
                       trees=("dynamic:2,2,3", GRAFT), batches=(1,), temps=(0.0, 1.0),
                       accepts=("real",), n_predict=8)
  records = run(c, tmp_path)
  assert sorted((r["drafter"], r["tree"], r["temperature"]) for r in records) == [
      ("layerskip:1", "dynamic:2,2,3", 0.0), ("layerskip:1", "dynamic:2,2,3", 1.0)]
  assert all(r["t_draft_s"] > 0 and r["tokens_per_step"] >= 1 for r in records)


def test_dynamic_trees_of_a_shared_cache_drafter_and_of_ngram(tmp_path, capsys):
  """layerskip:1 drafts on the target's cache: its dynamic tree's cost probe
  (DynamicCostProbe) runs on a prefilled one and the point is measured at
  both temperatures; the n-gram drafter has no draft distribution to rank a
  dynamic tree with, and layerskip cannot graft a lookup chain (an EAGLE
  head's): each such tree is skipped with one line, and the drafter's other
  trees of the same kind still run (the skip once keyed by kind dropped the
  plain tree's T = 1 point after the graft's T = 0 one failed)."""
  check_skips(tmp_path)
  out, summary = capsys.readouterr().out, (tmp_path / "summary.md").read_text()
  for line in ("drafter ngram:1-4, dynamic tree dynamic:2,2,3: skipped (drafter ngram:1-4 "
               "drafts static trees only",
               f"drafter layerskip:1, dynamic tree {GRAFT}: skipped (--tree={GRAFT} grafts"):
    assert line in out and line in summary
  assert out.count("skipped (") == 3  # each tree that cannot run once, not once per temperature


def _cache_copies(fn, probe) -> int:
  """Cache-shaped copies in fn's compiled program (the probe's arguments)."""
  shape = "f32[%s]" % ",".join(map(str, probe.tcache.k[0].shape))
  text = fn.lower(probe.dparams, probe.dstate, probe.tcache, probe.tail, probe.n,
                  jax.random.PRNGKey(0), sc=probe.sc, k=4).compile().as_text()
  return sum(" copy(" in line and shape in line for line in text.splitlines())


def test_the_dynamic_probe_carries_the_shared_cache_and_copies_none():
  """layerskip:1 writes its drafts into the target's cache: the probe's loop
  carries that cache (donated), so the timed program copies no cache-sized
  array; the loop that closed over it (the probe before 2026-12-05) copied
  the written layer's K and V, overstating the draft's cost."""

  cfg = get_preset("tiny").replace(dtype="float32")
  probe = engine.DynamicCostProbe(registry.parse("layerskip:1"),
                                  steps.Runner(cfg, llama.init_params(cfg, 0)), None,
                                  trees.DynamicTree(2, 2, 3), 256, 40, k=4)

  @functools.partial(jax.jit, static_argnames=("sc", "k"))
  def closed_over(dparams, dstate, tcache, tail, n, key, *, sc, k):  # the deliberate bug
    live = jnp.ones(n.shape, bool)
    body = lambda i, acc: acc + jnp.sum(sc.drafter.propose_tree(
        dparams, dstate, tcache, tail, n - i % 2, live, jax.random.fold_in(key, i), sc)[0].tokens)
    return jax.lax.fori_loop(0, k, body, jnp.int32(0))

  assert _cache_copies(closed_over, probe) > 0
  assert _cache_copies(engine._repeat_propose_tree, probe) == 0  # pylint: disable=protected-access
  assert probe.time(1) > 0 and probe.tcache.lengths.tolist() == [39]


def _crossover_first_win(orig):
  del orig
  def crossover(best):  # the first batch where the chain wins, whatever follows
    bs = sorted(b for b, v in best.items() if "tree" in v and "chain" in v)
    return next((b for b in bs if best[b]["chain"] >= best[b]["tree"]), None)
  return crossover


def _resume_forgets(orig):
  del orig
  return lambda rec: ("never",)


MUTATIONS = {
    "crossover at the first chain win": (tree_report, "crossover", _crossover_first_win,
                                         lambda tmp: check_crossover()),
    "finished points forgotten on resume": (points, "tree_point_key", _resume_forgets,
                                            check_resume),
    "a tree that cannot run skips its whole kind": (
        tree_sweep, "skip_key", lambda _: lambda p: (p.drafter, p.kind), check_skips),
}


@pytest.mark.parametrize("bug", list(MUTATIONS))
def test_each_deliberate_bug_fails(tmp_path, monkeypatch, bug):
  module, name, make, check = MUTATIONS[bug]
  monkeypatch.setattr(module, name, make(getattr(module, name)))
  with pytest.raises(AssertionError):
    check(tmp_path)
