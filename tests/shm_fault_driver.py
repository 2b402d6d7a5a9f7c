"""Fault scenarios of the shared-memory collectives, for tests/test_shm_faults.py.

    python tests/shm_fault_driver.py SO SCENARIO [ARG]

SO        the _C build to load ("-": the in-place build next to the package),
          loaded as shardformer._C with ExtensionFileLoader and without
          importing the package, so a process starts in a fraction of a
          second (no torch: tensors are NumPy arrays, which speak DLPack)
SCENARIO  one of SCENARIOS below
Prints one line, "RESULT <json>", with what the scenario saw.

The ranks of a group are threads of this process, each with its own mapping
of one segment (rank 0 creates it, the others attach): the collectives
release the GIL, so the threads meet in shared memory as processes would.
Only the interrupt scenario needs a second process (a signal goes to a
process's main thread).  Every scenario runs in a child process so that a C
core that crashes (an unmapped segment, a wrapped size) fails a test instead
of killing pytest; the same command runs them under AddressSanitizer (see
test_shm_faults.py's docstring).
"""
from __future__ import annotations

import glob
import importlib.machinery
import importlib.util
import json
import mmap
import os
import secrets
import signal
import struct
import subprocess
import sys
import threading
import time

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))


def load_C(so: str):
    """The _C build at `so` ("-": the one `import shardformer` would load, installed or
    editable; found without running the package's code) as module shardformer._C."""
    if so == "-":
        spec = importlib.util.find_spec("shardformer")   # top level: runs no package code
        folders = spec.submodule_search_locations if spec is not None else []
        found = [f for d in folders for f in glob.glob(os.path.join(d, "_C*.so"))]
        if len(found) != 1:
            raise RuntimeError(f"expected one build of shardformer._C in {list(folders)}, found {found}")
        so = found[0]
    loader = importlib.machinery.ExtensionFileLoader("shardformer._C", so)
    spec = importlib.util.spec_from_file_location("shardformer._C", so, loader=loader)
    mod = importlib.util.module_from_spec(spec)
    sys.modules["shardformer._C"] = mod
    loader.exec_module(mod)
    return mod


def label(nranks: int) -> str:
    return f"shm group of global ranks {list(range(nranks))}"


def make_group(C, nranks, timeout=3.0, workspace=4096, p2p=256, oneshot_max=1 << 20):
    """Communicators of ranks 0..nranks-1 over one new segment (unlinked at once)."""
    name = f"/shardformer-{os.getpid()}-faults-{secrets.token_hex(6)}"
    nonce = secrets.randbits(63)
    comms = [C.shm_create(name, nranks, workspace, p2p, nonce)]
    try:
        comms += [C.shm_attach(name, nranks, r, nonce) for r in range(1, nranks)]
    finally:
        C.shm_unlink(name)
    for comm in comms:
        C.shm_configure(comm, label(nranks), timeout, oneshot_max)
    return comms, name


def outcome(fn):
    """("ok", value) or (exception type name, message)."""
    try:
        return ("ok", fn())
    except BaseException as e:  # noqa: BLE001 - reported, not handled
        return (type(e).__name__, str(e))


def on_ranks(fns, join_s=15.0):
    """Run fns[r]() on thread r, all at once; their outcomes ("hung" when a
    thread is still inside after join_s: a wait that should have failed)."""
    out = [("hung", "")] * len(fns)

    def run(r):
        out[r] = outcome(fns[r])

    threads = [threading.Thread(target=run, args=(r,), daemon=True) for r in range(len(fns))]
    for t in threads:
        t.start()
    deadline = time.monotonic() + join_s
    for t in threads:
        t.join(max(0.0, deadline - time.monotonic()))
    return out


def maps_of(name: str) -> int:
    """How many mappings of segment `name` this process has."""
    with open("/proc/self/maps") as f:
        return sum(1 for line in f if f"/dev/shm{name}" in line)


# ---- the calls the ranks make ----------------------------------------------------

def all_reduce(C, comm, n, dtype="float32", op="sum", algo=0, fill=1):
    x = np.full(n, fill, dtype=dtype)
    C.shm_all_reduce(comm, x, op, algo)
    return x[:4].tolist()


def all_gather(C, comm, nbytes, nranks=2):
    out = np.empty(nranks * nbytes, dtype=np.uint8)
    C.shm_all_gather(comm, out, np.ones(nbytes, dtype=np.uint8))
    return out[:4].tolist()


def reduce_scatter(C, comm, n, nranks=2):
    out = np.empty(n, dtype=np.float32)
    C.shm_reduce_scatter(comm, out, np.ones(nranks * n, dtype=np.float32))
    return out[:4].tolist()


def all_to_all(C, comm, nbytes, nranks=2, rank=0):
    """nbytes per block; block q of rank r's input is bytes r + 1."""
    out = np.empty(nranks * nbytes, dtype=np.uint8)
    C.shm_all_to_all(comm, out, np.full(nranks * nbytes, rank + 1, dtype=np.uint8))
    return out[:4].tolist()


def a2a_input(rank, nranks, n, dtype="float32"):
    """Rank r's all_to_all input: element k of block q is 1000 * r + q * n + k
    (as dtype), so every received element names its sender and place."""
    return (np.arange(nranks * n) + 1000 * rank).astype(dtype)


def a2a_expected(rank, nranks, n, dtype="float32"):
    return np.concatenate([a2a_input(q, nranks, n, dtype)[rank * n:(rank + 1) * n]
                           for q in range(nranks)]) if n else np.empty(0, dtype)


def broadcast(C, comm, n, root):
    x = np.full(n, 7, dtype=np.float32)
    C.shm_broadcast(comm, x, root)
    return x[:4].tolist()


def correct_calls(C, comm, rank, nranks):
    """Collectives every rank makes alike: their values, to prove the group
    still works after a failed call."""
    small = np.full(4, rank + 1, dtype=np.float32)
    C.shm_all_reduce(comm, small)
    big = np.arange(3000, dtype=np.float32) * (rank + 1)  # several chunks of a 2 KiB half
    C.shm_all_reduce(comm, big, "sum", 2)
    tri = nranks * (nranks + 1) // 2
    gathered = np.empty(nranks * 700, dtype=np.float32)
    C.shm_all_gather(comm, gathered, np.full(700, rank, dtype=np.float32))
    swapped = np.empty(nranks * 750, dtype=np.float32)  # blocks of 3000 bytes: several rounds
    C.shm_all_to_all(comm, swapped, a2a_input(rank, nranks, 750))
    return (small.tolist() == [float(tri)] * 4
            and bool(np.array_equal(big, np.arange(3000, dtype=np.float32) * tri))
            and bool(np.array_equal(swapped, a2a_expected(rank, nranks, 750)))
            and gathered.reshape(nranks, 700)[:, 0].tolist() == [float(q) for q in range(nranks)])


# Each case: what each rank calls (a function of C, comm, rank), 2 ranks
# unless the list is longer.
MISMATCH_CASES = {
    "count": [lambda C, c, r: all_reduce(C, c, 4), lambda C, c, r: all_reduce(C, c, 8)],
    "dtype": [lambda C, c, r: all_reduce(C, c, 4), lambda C, c, r: all_reduce(C, c, 4, "int32")],
    "op": [lambda C, c, r: all_reduce(C, c, 4), lambda C, c, r: all_reduce(C, c, 4, op="max")],
    "kind": [lambda C, c, r: all_reduce(C, c, 4), lambda C, c, r: all_gather(C, c, 32)],
    "root": [lambda C, c, r: broadcast(C, c, 4, 0), lambda C, c, r: broadcast(C, c, 4, 1)],
    "zero": [lambda C, c, r: all_reduce(C, c, 0), lambda C, c, r: all_reduce(C, c, 4)],
    "chunks": [lambda C, c, r: all_reduce(C, c, 5000), lambda C, c, r: all_reduce(C, c, 100)],
    "barrier": [lambda C, c, r: C.shm_barrier(c), lambda C, c, r: all_reduce(C, c, 4)],
    "reduce_scatter": [lambda C, c, r: reduce_scatter(C, c, 4),
                       lambda C, c, r: all_reduce(C, c, 8)],
    "three_ranks": [lambda C, c, r: all_reduce(C, c, 4), lambda C, c, r: all_reduce(C, c, 4),
                    lambda C, c, r: all_reduce(C, c, 8)],
    "all_to_all_kind": [lambda C, c, r: all_to_all(C, c, 16, rank=r),
                        lambda C, c, r: all_gather(C, c, 32)],
    "all_to_all_count": [lambda C, c, r: all_to_all(C, c, 16, rank=r),
                         lambda C, c, r: all_to_all(C, c, 32, rank=r)],
    "all_to_all_chunks": [lambda C, c, r: all_to_all(C, c, 3000, rank=r),
                          lambda C, c, r: all_to_all(C, c, 100, rank=r)],
    "all_to_all_zero": [lambda C, c, r: all_to_all(C, c, 0, rank=r),
                        lambda C, c, r: all_to_all(C, c, 4, rank=r)],
    "all_to_all_three": [lambda C, c, r: all_to_all(C, c, 8, 3, r),
                         lambda C, c, r: all_to_all(C, c, 8, 3, r),
                         lambda C, c, r: all_reduce(C, c, 6)],
}


def scenario_mismatch(C, arg=None):
    """Each case of MISMATCH_CASES on a fresh group, then correct calls on
    the same group; also different oneshot_max per rank (the algorithm)."""
    res = {}
    for case, fns in MISMATCH_CASES.items():
        comms, _ = make_group(C, len(fns))
        p = len(fns)
        calls = on_ranks([lambda r=r: fns[r](C, comms[r], r) for r in range(p)])
        after = on_ranks([lambda r=r: correct_calls(C, comms[r], r, p) for r in range(p)])
        res[case] = {"calls": calls, "after": after}
        for comm in comms:
            C.shm_close(comm)
    # Different SHARDFORMER_SHM_ONESHOT_MAX per rank: 256 bytes takes one-shot
    # on rank 0 (limit 1 MiB), reduce-scatter + all-gather on rank 1 (limit 0).
    comms, _ = make_group(C, 2)
    C.shm_configure(comms[1], label(2), 3.0, 0)
    calls = on_ranks([lambda r=r: all_reduce(C, comms[r], 64) for r in range(2)])
    C.shm_configure(comms[1], label(2), 3.0, 1 << 20)
    after = on_ranks([lambda r=r: correct_calls(C, comms[r], r, 2) for r in range(2)])
    res["algo"] = {"calls": calls, "after": after}
    for comm in comms:
        C.shm_close(comm)
    # Matching calls with nothing to move still meet and succeed.
    comms, _ = make_group(C, 2)
    calls = on_ranks([lambda r=r: (all_reduce(C, comms[r], 0), all_gather(C, comms[r], 0),
                                   broadcast(C, comms[r], 0, 1), all_to_all(C, comms[r], 0, rank=r))
                      for r in range(2)])
    res["empty"] = {"calls": calls}
    for comm in comms:
        C.shm_close(comm)
    res["single"] = scenario_single_rank(C)
    return res


def send(C, comm, n, dtype, dst):
    C.shm_send(comm, np.arange(n, dtype=dtype), dst)
    return "sent"


def recv(C, comm, n, dtype, src):
    x = np.zeros(n, dtype=dtype)
    C.shm_recv(comm, x, src)
    return x[:4].tolist()


# (sender's count and dtype, receiver's count and dtype); p2p boxes of 256 bytes.
P2P_CASES = {
    "send4_recv8": ((1, "float32"), (2, "float32")),
    "send8_recv4": ((2, "float32"), (1, "float32")),
    "dtype": ((2, "float32"), (2, "int32")),
    "chunks": ((250, "float32"), (2, "float32")),  # 1000 bytes: 4 chunks to drain
    "empty": ((0, "float32"), (1, "float32")),
}


def scenario_p2p_mismatch(C, arg=None):
    """Each case: rank 0 sends, rank 1 receives something else; then a
    correct message each way."""
    comms, _ = make_group(C, 2)
    res = {}
    for case, ((sn, sdt), (rn, rdt)) in P2P_CASES.items():
        calls = on_ranks([lambda: send(C, comms[0], sn, sdt, 1),
                          lambda: recv(C, comms[1], rn, rdt, 0)])
        after = on_ranks([lambda: (send(C, comms[0], 300, "int64", 1),
                                   recv(C, comms[0], 3, "float32", 1)),
                          lambda: (recv(C, comms[1], 300, "int64", 0),
                                   send(C, comms[1], 3, "float32", 0))])
        res[case] = {"calls": calls, "after": after}
    for comm in comms:
        C.shm_close(comm)
    return res


def scenario_timeout_abort(C, arg=None):
    """3 ranks; rank 1 never arrives.  Rank 0 (timeout 1 s) times out; rank 2
    (timeout 30 s) must fail as soon as rank 0 has; a later call of rank 1
    must fail at once.  arg "all_to_all": ranks 0 and 2 call all_to_all
    (blocks of 3000 bytes, several rounds) instead of all_reduce."""
    if arg == "all_to_all":
        def call(r):
            return all_to_all(C, comms[r], 3000, 3, r)
    else:
        def call(r):
            return all_reduce(C, comms[r], 4)
    comms, _ = make_group(C, 3)
    C.shm_configure(comms[0], label(3), 1.0, 1 << 20)
    C.shm_configure(comms[2], label(3), 30.0, 1 << 20)
    t0 = time.monotonic()
    stamps = [None, None, None]

    def timed(r):
        try:
            return call(r)
        finally:
            stamps[r] = time.monotonic() - t0

    calls = on_ranks([lambda: timed(0), lambda: None, lambda: timed(2)], join_s=10.0)
    t1 = time.monotonic()
    late = outcome(lambda: call(1))
    res = {"calls": calls, "elapsed": stamps, "late": late, "late_s": time.monotonic() - t1}
    for comm in comms:
        C.shm_close(comm)
    return res


def _rank0_in_flight(C, comm, x):
    """Start rank 0's all_reduce of x on a thread; returns (thread, outcome dict)."""
    done = {}

    def rank0():
        done["rank0"] = outcome(lambda: (C.shm_all_reduce(comm, x), x[:3].tolist())[1])

    t = threading.Thread(target=rank0, daemon=True)
    t.start()
    time.sleep(0.3)  # inside the call, waiting for rank 1
    return t, done


def scenario_close_in_flight(C, arg=None):
    """Rank 0's all_reduce waits (on a thread) for rank 1 while this thread
    closes rank 0's communicator.  Then rank 1 arrives: the call in flight
    must finish with the right values, and the segment must be unmapped only
    after it returns."""
    comms, name = make_group(C, 2, timeout=10.0)
    t, done = _rank0_in_flight(C, comms[0], np.full(1000, 1.0, dtype=np.float32))
    res = {"maps_before": maps_of(name)}
    t0 = time.monotonic()
    res["close"] = outcome(lambda: C.shm_close(comms[0]))
    res["close_s"] = time.monotonic() - t0
    res["after_close"] = outcome(lambda: all_reduce(C, comms[0], 4))
    res["info_after_close"] = outcome(lambda: C.shm_info(comms[0]))
    res["maps_in_flight"] = maps_of(name)
    res["rank1"] = outcome(lambda: all_reduce(C, comms[1], 1000, fill=2))
    t.join(10.0)
    res["rank0"] = done.get("rank0", ("hung", ""))
    res["maps_after"] = maps_of(name)
    res["close_again"] = outcome(lambda: C.shm_close(comms[0]))
    C.shm_close(comms[1])
    res["maps_end"] = maps_of(name)
    return res


def scenario_overlap(C, arg=None):
    """While rank 0's all_reduce waits on a thread, a second call and a
    reconfiguration of the same communicator from this thread are refused;
    the call in flight then completes normally."""
    comms, _ = make_group(C, 2, timeout=10.0)
    t, done = _rank0_in_flight(C, comms[0], np.full(1000, 1.0, dtype=np.float32))
    res = {"overlap": outcome(lambda: all_reduce(C, comms[0], 4)),
           "configure": outcome(lambda: C.shm_configure(comms[0], "x", 1.0, 0))}
    res["rank1"] = outcome(lambda: all_reduce(C, comms[1], 1000, fill=2))
    t.join(10.0)
    res["rank0"] = done.get("rank0", ("hung", ""))
    res["after"] = on_ranks([lambda r=r: correct_calls(C, comms[r], r, 2) for r in range(2)])
    for comm in comms:
        C.shm_close(comm)
    return res


def scenario_sizes(C, arg=None):
    """Segments whose size overflows: refused with the value named, nothing
    left behind."""
    res = {}
    for case, (nranks, workspace, p2p) in {
        "workspace_2_62_4_ranks": (4, 2**62, 1 << 16),
        "workspace_max": (2, 2**63 - 1, 1 << 16),
        "p2p_2_62": (2, 1 << 16, 2**62),
        "p2p_max_64_ranks": (64, 1 << 16, 2**63 - 1),
    }.items():
        name = f"/shardformer-{os.getpid()}-faults-{secrets.token_hex(6)}"
        got = outcome(lambda: C.shm_create(name, nranks, workspace, p2p, 1))
        if got[0] == "ok":  # the bug: a wrapped size made a small segment
            C.shm_unlink(name)
            got = ("ok", repr(got[1]))
        res[case] = {"got": got, "values": [workspace, p2p],
                     "left": os.path.exists(f"/dev/shm{name}")}
    return res


HEADER = struct.Struct("<6Q")  # magic, nonce, nranks, half, p2p, total


def scenario_forged_header(C, arg=None):
    """Rank 0's segment with its header rewritten in /dev/shm, then attached.
    The forged sizes keep the file's total under 64-bit wrap-around (half +
    2**62 times 4 halves is the same number modulo 2**64), so only checked
    arithmetic can tell."""
    res = {}
    for case in ("half_wraps", "p2p_wraps", "half_unaligned", "total_too_big", "nranks"):
        name = f"/shardformer-{os.getpid()}-faults-{secrets.token_hex(6)}"
        nonce = 12345
        comm = C.shm_create(name, 2, 4096, 256, nonce)
        try:
            with open(f"/dev/shm{name}", "r+b") as f, mmap.mmap(f.fileno(), HEADER.size) as m:
                magic, nonce_, nranks, half, p2p, total = HEADER.unpack(m[:HEADER.size])
                if case == "half_wraps":
                    half += 2**62
                elif case == "p2p_wraps":
                    p2p += 2**62
                elif case == "half_unaligned":
                    half += 64
                elif case == "total_too_big":
                    total += 128
                else:
                    nranks = 3
                m[:HEADER.size] = HEADER.pack(magic, nonce_, nranks, half, p2p, total)
            res[case] = {"got": outcome(lambda: repr(C.shm_attach(name, 2, 1, nonce))),
                         "half": half, "p2p": p2p}
        finally:
            C.shm_unlink(name)
            C.shm_close(comm)
    return res


def scenario_configure_message(C, arg=None):
    comms, _ = make_group(C, 1)
    got = outcome(lambda: C.shm_configure(comms[0], "x", -1.5, 0))
    C.shm_close(comms[0])
    return {"got": got}


def scenario_single_rank(C, arg=None):
    """A group of one: every collective returns at once with the input."""
    comms, _ = make_group(C, 1)
    c = comms[0]
    got = outcome(lambda: (all_reduce(C, c, 5, fill=3), all_gather(C, c, 5, 1),
                           reduce_scatter(C, c, 4, 1), broadcast(C, c, 3, 0),
                           C.shm_barrier(c), all_to_all(C, c, 5, 1)))
    C.shm_close(c)
    return {"got": got}


# ---- Ctrl-C: rank 0 in a child process, rank 1 here ---------------------------

class CustomInterrupt(Exception):
    """What the 'custom' handler of interrupt_rank0 raises."""


def scenario_interrupt_rank0(C, handler):
    """Child side: create the segment, print its name, wait for the parent
    to attach, then block in an all_reduce (timeout 60 s) that rank 1 never
    joins, until a signal interrupts it.  Prints what came out and when."""
    handler, _, call = handler.partition(":")
    if handler == "custom":
        def raise_custom(signum, frame):
            raise CustomInterrupt("raised by the SIGINT handler")
        signal.signal(signal.SIGINT, raise_custom)
    else:
        # Python's own handler, set explicitly: a child of a shell without job
        # control (nohup ... &, some CI runners) starts with SIGINT ignored, and
        # Python then leaves it ignored.
        signal.signal(signal.SIGINT, signal.default_int_handler)
    name = f"/shardformer-{os.getpid()}-faults-{secrets.token_hex(6)}"
    comm = C.shm_create(name, 2, 4096, 256, 99)
    C.shm_configure(comm, label(2), 60.0, 1 << 20)
    print(json.dumps({"name": name}), flush=True)
    sys.stdin.readline()  # the parent has attached
    C.shm_unlink(name)
    x = np.ones(4, dtype=np.float32)
    print(json.dumps({"blocking": True}), flush=True)
    t0 = time.monotonic()
    try:
        if call == "all_to_all":
            C.shm_all_to_all(comm, np.empty(2000, dtype=np.float32),
                             np.ones(2000, dtype=np.float32))
        else:
            C.shm_all_reduce(comm, x)
        got = ("ok", "")
    except BaseException as e:  # noqa: BLE001
        got = (type(e).__name__, str(e))
    return {"got": got, "elapsed": time.monotonic() - t0}


def scenario_interrupt(C, handler="default", so="-"):
    """Parent side: start rank 0 (interrupt_rank0) in a child, attach as rank
    1, SIGINT the child 0.5 s after it blocked, then call a collective here."""
    cmd = [sys.executable, os.path.abspath(__file__), so, "interrupt_rank0", handler]
    child = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        name = json.loads(child.stdout.readline())["name"]
        comm = C.shm_attach(name, 2, 1, 99)
        C.shm_configure(comm, label(2), 60.0, 1 << 20)
        child.stdin.write("attached\n")
        child.stdin.flush()
        assert json.loads(child.stdout.readline())["blocking"]
        time.sleep(0.5)
        child.send_signal(signal.SIGINT)
        t0 = time.monotonic()
        got = []  # the child's RESULT line ("" if it died), read within 10 s
        reader = threading.Thread(target=lambda: got.append(child.stdout.readline()), daemon=True)
        reader.start()
        reader.join(10.0)
        seen_s = time.monotonic() - t0
        line = got[0] if got else "(no answer within 10 s)"
        res = {"child": json.loads(line.split(" ", 1)[1]) if line.startswith("RESULT ") else line,
               "child_seen_s": seen_s}
        t0 = time.monotonic()
        res["peer"] = outcome(lambda: all_reduce(C, comm, 4))
        res["peer_s"] = time.monotonic() - t0
        C.shm_close(comm)
        if got:
            child.wait(10)
        res["child_rc"] = child.poll()
        return res
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()


def scenario_all_to_all(C, arg=None):
    """shm_all_to_all on its own: values on 2 and 3 ranks (one round, several
    rounds of a 4 KiB and of a 256-byte workspace, blocks that are not whole
    lines, every dtype size), in place (out is tensor), nothing to move; a
    partial overlap and bad arguments refused on one rank before it meets
    the others, the group going on after."""
    res = {}
    for nranks, workspace in ((2, 4096), (3, 4096), (2, 256), (3, 256), (4, 256)):
        comms, _ = make_group(C, nranks, workspace=workspace)
        cases = [(n, dt) for n in (0, 1, 7, 16, 750, 1001) for dt in ("uint8", "float16",
                                                                      "float32", "int64")]

        def values(r, comms=comms, nranks=nranks, cases=cases):
            bad = []
            for n, dt in cases:
                t = a2a_input(r, nranks, n, dt)
                out = np.full_like(t, 99)
                C.shm_all_to_all(comms[r], out, t)
                ok = np.array_equal(out, a2a_expected(r, nranks, n, dt))
                ok = ok and np.array_equal(t, a2a_input(r, nranks, n, dt))  # input untouched
                C.shm_all_to_all(comms[r], t, t)  # in place
                if not (ok and np.array_equal(t, a2a_expected(r, nranks, n, dt))):
                    bad.append([n, dt])
            return bad

        res[f"values_{nranks}_{workspace}"] = on_ranks([lambda r=r: values(r)
                                                        for r in range(nranks)], join_s=60.0)
        for comm in comms:
            C.shm_close(comm)
    comms, _ = make_group(C, 2)
    c = comms[0]
    buf = np.zeros(64, dtype=np.float32)
    x8, ro = np.zeros(8, dtype=np.float32), np.zeros(8, dtype=np.float32)
    ro.flags.writeable = False
    refused = {
        "overlap_out_above": lambda: C.shm_all_to_all(c, buf[2:10], buf[:8]),
        "overlap_out_below": lambda: C.shm_all_to_all(c, buf[:8], buf[7:15]),
        "numel": lambda: C.shm_all_to_all(c, np.zeros(6, np.float32), x8),
        "indivisible": lambda: C.shm_all_to_all(c, np.zeros(7, np.float32),
                                                np.zeros(7, np.float32)),
        "dtype": lambda: C.shm_all_to_all(c, np.zeros(8, np.int32), x8),
        "read_only": lambda: C.shm_all_to_all(c, ro, x8),
        "strided_out": lambda: C.shm_all_to_all(c, buf[::2][:8], x8),
        "not_a_tensor": lambda: C.shm_all_to_all(c, [1.0] * 8, x8),
        "not_a_comm": lambda: C.shm_all_to_all(object(), np.zeros(8, np.float32), x8),
        "args": lambda: C.shm_all_to_all(c, x8),
    }
    res["refused"] = {case: outcome(fn) for case, fn in refused.items()}
    # touching is not overlapping: out starts where tensor ends
    buf[32:40] = a2a_input(0, 2, 4)
    out1 = np.empty(8, dtype=np.float32)
    res["adjacent"] = on_ranks([
        lambda: (C.shm_all_to_all(comms[0], buf[40:48], buf[32:40]),
                 bool(np.array_equal(buf[40:48], a2a_expected(0, 2, 4))))[1],
        lambda: (C.shm_all_to_all(comms[1], out1, a2a_input(1, 2, 4)),
                 bool(np.array_equal(out1, a2a_expected(1, 2, 4))))[1]])
    res["after"] = on_ranks([lambda r=r: correct_calls(C, comms[r], r, 2) for r in range(2)])
    C.shm_close(comms[1])
    C.shm_close(comms[0])
    res["closed"] = outcome(lambda: C.shm_all_to_all(c, np.zeros(8, np.float32), x8))
    return res


SCENARIOS = {
    "mismatch": scenario_mismatch,
    "all_to_all": scenario_all_to_all,
    "p2p_mismatch": scenario_p2p_mismatch,
    "timeout_abort": scenario_timeout_abort,
    "close_in_flight": scenario_close_in_flight,
    "overlap": scenario_overlap,
    "sizes": scenario_sizes,
    "forged_header": scenario_forged_header,
    "configure_message": scenario_configure_message,
    "interrupt_rank0": scenario_interrupt_rank0,
    "interrupt": scenario_interrupt,
}


def run(python: str, so: str, scenario: str, arg: str | None = None, env=None,
        timeout: float = 60.0) -> dict:
    """Run one scenario in a child (python, this file) and return its result;
    AssertionError with the child's output when it crashed or printed none."""
    cmd = [python, os.path.abspath(__file__), so, scenario] + ([arg] if arg else [])
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    if proc.returncode != 0 or not lines:
        raise AssertionError(f"{scenario} exited with {proc.returncode}\nstdout:\n"
                             f"{proc.stdout[-3000:]}\nstderr:\n{proc.stderr[-6000:]}")
    return json.loads(lines[-1].split(" ", 1)[1])


def main(argv) -> None:
    so, scenario = argv[1], argv[2]
    arg = argv[3] if len(argv) > 3 else None
    C = load_C(so)
    fn = SCENARIOS[scenario]
    if scenario == "interrupt":
        result = fn(C, arg or "default", so)
    else:
        result = fn(C, arg)
    print("RESULT " + json.dumps(result), flush=True)


if __name__ == "__main__":
    main(sys.argv)
