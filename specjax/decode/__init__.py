"""Generation: sampling, acceptance rules, target-only generation, the
speculative loop and auto gamma."""
