"""Who proposes the draft tokens: the interface, the draft model and layer
skip, n-gram lookup, the EAGLE head, and the registry that parses a spec."""
