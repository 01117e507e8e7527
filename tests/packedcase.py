"""The ragged packed-verify case that the XLA and the PyTorch packed-verify
tests share (tests/model/test_packed_verify.py, tests/bench/test_torch_packed.py):
four rows of different cache lengths, and their blocks."""

CAPACITY = 48
LENGTHS = (3, 5, 11, 17)
GAMMA_MAX = 5
CASES = {"ragged": ((1, 2, 6, 4), 15),  # (tokens per row: tail + drafts, N)
         "tails only": ((1, 1, 1, 1), 4)}
STALE = 7.0  # every cache slot past a row's length holds this before a verify
