"""The targets of a batch, by the kind of head a zoo model has."""
from __future__ import annotations

import torch


def add_labels(x: dict, kind: str, num_labels: int, g: torch.Generator, batch: int, seq: int) -> dict:
    """Add to `x` (holding input_ids [batch, seq]) the targets of `kind`, drawn
    from `g`: causal_lm / mlm (ids, every other one ignored for mlm), seq_cls,
    token_cls, qa (start / end positions), pretraining (+ next sentence),
    sop (+ sentence order), nsp.  Other kinds get none.  Returns `x`."""
    if kind in ("causal_lm", "mlm"):
        x["labels"] = x["input_ids"].clone()
        if kind == "mlm":
            x["labels"][:, ::2] = -100
    elif kind == "seq_cls":
        x["labels"] = torch.randint(0, num_labels, (batch,), generator=g)
    elif kind == "token_cls":
        x["labels"] = torch.randint(0, num_labels, (batch, seq), generator=g)
    elif kind == "qa":
        x["start_positions"] = torch.randint(0, seq, (batch,), generator=g)
        x["end_positions"] = torch.randint(0, seq, (batch,), generator=g)
    elif kind == "pretraining":
        x["labels"] = x["input_ids"].clone()
        x["next_sentence_label"] = torch.randint(0, 2, (batch,), generator=g)
    elif kind == "sop":
        x["labels"] = x["input_ids"].clone()
        x["sentence_order_label"] = torch.randint(0, 2, (batch,), generator=g)
    elif kind == "nsp":
        x["labels"] = torch.randint(0, 2, (batch,), generator=g)
    return x
