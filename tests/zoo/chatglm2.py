"""A small local model with ChatGLM2's module tree and attribute names (its
real code ships with checkpoints as remote code, outside transformers).

    transformer.embedding.word_embeddings         [padded_vocab_size, hidden]
    transformer.rotary_pos_emb                     rotary frequencies (no weights)
    transformer.encoder.layers[i]: GLMBlock        run by index, i in range(encoder.num_layers)
        input_layernorm                            RMSNorm
        self_attention: SelfAttention
            query_key_value                        [q (heads*kv_channels) | k (groups*kv_channels) | v (same)]
            core_attention: CoreAttention          softmax(q k^T / sqrt(d)) v, causal
            dense                                  [heads*kv_channels -> hidden]
        post_attention_layernorm                   RMSNorm
        mlp: MLP                                   dense_h_to_4h -> [gate | up], SwiGLU, dense_4h_to_h
    transformer.encoder.final_layernorm            RMSNorm
    transformer.output_layer                       LM head [hidden -> padded_vocab_size]

Between the embedding and the output layer the tensors are [seq, batch,
hidden], as in ChatGLM2's remote code (the embedding transposes its output;
ChatGLMModel returns [seq, batch, hidden]; the LM transposes its logits
back to [batch, seq, vocab]); each block applies a hidden dropout of
probability hidden_dropout to the attention and MLP outputs before the
residual adds, as ChatGLM2's does.  The per-partition attributes are the ones a tensor-parallel policy
sets per rank: num_attention_heads_per_partition,
num_multi_query_groups_per_partition, hidden_size_per_partition.
"""
from __future__ import annotations

import math
from types import SimpleNamespace

import torch
import torch.nn.functional as F
from torch import nn


def chatglm2_config(**overrides):
    cfg = dict(hidden_size=48, num_attention_heads=6, kv_channels=8, multi_query_attention=True,
               multi_query_group_num=2, ffn_hidden_size=45, num_layers=2, padded_vocab_size=99,
               layernorm_epsilon=1e-5, add_bias_linear=False, add_qkv_bias=True, seq_length=64,
               tie_word_embeddings=False, hidden_dropout=0.0)
    cfg.update(overrides)
    return SimpleNamespace(**cfg)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


class RotaryEmbedding(nn.Module):
    """Rotation of the first half of each head's channels, in adjacent pairs."""

    def __init__(self, rot_dim: int):
        super().__init__()
        self.rot_dim = rot_dim

    def forward(self, seq_len: int, device=None):
        inv_freq = 1.0 / (10000 ** (torch.arange(0, self.rot_dim, 2, dtype=torch.float32, device=device)
                                    / self.rot_dim))
        angles = torch.outer(torch.arange(seq_len, dtype=torch.float32, device=device), inv_freq)
        return torch.stack([angles.cos(), angles.sin()], dim=-1)  # [seq, rot_dim/2, 2]


def apply_rotary(x, rope):
    """x [s, b, n, d]; rope [s, r/2, 2] rotates x[..., :r] pairwise."""
    r = rope.shape[-2] * 2
    rot, keep = x[..., :r], x[..., r:]
    pairs = rot.reshape(*rot.shape[:-1], r // 2, 2)
    cos, sin = rope[:, None, None, :, 0], rope[:, None, None, :, 1]
    a, b = pairs[..., 0], pairs[..., 1]
    out = torch.stack([a * cos - b * sin, b * cos + a * sin], dim=-1).flatten(-2)
    return torch.cat([out, keep], dim=-1)


class CoreAttention(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.hidden_size_per_attention_head = cfg.kv_channels
        self.num_attention_heads_per_partition = cfg.num_attention_heads
        self.hidden_size_per_partition = cfg.kv_channels * cfg.num_attention_heads

    def forward(self, q, k, v):
        """q, k, v [b, n, s, d] -> context [s, b, n*d]."""
        scores = q @ k.transpose(-1, -2) / math.sqrt(self.hidden_size_per_attention_head)
        s = q.shape[-2]
        causal = torch.ones(s, s, dtype=torch.bool, device=q.device).triu(1)
        probs = scores.masked_fill(causal, float("-inf")).softmax(-1)
        ctx = (probs @ v).permute(2, 0, 1, 3)
        return ctx.reshape(*ctx.shape[:2], self.hidden_size_per_partition)


class SelfAttention(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.hidden_size_per_attention_head = cfg.kv_channels
        self.num_attention_heads_per_partition = cfg.num_attention_heads
        self.multi_query_attention = cfg.multi_query_attention
        groups = cfg.multi_query_group_num if cfg.multi_query_attention else cfg.num_attention_heads
        self.num_multi_query_groups_per_partition = groups
        self.projection_size = cfg.kv_channels * cfg.num_attention_heads
        self.qkv_hidden_size = self.projection_size + 2 * cfg.kv_channels * groups
        self.query_key_value = nn.Linear(cfg.hidden_size, self.qkv_hidden_size,
                                         bias=cfg.add_bias_linear or cfg.add_qkv_bias)
        self.core_attention = CoreAttention(cfg)
        self.dense = nn.Linear(self.projection_size, cfg.hidden_size, bias=cfg.add_bias_linear)

    def forward(self, hidden_states, rope):
        d = self.hidden_size_per_attention_head
        n, g = self.num_attention_heads_per_partition, self.num_multi_query_groups_per_partition
        q, k, v = self.query_key_value(hidden_states).split([n * d, g * d, g * d], dim=-1)
        s, b = hidden_states.shape[:2]
        q, k, v = q.view(s, b, n, d), k.view(s, b, g, d), v.view(s, b, g, d)
        q, k = apply_rotary(q, rope), apply_rotary(k, rope)
        k = k.repeat_interleave(n // g, dim=2)
        v = v.repeat_interleave(n // g, dim=2)
        ctx = self.core_attention(*(t.permute(1, 2, 0, 3) for t in (q, k, v)))
        return self.dense(ctx)


class MLP(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.dense_h_to_4h = nn.Linear(cfg.hidden_size, 2 * cfg.ffn_hidden_size, bias=cfg.add_bias_linear)
        self.dense_4h_to_h = nn.Linear(cfg.ffn_hidden_size, cfg.hidden_size, bias=cfg.add_bias_linear)

    def forward(self, x):
        gate, up = self.dense_h_to_4h(x).chunk(2, dim=-1)
        return self.dense_4h_to_h(F.silu(gate) * up)


class GLMBlock(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.layernorm_epsilon)
        self.self_attention = SelfAttention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.layernorm_epsilon)
        self.mlp = MLP(cfg)
        self.hidden_dropout = cfg.hidden_dropout

    def forward(self, x, rope):
        attention = self.self_attention(self.input_layernorm(x), rope)
        x = x + F.dropout(attention, p=self.hidden_dropout, training=self.training)
        mlp = self.mlp(self.post_attention_layernorm(x))
        return x + F.dropout(mlp, p=self.hidden_dropout, training=self.training)


class GLMTransformer(nn.Module):
    """Runs its layers as ChatGLM2's remote code does: by index over
    range(self.num_layers), through _get_layer, not by iterating the list."""

    def __init__(self, cfg):
        super().__init__()
        self.num_layers = cfg.num_layers
        self.layers = nn.ModuleList([GLMBlock(cfg) for _ in range(cfg.num_layers)])
        self.final_layernorm = RMSNorm(cfg.hidden_size, cfg.layernorm_epsilon)

    def _get_layer(self, index: int) -> GLMBlock:
        return self.layers[index]

    def forward(self, x, rope):
        for index in range(self.num_layers):
            x = self._get_layer(index)(x, rope)
        return self.final_layernorm(x)


class Embedding(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.word_embeddings = nn.Embedding(cfg.padded_vocab_size, cfg.hidden_size)

    def forward(self, input_ids):
        """[b, s] -> [s, b, hidden]."""
        return self.word_embeddings(input_ids).transpose(0, 1).contiguous()


class ChatGLMModel(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.config = cfg
        self.embedding = Embedding(cfg)
        self.rotary_pos_emb = RotaryEmbedding(cfg.kv_channels // 2)
        self.encoder = GLMTransformer(cfg)
        self.output_layer = nn.Linear(cfg.hidden_size, cfg.padded_vocab_size, bias=False)

    def forward(self, input_ids, use_cache=None):
        """use_cache: taken as the remote code's forward takes it; this model
        keeps no KV cache, so it changes nothing."""
        x = self.embedding(input_ids)
        rope = self.rotary_pos_emb(input_ids.shape[1], device=x.device)
        return {"last_hidden_state": self.encoder(x, rope)}


class ChatGLMForConditionalGeneration(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.config = cfg
        self.transformer = ChatGLMModel(cfg)

    def forward(self, input_ids, labels=None):
        hidden = self.transformer(input_ids)["last_hidden_state"]
        logits = self.transformer.output_layer(hidden).transpose(0, 1).contiguous()
        out = {"logits": logits}
        if labels is not None:
            out["loss"] = F.cross_entropy(logits[:, :-1].flatten(0, 1), labels[:, 1:].flatten())
        return out

    @torch.no_grad()
    def greedy(self, input_ids, new_tokens: int):
        for _ in range(new_tokens):
            nxt = self(input_ids)["logits"][:, -1].argmax(-1, keepdim=True)
            input_ids = torch.cat([input_ids, nxt], dim=1)
        return input_ids
