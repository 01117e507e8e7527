"""Studies and benchmarks: cost probes, llama-bench, the roofline, the gamma
sweep, batch scaling, the PyTorch and llama.cpp backends and their reports."""
