"""Training: the optax/orbax loop, the stdlib corpus, the shipped pair's
pipeline and the EAGLE head's training."""
