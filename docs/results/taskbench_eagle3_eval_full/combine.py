"""The evaluation suite's report (issue 38) from three runs of the same
settings, read from their records instead of executed: the chains and
EAGLE-3's trees (main/), the EAGLE-1 head's tree with the lookup chain grafted
on (graft/: EAGLE-3 cannot graft), and EAGLE-3's dynamic tree at T = 1
(dyn_t1/: the main run skipped it, a trees-sweep bug fixed since). Each run's
sweeps are those taskbench_run.run_taskbench ran; noise verdicts as it gives
them.  python docs/results/taskbench_eagle3_eval_full/combine.py"""
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "..", ".."))
from configs import sweep_gamma as sg  # noqa: E402
from specjax import workdir as wd  # noqa: E402
from specjax.bench.sweep import noise, taskbench_report, taskbench_run  # noqa: E402
from specjax.bench.sweep.config import SweepConfig  # noqa: E402

RUNS = {  # folder: (chains, tree rows, temperatures), as each run's command gave them
    "main": (("ngram", "model", "model:vocab=8192", "eagle:smollm2-eagle", "eagle3"),
             ("eagle3@dynamic:4,4,16", "eagle3@auto", "eagle3@dynamic:4,4,16+ngram:8"),
             (0.0, 1.0)),
    "graft": ((), ("eagle:smollm2-eagle@dynamic:4,4,16+ngram:8",), (0.0, 1.0)),
    "dyn_t1": ((), ("eagle3@dynamic:4,4,16",), (1.0,)),
}


def config(drafters, trees, temps) -> SweepConfig:
  c = sg.get_config("taskbench")
  c.taskbench_suite, c.taskbench_prompts, c.gammas, c.reps = "eval", 2, (4,), 3
  c.drafters, c.taskbench_trees, c.temps = drafters, trees, temps
  return SweepConfig.from_mapping(c)


def main() -> None:
  records, notes = [], []
  for folder, spec in RUNS.items():
    cfg = config(*spec)
    for s in taskbench_run.sweeps(cfg, os.path.join(HERE, folder)):
      path = os.path.join(s.workdir, "results.jsonl")
      if not os.path.exists(path):
        sys.exit(f"{path}: missing (copy the run's workdir to {folder}/)")
      got = wd.read_jsonl(path)
      records += s.rows(got)
      found = noise.assess(got, cfg.noise_threshold)
      if found["noisy"]:
        notes.append(f"**Noisy sweep** ({os.path.relpath(s.workdir, HERE)}): likely cause: "
                     f"{found['cause']}.")
  taskbench_report.write_report(HERE, records, config(*RUNS["main"]), notes)
  print(f"{len(records)} rows -> {os.path.join(HERE, taskbench_report.REPORT)}")


if __name__ == "__main__":
  main()
