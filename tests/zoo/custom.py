"""A user-defined model (not from transformers) and the Policy a user would write for it."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from shardformer import ModulePolicyDescription, Policy, SubModuleReplacementDescription as Sub
from shardformer.layer import Linear1D_Col, Linear1D_Row, VocabParallelEmbedding1D, VocabParallelLMHead1D
from shardformer.layout import Heads


class ToyAttention(nn.Module):
    def __init__(self, dim, heads):
        super().__init__()
        self.heads, self.head_dim = heads, dim // heads
        self.qkv = nn.Linear(dim, 3 * dim)
        self.out = nn.Linear(dim, dim)

    def forward(self, x):
        b, t, _ = x.shape
        q, k, v = self.qkv(x).view(b, t, 3, self.heads, self.head_dim).unbind(2)
        y = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True)
        return self.out(y.transpose(1, 2).reshape(b, t, -1))


class ToyBlock(nn.Module):
    def __init__(self, dim, heads, hidden):
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.attn = ToyAttention(dim, heads)
        self.fc1, self.fc2 = nn.Linear(dim, hidden), nn.Linear(hidden, dim)

    def forward(self, x):
        x = x + self.attn(self.norm(x))
        return x + self.fc2(F.gelu(self.fc1(x)))


class ToyModel(nn.Module):
    def __init__(self, vocab=77, dim=40, heads=5, hidden=70, layers=2):
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.blocks = nn.ModuleList(ToyBlock(dim, heads, hidden) for _ in range(layers))
        self.head = nn.Linear(dim, vocab, bias=False)

    def forward(self, input_ids, labels=None):
        x = self.embed(input_ids)
        for block in self.blocks:
            x = block(x)
        logits = self.head(x)
        out = {"logits": logits}
        if labels is not None:
            out["loss"] = F.cross_entropy(logits.flatten(0, 1), labels.flatten())
        return out


class ToyPolicy(Policy):
    """Attention q|k|v is one fused Linear laid out [q | k | v] with heads
    inside each third: the views in ToyAttention expect each rank's local
    [q_i | k_i | v_i].  The head count lives on the module as `heads`."""

    def module_policy(self):
        heads = Heads(5, 5, 8)
        return {
            ToyBlock: ModulePolicyDescription(
                attribute_replacement={"attn.heads": heads.local_heads()},
                sub_module_replacement=[
                    Sub("attn.qkv", Linear1D_Col, kwargs={"split": heads.qkv}),
                    Sub("attn.out", Linear1D_Row, kwargs={"split": heads.q}),
                    Sub("fc1", Linear1D_Col),
                    Sub("fc2", Linear1D_Row),
                ],
            ),
            ToyModel: ModulePolicyDescription(
                sub_module_replacement=[
                    Sub("embed", VocabParallelEmbedding1D, kwargs={"make_vocab_size_divisible_by": 8}),
                    Sub("head", VocabParallelLMHead1D, kwargs={"make_vocab_size_divisible_by": 8}),
                ],
            ),
        }


class ToyStarPolicy(Policy):
    """The same split, written from the top with '*' over the block list and
    string keys (as for remote-code classes)."""

    def module_policy(self):
        heads = Heads(5, 5, 8)
        return {
            "ToyModel": ModulePolicyDescription(
                sub_module_replacement=[
                    Sub("blocks.*.attn.qkv", Linear1D_Col, kwargs={"split": heads.qkv}),
                    Sub("blocks.*.attn.out", Linear1D_Row, kwargs={"split": heads.q}),
                    Sub("blocks.*.fc1", Linear1D_Col),
                    Sub("blocks.*.fc2", Linear1D_Row),
                    Sub("blocks.*.missing_adapter", Linear1D_Col, ignore_if_not_exist=True),
                    Sub("embed", VocabParallelEmbedding1D),
                ],
            ),
            f"{ToyAttention.__module__}.ToyAttention": ModulePolicyDescription(
                attribute_replacement={"heads": heads.local_heads()},
            ),
        }


def toy_inputs():
    g = torch.Generator().manual_seed(5)
    ids = torch.randint(0, 77, (2, 9), generator=g)
    return {"input_ids": ids, "labels": ids}
