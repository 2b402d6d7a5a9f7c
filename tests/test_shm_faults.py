"""Faults of the shared-memory collectives (csrc/comm/shm_*.c, csrc/comm_module.c):
ranks that call different things, sizes that overflow, forged segment
headers, Ctrl-C inside a wait, a timeout on one rank, and a communicator
closed while a call is in flight.

Each test runs one scenario of tests/shm_fault_driver.py in a child process
(so a C core that crashes fails the test instead of killing pytest) and
checks what it saw.  In the scenarios the ranks of a group are threads of the
child, each with its own mapping of the segment; the interrupt scenario puts
rank 0 in a second process, since a signal goes to a process's main thread.

SHARDFORMER_SHM_FAULTS_SO=path runs the scenarios against another build of
_C (an older one, to watch the tests fail).  tests/test_asan.py runs every
scenario again against its AddressSanitizer build (run_all).
"""
from __future__ import annotations

import os
import sys

import pytest

import shm_fault_driver as drv

SO = os.environ.get("SHARDFORMER_SHM_FAULTS_SO", "-")
LABEL2 = "shm group of global ranks [0, 1]"


def run(scenario, arg=None, **kw):
    return drv.run(sys.executable, SO, scenario, arg, **kw)


# ---- collectives: every rank publishes its call, every rank checks ---------------

MISMATCH_MESSAGES = {
    "count": "rank 0 called all_reduce(sum, 16 bytes, float32, one-shot), "
             "rank 1 called all_reduce(sum, 32 bytes, float32, one-shot)",
    "dtype": "rank 1 called all_reduce(sum, 16 bytes, int32, one-shot)",
    "op": "rank 1 called all_reduce(max, 16 bytes, float32, one-shot)",
    "kind": "rank 0 called all_reduce(sum, 16 bytes, float32, one-shot), "
            "rank 1 called all_gather(32 bytes, uint8)",
    "root": "rank 0 called broadcast(root 0, 16 bytes, float32), "
            "rank 1 called broadcast(root 1, 16 bytes, float32)",
    "zero": "rank 0 called all_reduce(sum, 0 bytes, float32, one-shot), "
            "rank 1 called all_reduce(sum, 16 bytes, float32, one-shot)",
    "chunks": "rank 0 called all_reduce(sum, 20000 bytes, float32, one-shot), "
              "rank 1 called all_reduce(sum, 400 bytes, float32, one-shot)",
    "barrier": "rank 0 called barrier(), rank 1 called all_reduce(sum, 16 bytes",
    "reduce_scatter": "rank 0 called reduce_scatter(sum, 32 bytes, float32), "
                      "rank 1 called all_reduce(sum, 32 bytes, float32, one-shot)",
    "three_ranks": "rank 0 called all_reduce(sum, 16 bytes, float32, one-shot), "
                   "rank 2 called all_reduce(sum, 32 bytes, float32, one-shot)",
    "all_to_all_kind": "rank 0 called all_to_all(32 bytes, uint8), "
                       "rank 1 called all_gather(32 bytes, uint8)",
    "all_to_all_count": "rank 0 called all_to_all(32 bytes, uint8), "
                        "rank 1 called all_to_all(64 bytes, uint8)",
    "all_to_all_chunks": "rank 0 called all_to_all(6000 bytes, uint8), "
                         "rank 1 called all_to_all(200 bytes, uint8)",
    "all_to_all_zero": "rank 0 called all_to_all(0 bytes, uint8), "
                       "rank 1 called all_to_all(8 bytes, uint8)",
    "all_to_all_three": "rank 0 called all_to_all(24 bytes, uint8), "
                        "rank 2 called all_reduce(sum, 24 bytes, float32, one-shot)",
    # different SHARDFORMER_SHM_ONESHOT_MAX per rank
    "algo": "rank 0 called all_reduce(sum, 256 bytes, float32, one-shot), rank 1 called "
            "all_reduce(sum, 256 bytes, float32, reduce-scatter + all-gather)",
}


def check_mismatch(res):
    for case, want in MISMATCH_MESSAGES.items():
        calls, after = res[case]["calls"], res[case]["after"]
        nranks = len(calls)
        head = f"shm group of global ranks {list(range(nranks))}: collective mismatch at call #1: "
        assert [kind for kind, _ in calls] == ["RuntimeError"] * nranks, (case, calls)
        assert len({msg for _, msg in calls}) == 1, (case, calls)
        msg = calls[0][1]
        assert msg.startswith(head) and want in msg, (case, msg)
        assert after == [["ok", True]] * nranks, (case, after)
    # Matching calls that move nothing meet and succeed; a group of one
    # returns at once with its input.
    assert res["empty"]["calls"] == [["ok", [[], [], [], []]]] * 2
    single = res["single"]["got"]
    assert single == ["ok", [[3.0] * 4, [1] * 4, [1.0] * 4, [7.0] * 3, None, [1] * 4]], single


def test_mismatched_collectives_raise_on_every_rank_and_the_group_goes_on():
    """Different counts, dtypes, ops, calls, roots, algorithms, 0 against 4
    elements, one chunk against several, all_to_all against all_gather,
    another all_to_all (size, rounds, 0 bytes) or all_reduce: every rank raises RuntimeError with
    the same message naming both sides, and the next (correct) calls on the
    same communicators -- a small and a chunked all_reduce, an all_gather --
    return the right values on every rank."""
    check_mismatch(run("mismatch"))


P2P_MESSAGES = {
    "send4_recv8": "rank 1 expected 8 bytes float32 from rank 0, which sent 4 bytes float32",
    "send8_recv4": "rank 1 expected 4 bytes float32 from rank 0, which sent 8 bytes float32",
    "dtype": "rank 1 expected 8 bytes int32 from rank 0, which sent 8 bytes float32",
    "chunks": "rank 1 expected 8 bytes float32 from rank 0, which sent 1000 bytes float32",
    "empty": "rank 1 expected 4 bytes float32 from rank 0, which sent 0 bytes float32",
}


def check_p2p_mismatch(res):
    for case, want in P2P_MESSAGES.items():
        (skind, sval), (rkind, rmsg) = res[case]["calls"]
        assert (skind, sval) == ("ok", "sent"), (case, res[case])
        assert rkind == "RuntimeError" and rmsg.startswith(LABEL2) and want in rmsg, (case, rmsg)
        assert res[case]["after"] == [["ok", ["sent", [0.0, 1.0, 2.0]]],
                                      ["ok", [[0, 1, 2, 3], "sent"]]], (case, res[case])


def test_mismatched_send_recv_raise_on_the_receiver_and_the_pair_goes_on():
    """send 4 / recv 8, send 8 / recv 4, same bytes of another dtype, a
    4-chunk message against an 8-byte recv, an empty one: the sender
    completes, the receiver raises naming both sides, and a correct exchange
    both ways (a 10-chunk message included) works after each."""
    check_p2p_mismatch(run("p2p_mismatch"))


# ---- aborts: a failure on one rank reaches the others ------------------------------

def check_timeout_abort(res, call="all_reduce"):
    (k0, m0), _, (k2, m2) = res["calls"]
    assert k0 == "TimeoutError" and "on rank 0; ranks that did not arrive: 1" in m0, m0
    assert f"{call} timed out after 1 s on rank 0" in m0, m0
    assert k2 == "TimeoutError", (k2, m2)
    assert f"{call} on rank 2 stopped because rank 0 timed out" in m2, m2
    assert "ranks that did not arrive: 1" in m2, m2
    assert res["elapsed"][2] < 3.0, res["elapsed"]
    kind, msg = res["late"]
    assert kind == "RuntimeError" and "broken because rank 0 timed out" in msg, res["late"]
    assert res["late_s"] < 0.5


def test_timeout_on_one_rank_fails_the_others_promptly():
    """Rank 1 never arrives; rank 0 (timeout 1 s) times out.  Rank 2, whose
    own timeout is 30 s, fails right after with a TimeoutError naming rank 0
    and the missing rank; a later call of rank 1 fails at once."""
    check_timeout_abort(run("timeout_abort"))


def test_timeout_in_all_to_all_fails_the_others_promptly():
    """The same with all_to_all (blocks of 3000 bytes, several rounds of the
    2 KiB half) on ranks 0 and 2."""
    check_timeout_abort(run("timeout_abort", "all_to_all"), "all_to_all")


def check_interrupt(res, handler):
    handler = handler.partition(":")[0]
    child = res["child"]
    assert isinstance(child, dict), res
    if handler == "default":
        assert child["got"] == ["KeyboardInterrupt", ""], child
    else:
        assert child["got"] == ["CustomInterrupt", "raised by the SIGINT handler"], child
    assert child["elapsed"] < 2.5 and res["child_seen_s"] < 2.0, res
    assert res["child_rc"] == 0, res
    kind, msg = res["peer"]
    assert kind == "RuntimeError" and msg.startswith(LABEL2), res["peer"]
    assert "rank 0 was interrupted" in msg, msg
    assert res["peer_s"] < 1.0, res


@pytest.mark.parametrize("handler", ["default", "custom"])
def test_ctrl_c_interrupts_a_blocked_collective(handler):
    """Rank 0 (a process of its own, timeout 60 s) blocks in an all_reduce
    rank 1 never joins; SIGINT 0.5 s later ends it within a fraction of a
    second with the exception the SIGINT handler raises, unchanged
    (KeyboardInterrupt, or the custom handler's own exception).  Rank 1's
    next call then fails at once naming rank 0, instead of waiting 60 s."""
    check_interrupt(run("interrupt", handler, timeout=90), handler)


def test_ctrl_c_interrupts_a_blocked_all_to_all():
    """The same with rank 0 blocked in an all_to_all."""
    check_interrupt(run("interrupt", "default:all_to_all", timeout=90), "default")


# ---- lifetime: close during a call, overlapping calls --------------------------------

def check_close_in_flight(res):
    assert res["close"] == ["ok", None] and res["close_s"] < 0.1, res
    assert res["after_close"] == ["ValueError", "shm communicator is closed"], res
    assert res["info_after_close"] == ["ValueError", "shm communicator is closed"], res
    assert res["maps_before"] == 2 and res["maps_in_flight"] == 2, res
    assert res["rank1"] == ["ok", [3.0, 3.0, 3.0, 3.0]], res
    assert res["rank0"] == ["ok", [3.0, 3.0, 3.0]], res
    assert res["maps_after"] == 1 and res["maps_end"] == 0, res
    assert res["close_again"] == ["ok", None]


def test_close_during_a_call_unmaps_after_it():
    """shm_close from another thread while rank 0's all_reduce waits: it
    returns at once and later calls say "closed", but the segment stays
    mapped until the call (completed by rank 1) returns the right values."""
    check_close_in_flight(run("close_in_flight"))


def check_overlap(res):
    kind, msg = res["overlap"]
    assert kind == "RuntimeError" and "another thread" in msg, res
    assert res["configure"][0] == "RuntimeError", res
    assert res["rank0"] == ["ok", [3.0, 3.0, 3.0]] and res["rank1"][0] == "ok", res
    assert res["after"] == [["ok", True]] * 2


def test_overlapping_calls_on_one_communicator_are_refused():
    """A second call, or shm_configure, on a communicator whose call is in
    flight on another thread raises instead of racing it."""
    check_overlap(run("overlap"))


# ---- sizes -----------------------------------------------------------------------------

def check_sizes(res):
    for case, r in res.items():
        kind, msg = r["got"]
        huge = max(r["values"])
        assert kind == "ValueError" and str(huge) in msg, (case, r)
        assert not r["left"], case


def test_segment_sizes_that_overflow_are_refused():
    """workspace 2**62 on 4 ranks (4 x 2 halves of 2**61 wrap to 0), 2**63-1,
    p2p 2**62, p2p 2**63-1 on 64 ranks: ValueError naming the value, no
    segment left behind."""
    check_sizes(run("sizes"))


def check_forged_header(res):
    for case, r in res.items():
        kind, msg = r["got"]
        assert kind == "ValueError", (case, r)
    assert str(res["half_wraps"]["half"]) in res["half_wraps"]["got"][1]
    assert "forged" in res["half_wraps"]["got"][1]
    assert str(res["p2p_wraps"]["p2p"]) in res["p2p_wraps"]["got"][1]


def test_forged_segment_header_is_refused():
    """A header rewritten after rank 0 made the segment: sizes that wrap to
    the real total under unchecked 64-bit arithmetic (half or p2p + 2**62),
    a half that is not whole lines, a total beyond the file, another rank
    count: attach raises ValueError naming the forged value, never maps a
    segment with sizes that do not fit."""
    check_forged_header(run("forged_header"))


def check_configure_message(res):
    kind, msg = res["got"]
    assert kind == "ValueError" and "timeout=-1.5 s" in msg and "%" not in msg, msg


def test_configure_message_prints_the_number():
    """PyErr_Format has no %g: the message used to print a literal '%g'."""
    check_configure_message(run("configure_message"))


# ---- all_to_all on its own -------------------------------------------------------------

def check_all_to_all(res):
    for case in ("values_2_4096", "values_3_4096", "values_2_256", "values_3_256", "values_4_256"):
        nranks = int(case.split("_")[1])
        assert res[case] == [["ok", []]] * nranks, (case, res[case])
    r = res["refused"]
    for case in ("overlap_out_above", "overlap_out_below"):
        assert r[case] == ["ValueError", f"{LABEL2}: all_to_all: input and output overlap"], r
    assert r["numel"] == ["ValueError", "shm_all_to_all: out has 6 elements but tensor has 8; "
                                        "all_to_all needs the same number"], r
    assert r["indivisible"][0] == "ValueError" and "not divisible into 2" in r["indivisible"][1], r
    assert r["dtype"] == ["TypeError", "out has dtype int32 but tensor has dtype float32"], r
    assert r["read_only"][0] == "ValueError" and "read-only" in r["read_only"][1], r
    assert r["strided_out"][0] == "ValueError" and "contiguous" in r["strided_out"][1], r
    assert r["not_a_tensor"][0] == "TypeError" and "__dlpack__" in r["not_a_tensor"][1], r
    assert r["not_a_comm"][0] == "TypeError" and "shm communicator" in r["not_a_comm"][1], r
    assert r["args"][0] == "TypeError", r
    assert res["adjacent"] == [["ok", True]] * 2, res["adjacent"]
    assert res["after"] == [["ok", True]] * 2, res["after"]
    assert res["closed"] == ["ValueError", "shm communicator is closed"], res["closed"]


def test_all_to_all_values_in_place_and_refusals():
    """Values on 2-4 ranks over one and several rounds (a 4 KiB and a 256-byte
    workspace, blocks of 0, 1, 7, 16, 750 and 1001 elements of 1, 2, 4 and 8
    bytes), the input left as it was, the same in place; a partial overlap of
    out and tensor either way and bad arguments raise on the one rank before
    it meets the others, blocks that only touch are fine, and the group goes
    on; a closed communicator says so."""
    check_all_to_all(run("all_to_all"))


# ---- the same scenarios under AddressSanitizer -------------------------------------

CHECKS = {
    "mismatch": check_mismatch,
    "p2p_mismatch": check_p2p_mismatch,
    "timeout_abort": check_timeout_abort,
    "close_in_flight": check_close_in_flight,
    "overlap": check_overlap,
    "sizes": check_sizes,
    "forged_header": check_forged_header,
    "configure_message": check_configure_message,
    "all_to_all": check_all_to_all,
}


def run_all(python: str, so: str, env: dict) -> None:
    """Every scenario (the interrupt with both handlers) against the build `so`;
    test_asan.py runs this against its AddressSanitizer build."""
    for scenario, check in CHECKS.items():
        check(drv.run(python, so, scenario, env=env, timeout=180))
    check_timeout_abort(drv.run(python, so, "timeout_abort", "all_to_all", env=env, timeout=180),
                        "all_to_all")
    for handler in ("default", "custom", "default:all_to_all"):
        check_interrupt(drv.run(python, so, "interrupt", handler, env=env, timeout=180), handler)
