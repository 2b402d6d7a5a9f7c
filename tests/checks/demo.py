"""Rank-side runner of examples/tp_demo.py in the rank pool (tests/test_demo.py).

`rank_main(ctx, args, plan)` is what a rank that the demo spawns does:
`tp_demo.rank_main(rank, args, plan)`, in the pool's world, whose size is the
demo's process count (tests/conftest.py's world_pool(n)), so the pool's
already started processes stand in for new ones.  The rank's log lines (the
demo writes them to file descriptor 1, where the ranks share a terminal) are
captured and returned with its result, for the test to read as it would read
the demo's output.
"""
from __future__ import annotations

import os
import sys
import tempfile

EXAMPLES = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "examples")


def rank_main(ctx, args, plan) -> tuple[dict, str]:
    """(the demo's result on this rank, the lines it wrote to its standard output)."""
    if EXAMPLES not in sys.path:
        sys.path.insert(0, EXAMPLES)
    import tp_demo

    sys.stdout.flush()
    saved = os.dup(1)
    with tempfile.TemporaryFile() as out:
        os.dup2(out.fileno(), 1)
        try:
            result = tp_demo.rank_main(ctx.rank, args, plan)
        finally:
            sys.stdout.flush()
            os.dup2(saved, 1)
            os.close(saved)
        out.seek(0)
        return result, out.read().decode()
