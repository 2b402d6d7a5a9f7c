"""The transformers versions the built-in policies support, in one place.

The policies patch HF modules by their attribute names, forward signatures and
attention interface, which change between transformers releases; outside the
range below they fail in ways that do not mention the version (wrong shapes,
missing sub-modules, numbers that differ).  So shardformer checks the
installed version when it first needs transformers: at import of
shardformer.policies and in autopolicy.get_autopolicy.  `import shardformer`
alone neither imports transformers nor checks it.

pyproject.toml's `hf` and `test` extras repeat TRANSFORMERS_REQUIREMENT
(tests/test_transformers_version.py checks that they agree);
requirements-compat.txt pins TRANSFORMERS_MIN, the lower end CI runs
(scripts/test_compat.sh); requirements-dev.txt pins the version the main
suite runs (scripts/test.sh), inside the range.

SHARDFORMER_SKIP_VERSION_CHECK=1 turns the error into a warning.
"""
from __future__ import annotations

import os
import re
import sys
import warnings
from importlib.metadata import PackageNotFoundError, distribution

# Measured on every 5.x minor and 4.57.6 (the whole suite, and the model tests
# tests/test_models*.py, test_sharder.py, test_checkpoints.py):
#   5.15.0 ... 5.20.2: everything passes.
#   5.9 - 5.14: the model tests pass, but T5 reaches HF's attention-function
#     interface only from 5.15, so enable_flash_attention leaves T5 on HF's
#     attention (tests/test_attention.py::test_flash_attention[T5...]).
#   5.0 - 5.8: the model tests fail (ViT/BEiT/Swin attention still
#     query/key/value, Gemma's embedding scale, Gemma 3/BLIP-2/SigLIP
#     attention); 4.57 more so (Mixtral's experts, T5, Whisper as well).
#   5.21 - 5.23: BLOOM fails (the model builds ALiBi from its slopes directly,
#     bypassing the policy's per-rank build_alibi_tensor).
# TRANSFORMERS_BELOW is the first release not supported.
TRANSFORMERS_MIN = "5.15.0"
TRANSFORMERS_BELOW = "5.21"
TRANSFORMERS_REQUIREMENT = f"transformers>={TRANSFORMERS_MIN},<{TRANSFORMERS_BELOW}"
SKIP_ENV = "SHARDFORMER_SKIP_VERSION_CHECK"

_VERSION_RE = re.compile(r"^\s*v?(\d+(?:\.\d+)*)(.*)$")


class TransformersVersionError(ImportError):
    """The installed transformers is outside the range the policies support."""


def _release(version: str) -> tuple[tuple[int, ...], bool] | None:
    """("5.18.0" -> ((5, 18, 0), True)); the flag is False for pre-releases
    (a/b/rc/dev), which PEP 440 orders before their release.  None when the
    string does not start with a release number."""
    m = _VERSION_RE.match(version)
    if m is None:
        return None
    nums = tuple(int(p) for p in m.group(1).split("."))
    nums = nums + (0,) * (3 - len(nums)) if len(nums) < 3 else nums
    rest = m.group(2).split("+", 1)[0].lower()  # drop a local label ("+cpu")
    final = not re.search(r"(a|b|c|rc|alpha|beta|pre|preview|dev)\d*", rest)
    return nums, final


def is_supported(version: str) -> bool | None:
    """Whether `version` is in [TRANSFORMERS_MIN, TRANSFORMERS_BELOW);
    None when it cannot be parsed."""
    v = _release(version)
    if v is None:
        return None
    lo, _ = _release(TRANSFORMERS_MIN)
    hi, _ = _release(TRANSFORMERS_BELOW)
    nums, final = v
    # >=MIN excludes MIN's own pre-releases; <BELOW excludes BELOW's (PEP 440).
    return (nums > lo or (nums == lo and final)) and nums < hi


def installed_transformers_version() -> tuple[str | None, str]:
    """(version, where it was found) without importing transformers: the
    imported module's __version__ when it is already imported, otherwise the
    installed distribution's metadata; (None, "") when there is none."""
    mod = sys.modules.get("transformers")
    version = getattr(mod, "__version__", None) if mod is not None else None
    if isinstance(version, str):
        return version, getattr(mod, "__file__", None) or "transformers"
    try:
        dist = distribution("transformers")
    except PackageNotFoundError:
        return None, ""
    return dist.version, str(dist.locate_file("transformers"))


def version_error_message(version: str, where: str = "") -> str:
    at = f" (at {where})" if where else ""
    lines = [
        f"shardformer's policies support {TRANSFORMERS_REQUIREMENT!r}; "
        f"the installed transformers is {version}{at}.",
        f"Fix: pip install \"{TRANSFORMERS_REQUIREMENT}\"",
    ]
    major = _release(version)
    if major is not None and major[0][0] < 5:
        lines.append("transformers 4.x is not supported: the policies rely on transformers 5's modules "
                     "(the attention-function interface, the vision models' q/k/v projections, "
                     "Mixtral's experts, the Gemma and SigLIP module structure).")
    else:
        lines.append("Outside this range the policies do not match transformers' modules: sharded models "
                     "fail or give wrong numbers.")
    lines.append(f"To try anyway, set {SKIP_ENV}=1 (the error becomes a warning).")
    return "\n".join(lines)


_accepted: set[str] = set()


def check_transformers_version(version: str | None = None, where: str = "") -> str | None:
    """Raise TransformersVersionError when transformers is installed outside
    the supported range (a warning instead when SHARDFORMER_SKIP_VERSION_CHECK
    is set).  `version` defaults to the installed one; returns the version
    checked, or None when transformers is not installed.  Never imports
    transformers."""
    if version is None:
        version, where = installed_transformers_version()
        if version is None:
            return None
    if version in _accepted:
        return version
    ok = is_supported(version)
    if ok is None:
        warnings.warn(f"shardformer: cannot parse the transformers version {version!r}; "
                      f"the policies support {TRANSFORMERS_REQUIREMENT!r}.", RuntimeWarning, stacklevel=2)
    elif not ok:
        msg = version_error_message(version, where)
        if os.environ.get(SKIP_ENV, "").strip() not in ("", "0"):
            warnings.warn(f"{msg}\n({SKIP_ENV} is set: going on.)", RuntimeWarning, stacklevel=2)
        else:
            raise TransformersVersionError(msg)
    _accepted.add(version)
    return version
