"""The sweep harness (harness.py) and its runners: the gamma sweep
(gamma.py), the trees sweep (trees.py) and the task suite (taskbench_run.py),
with their typed config (config.py), their one door into the engine
(engine.py), their cost model (costs.py), noise check (noise.py) and reports."""
