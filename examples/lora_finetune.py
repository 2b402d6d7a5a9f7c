"""LoRA fine-tuning (PEFT) of a tensor-parallel Llama, equal to the unsharded run.

    torchrun --nproc-per-node 2 examples/lora_finetune.py       # torchrun starts the ranks
    python examples/lora_finetune.py --nprocs 4                 # shardformer.launch.spawn starts them

Every rank builds the same small Llama (random weights from one seed), wraps
it with peft.get_peft_model(LoraConfig(...)) and shards the PeftModel with
ShardFormer: base layers and adapters are split together.  A few AdamW steps
train the adapters only (the base is frozen); rank 0 runs the same steps on
an unsharded copy and compares the losses.  peft_model.save_pretrained(dir)
(every rank calls it, rank 0 writes the gathered adapter) is then loaded with
PeftModel.from_pretrained into a fresh unsharded base, and its logits are
compared with the sharded model's; merge_and_unload() on the sharded model
gives the same logits again.  The exit status is non-zero on any mismatch.
"""
from __future__ import annotations

import argparse
import copy
import os
import sys
import tempfile

TOL = 1e-4          # relative, float32
STEPS = 4


def build_llama():
    import torch
    import transformers

    cfg = transformers.LlamaConfig(hidden_size=128, intermediate_size=344, num_hidden_layers=2,
                                   num_attention_heads=8, num_key_value_heads=4, vocab_size=256)
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(cfg)


def rel(a, b) -> float:
    return ((a - b).abs().max() / b.abs().max().clamp(min=1e-12)).item()


def rank_main(rank: int, out_dir: str) -> dict:
    """Runs on every rank of the default process group; returns rank 0's comparison."""
    import torch
    from peft import LoraConfig, PeftModel, get_peft_model

    from shardformer import ShardConfig, ShardFormer

    config = LoraConfig(r=8, lora_alpha=16,
                        target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"])
    peft_model = get_peft_model(build_llama(), config)              # the same adapters on every rank
    reference = copy.deepcopy(peft_model) if rank == 0 else None
    full = sum(p.numel() for p in peft_model.parameters() if p.requires_grad)
    ShardFormer(ShardConfig()).optimize(peft_model)                 # base layers and adapters, sharded
    local = sum(p.numel() for p in peft_model.parameters() if p.requires_grad)

    batch = torch.randint(0, 256, (4, 32), generator=torch.Generator().manual_seed(1))
    models = [peft_model.train()] + ([reference.train()] if reference is not None else [])
    opts = [torch.optim.AdamW([p for p in m.parameters() if p.requires_grad], lr=1e-3) for m in models]
    losses = [[] for _ in models]
    for _ in range(STEPS):
        for m, opt, curve in zip(models, opts, losses):
            loss = m(input_ids=batch, labels=batch).loss
            loss.backward()
            opt.step()
            opt.zero_grad()
            curve.append(loss.item())

    peft_model.eval()
    with torch.no_grad():
        logits = peft_model(input_ids=batch).logits
    peft_model.save_pretrained(out_dir)                             # every rank; rank 0 writes
    merged = peft_model.merge_and_unload()
    with torch.no_grad():
        merged_logits = merged(input_ids=batch).logits
    if rank != 0:
        return {"rank": rank}
    loaded = PeftModel.from_pretrained(build_llama(), out_dir).eval()    # plain PEFT, unsharded
    with torch.no_grad():
        loaded_logits = loaded(input_ids=batch).logits
    return {"rank": 0, "lora_params": (local, full), "losses": losses[0], "ref_losses": losses[1],
            "loss_err": max(abs(a - b) / abs(b) for a, b in zip(*losses)),
            "loaded_err": rel(loaded_logits, logits), "merged_err": rel(merged_logits, logits),
            "files": sorted(os.listdir(out_dir))}


def report(r0: dict, world: int) -> int:
    local, full = r0["lora_params"]
    print(f"LoRA on a Llama sharded over {world} ranks: {local} of its {full} LoRA parameters on rank 0 "
          f"-> {'OK' if local < full or world == 1 else 'NOT SHARDED'}; {STEPS} AdamW steps")
    print("  loss sharded:   " + " ".join(f"{v:.6f}" for v in r0["losses"]))
    print("  loss unsharded: " + " ".join(f"{v:.6f}" for v in r0["ref_losses"]))
    checks = {"losses": r0["loss_err"], "saved adapter in the unsharded base": r0["loaded_err"],
              "merge_and_unload": r0["merged_err"]}
    ok = local < full or world == 1
    for what, err in checks.items():
        ok &= err < TOL
        print(f"  {what}: max relative difference {err:.2e} -> {'OK' if err < TOL else 'MISMATCH'}")
    print(f"  adapter files: {', '.join(r0['files'])}")
    return 0 if ok else 1


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--nprocs", type=int, default=2, help="ranks to spawn (ignored under torchrun)")
    p.add_argument("--out", help="adapter directory (default: a temporary one)")
    args = p.parse_args(argv)
    out_dir = args.out or tempfile.mkdtemp(prefix="lora_adapter_")
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        import torch
        import torch.distributed as dist

        torch.set_num_threads(1)
        dist.init_process_group("gloo")                # MASTER_ADDR/PORT, RANK, WORLD_SIZE from the env
        try:
            out_dir = [out_dir]
            dist.broadcast_object_list(out_dir, 0)     # rank 0's directory everywhere
            result, world = rank_main(dist.get_rank(), out_dir[0]), dist.get_world_size()
        finally:
            dist.destroy_process_group()
        return report(result, world) if result["rank"] == 0 else 0
    from shardformer.launch import spawn

    results = spawn(rank_main, args.nprocs, args=(out_dir,))
    return report(results[0], args.nprocs)


if __name__ == "__main__":
    sys.exit(main())
