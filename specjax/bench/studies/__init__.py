"""One-off studies: each measures one question once (engines, layouts, the
GPU check, the paper's numbers); the sweep harness is bench/sweep/."""
