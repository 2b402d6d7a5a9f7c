"""Directories that appear complete or not at all.

A checkpoint is written into a temporary sibling `.NAME.partial-XXXX`, every
file and directory fsynced, then put in place:

  * NAME does not exist: one rename.
  * NAME exists: the files of the old directory that are not checkpoint
    files (a tokenizer, a README: whatever CHECKPOINT_FILES does not match)
    and that the new directory does not hold are carried over (hard links);
    every weight file, index and manifest of the old checkpoint, of any of
    the formats (HF safetensors or .bin, one file or several, any variant;
    save_sharded's rank files), is superseded and left behind, so that NAME
    holds exactly one checkpoint.  Then
    the two directories are swapped in one step (Linux renameat2 with
    RENAME_EXCHANGE) and the old one removed.  A crash at any point leaves
    the old checkpoint or the new one under NAME.
  * Where RENAME_EXCHANGE is not available: NAME is renamed aside to
    `.NAME.old-XXXX`, the new directory renamed in, the old removed.  A crash
    between the two renames leaves NAME missing and the old checkpoint
    complete in `.NAME.old-XXXX`; recover_directory (which the next save
    runs first) renames it back.

Stale `.partial-` / `.old-` siblings of a killed save are removed by the next one.
"""
from __future__ import annotations

import ctypes
import errno
import os
import re
import secrets
import shutil
import tempfile

#: The files of a checkpoint of ours or HF's that a new save supersedes: HF's
#: weights (model[.VARIANT][-00001-of-0000N].safetensors, pytorch_model...bin),
#: their indexes (model.safetensors.index[.VARIANT].json, ...), and
#: save_sharded's rank files and manifest, torch.distributed.checkpoint's
#: files (save_state: __R_N.distcp, .metadata).  Other files are the user's.
CHECKPOINT_FILES = re.compile(
    r"(?:model|pytorch_model)(?:\.[\w-]+)?(?:-\d{5}-of-\d{5})?\.(?:safetensors|bin)"
    r"|(?:model\.safetensors|pytorch_model\.bin)\.index(?:\.[\w-]+)?\.json"
    r"|rank\d{5}-of-\d{5}\.safetensors|shardformer_manifest\.json"
    r"|__\d+_\d+\.distcp|\.metadata")


def save_target(path, who: str) -> str:
    """The directory a save into `path` writes: absolute, with symbolic links
    followed (a link to a directory saves into that directory; the link stays).
    ValueError before anything is written when it exists and is not a directory."""
    directory = os.path.realpath(os.path.abspath(os.fspath(path)))
    if os.path.lexists(directory) and not os.path.isdir(directory):
        shown = directory if directory == os.path.abspath(os.fspath(path)) else f"{os.fspath(path)} (-> {directory})"
        raise ValueError(f"{who}: {shown} exists and is not a directory")
    return directory


def fsync(path: str, directory: bool = False) -> None:
    fd = os.open(path, os.O_RDONLY | (getattr(os, "O_DIRECTORY", 0) if directory else 0))
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _fsync_tree(root: str) -> None:
    """fsync every file and directory under `root`, then `root` itself."""
    for path, dirs, files in os.walk(root, topdown=False):
        for f in files:
            p = os.path.join(path, f)
            if not os.path.islink(p):
                fsync(p)
        fsync(path, directory=True)


def _siblings(directory: str, kind: str) -> list[str]:
    parent, base = os.path.split(directory)
    prefix = f".{base}.{kind}-"
    try:
        found = [os.path.join(parent, n) for n in os.listdir(parent) if n.startswith(prefix)]
    except FileNotFoundError:
        return []
    return sorted(found, key=lambda p: os.lstat(p).st_mtime)


def recover_directory(directory) -> None:
    """Undo what a killed save left beside `directory`: if the name is
    missing and an old checkpoint was renamed aside (the fallback swap's
    window), rename it back; then remove every stale temporary sibling."""
    directory = os.path.abspath(os.fspath(directory))
    olds = _siblings(directory, "old")
    if olds and not os.path.lexists(directory):
        os.rename(olds.pop(), directory)
        fsync(os.path.dirname(directory), directory=True)
    for stale in olds + _siblings(directory, "partial"):
        shutil.rmtree(stale, ignore_errors=True)


def make_temp(directory: str) -> str:
    parent, base = os.path.split(directory)
    os.makedirs(parent, exist_ok=True)
    recover_directory(directory)
    return tempfile.mkdtemp(prefix=f".{base}.partial-", dir=parent)


_RENAME_EXCHANGE = 2
_AT_FDCWD = -100


def _exchange(a: str, b: str) -> bool:
    """Swap two paths in one step (Linux renameat2 RENAME_EXCHANGE); False
    where the system or the file system does not offer it."""
    try:
        fn = ctypes.CDLL(None, use_errno=True).renameat2
    except (AttributeError, OSError):
        return False
    fn.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
    fn.restype = ctypes.c_int
    if fn(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), _RENAME_EXCHANGE) == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.ENOSYS, errno.EINVAL, errno.EOPNOTSUPP, getattr(errno, "ENOTSUP", errno.EOPNOTSUPP)):
        return False
    raise OSError(err, f"renameat2(RENAME_EXCHANGE) {a} <-> {b}: {os.strerror(err)}")


def _link_or_copy(src: str, dst: str) -> None:
    try:
        os.link(src, dst)
    except OSError:
        shutil.copy2(src, dst)


def _carry_over(old: str, new: str) -> None:
    """Files of the existing directory that are not checkpoint files and
    that the new checkpoint does not replace (tokenizer, README,
    sub-directories) go into the new one."""
    for entry in os.scandir(old):
        dst = os.path.join(new, entry.name)
        if os.path.lexists(dst) or CHECKPOINT_FILES.fullmatch(entry.name):
            continue
        if entry.is_symlink():
            os.symlink(os.readlink(entry.path), dst)
        elif entry.is_dir():
            shutil.copytree(entry.path, dst, symlinks=True, copy_function=_link_or_copy)
        else:
            _link_or_copy(entry.path, dst)


def put_in_place(tmp: str, directory: str) -> None:
    """Make the complete temporary directory `tmp` the checkpoint `directory`
    (see the module docstring for what a crash leaves at each step)."""
    parent = os.path.dirname(directory)
    if not os.path.lexists(directory):
        _fsync_tree(tmp)
        os.rename(tmp, directory)
        fsync(parent, directory=True)
        return
    if not os.path.isdir(directory) or os.path.islink(directory):
        raise ValueError(f"save_pretrained: {directory} exists and is not a directory")
    _carry_over(directory, tmp)
    _fsync_tree(tmp)
    if _exchange(tmp, directory):
        fsync(parent, directory=True)
        shutil.rmtree(tmp, ignore_errors=True)         # now the old checkpoint
        return
    old = os.path.join(parent, f".{os.path.basename(directory)}.old-{secrets.token_hex(4)}")
    os.rename(directory, old)
    os.rename(tmp, directory)
    fsync(parent, directory=True)
    shutil.rmtree(old, ignore_errors=True)
