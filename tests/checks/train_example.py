"""Rank-side runner of examples/train.py in the rank pool (tests/test_train_example.py).

`run_train(ctx, argv)` is what a torchrun rank of the example does after
`init_process_group`: `train.run(rank, parse_args(argv))`, in the pool's world
(all its ranks), so the pool's processes stand in for the ones torchrun would
start, without paying again for their start-up (importing torch and transformers).
Rank 0's output (the log and the PASS/FAIL line) is captured and returned with
the exit status.
"""
from __future__ import annotations

import contextlib
import io
import os
import sys

EXAMPLES = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "examples")


def run_train(ctx, argv: list) -> tuple[int, str]:
    """(exit status, rank 0's output) of examples/train.py with `argv` on this rank."""
    if EXAMPLES not in sys.path:
        sys.path.insert(0, EXAMPLES)
    import train

    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        status = train.run(ctx.rank, train.parse_args(argv))
    return status, out.getvalue()
