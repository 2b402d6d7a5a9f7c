"""How evenly the two candidate pipeline splits of Swin share the work
(docs/pipeline.md, "Swin and Swinv2").

    python benchmarks/swin_stage_balance.py            # Swin-T and Swin-B at 224, PP = 2 and 4

Counts the forward FLOPs of every block and patch merging of an HF Swin
(torch.utils.flop_counter on a meta-device model: no weights, no compute), then
finds the best contiguous split of
  (a) the Swin stages (blocks + patch merging: shardformer's split), and
  (b) the blocks and mergings one by one (a split by block),
into PP parts, and prints each split's largest part as a share of the total:
the step time of a pipeline is bound by its slowest stage, so 1/PP is perfect
balance and (largest share) * PP is the slowdown against it.  The embeddings
and the head are left out (small for Swin).  Also prints the message of each
edge of split (a) per image ([H*W, C] floats).
"""
from __future__ import annotations

import argparse

import torch
from torch.utils.flop_counter import FlopCounterMode

CONFIGS = {"swin-tiny": dict(embed_dim=96, depths=[2, 2, 6, 2], num_heads=[3, 6, 12, 24]),
           "swin-base": dict(embed_dim=128, depths=[2, 2, 18, 2], num_heads=[4, 8, 16, 32])}


def unit_flops(name: str) -> tuple[list[float], list[int], list[tuple[int, int]]]:
    """(FLOPs of each block / merging in order, Swin stage of each, (tokens, channels) entering each stage)."""
    from transformers import SwinConfig, SwinModel

    cfg = SwinConfig(image_size=224, patch_size=4, window_size=7, **CONFIGS[name])
    with torch.device("meta"):
        model = SwinModel(cfg)
        x = torch.randn(1, 3, 224, 224)
    flops, stage_of, entering = [], [], []
    h = w = 224 // 4
    hidden = torch.randn(1, h * w, cfg.embed_dim, device="meta")
    with torch.no_grad():
        for i, stage in enumerate(model.encoder.layers):
            entering.append((h * w, hidden.shape[-1]))
            for block in stage.blocks:
                with FlopCounterMode(display=False) as fc:
                    hidden = block(hidden, (h, w))[0]
                flops.append(fc.get_total_flops())
                stage_of.append(i)
            if stage.downsample is not None:
                with FlopCounterMode(display=False) as fc:
                    hidden = stage.downsample(hidden, (h, w))
                flops.append(fc.get_total_flops())
                stage_of.append(i)
                h, w = (h + 1) // 2, (w + 1) // 2
    del x
    return flops, stage_of, entering


def best_split(costs: list[float], parts: int) -> float:
    """The smallest possible largest part of a split of `costs` into `parts` contiguous runs (exhaustive DP)."""
    n = len(costs)
    prefix = [0.0]
    for c in costs:
        prefix.append(prefix[-1] + c)
    inf = float("inf")
    best = [[inf] * (n + 1) for _ in range(parts + 1)]
    best[0][0] = 0.0
    for k in range(1, parts + 1):
        for j in range(1, n + 1):
            best[k][j] = min((max(best[k - 1][i], prefix[j] - prefix[i]) for i in range(k - 1, j)), default=inf)
    return best[parts][n]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--pp", type=int, nargs="+", default=[2, 4])
    args = ap.parse_args()
    print("| model | PP | (a) by Swin stage: largest share (x ideal) | (b) by block: largest share (x ideal) |")
    print("|---|---|---|---|")
    notes = []
    for name in CONFIGS:
        flops, stage_of, entering = unit_flops(name)
        total = sum(flops)
        per_stage = [sum(f for f, s in zip(flops, stage_of) if s == i) for i in range(max(stage_of) + 1)]
        for pp in args.pp:
            a, b = best_split(per_stage, pp) / total, best_split(flops, pp) / total
            print(f"| {name} | {pp} | {a:.3f} ({a * pp:.2f}x) | {b:.3f} ({b * pp:.2f}x) |")
        shares = ", ".join(f"{c / total:.3f}" for c in per_stage)
        edges = ", ".join(f"[{t}, {c}]" for t, c in entering[1:])
        notes.append(f"{name}: {total / 1e9:.2f} GFLOP per image in the blocks; Swin stages' shares {shares}; "
                     f"messages entering Swin stages 1.. (per image) {edges}")
    print("\n" + "\n".join(notes))


if __name__ == "__main__":
    main()
