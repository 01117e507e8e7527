"""Past one process: the local multi-process launcher and the per-device
memory plan of a sharded run."""
