"""The task suite's report over the categories whose sweeps have finished
(the run was stopped for time): the same rows, noise notes and report as
taskbench_run.run_taskbench, read from the workdir instead of executed."""
import os, sys
sys.path.insert(0, os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..", "..")))
from configs import sweep_gamma as sg
from specjax import workdir as wd
from specjax.bench.sweep import noise, taskbench_report, taskbench_run
from specjax.bench.sweep.config import SweepConfig

work = sys.argv[1]
c = sg.get_config("taskbench")
c.taskbench_suite = "eval"
c.drafters = ("ngram", "eagle:smollm2-eagle", "model:vocab=8192", "eagle3")
c.taskbench_trees = ("eagle3@dynamic:4,4,16", "eagle3@auto")
c.taskbench_prompts = 2
c.gammas = (4,)
c.temps = (0.0,)
c.reps = 2
cfg = SweepConfig.from_mapping(c)
done = []
records, notes = [], []
for s in taskbench_run.sweeps(cfg, work):
  path = os.path.join(s.workdir, "results.jsonl")
  if not os.path.exists(path):
    continue
  got = wd.read_jsonl(path)
  want = 4 if s.drafter is None else 2
  if len(got) < want:
    continue
  done.append(s.category)
  records += s.rows(got)
  found = noise.assess(got, cfg.noise_threshold)
  if found["noisy"]:
    notes.append(f"**Noisy sweep** ({s.workdir}): likely cause: {found['cause']}.")
cats = sorted(set(done))
notes.append(f"Partial: the categories whose sweeps finished: {', '.join(cats)} (the run was stopped for time).")
taskbench_report.write_report(work, records, cfg, notes)
print("categories:", cats)
