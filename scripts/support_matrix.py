"""Generate README's support matrix from the policy registry and the test results.

    python scripts/support_matrix.py                  # run the model tests, print the table
    python scripts/support_matrix.py --write README.md
    python scripts/support_matrix.py --junit results.xml --write README.md

Rows are the model families of shardformer.autopolicy; a cell counts the
classes of that family for which every test of that feature passed (and no
test of it failed).  A feature is a test function name, see FEATURES.
Nothing in the table is written by hand.
"""
from __future__ import annotations

import argparse
import glob
import os
import re
import subprocess
import sys
import tempfile
import xml.etree.ElementTree as ET
from collections import defaultdict

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "python"))

# column -> test function names that prove it
FEATURES = {
    "tensor parallel (TP=2,4)": ("test_fp32_forward_backward_step",),
    "generate()": ("test_generate_matches_unsharded",),
    "bf16": ("test_bf16_forward",),
    "fused normalization": ("test_fused_normalization", "test_fused_normalization_every_family"),
    "jit fused": ("test_models_with_fused_kernels", "test_jit_fused_every_family"),
    "flash attention": ("test_flash_attention",),
    "full state dict": ("test_state_dict_round_trip",),
    "lazy init": ("test_lazy_shards_equal_eager_tp2",),
    "sharded load": ("test_from_pretrained_equals_hf", "test_from_pretrained_every_family"),
    "sequence parallel (split_gather)": ("test_sp_equals_unsharded", "test_sp_vision_equals_unsharded"),
    "sequence overlap": ("test_sp_overlap_equals_unsharded", "test_sp_overlap_decoders_equal_unsharded"),
    "sequence parallel (all_to_all)": ("test_all_to_all_equals_unsharded",),
    "sequence parallel (ring_attn)": ("test_ring_attn_equals_unsharded",),
    "pipeline (GPipe)": ("test_gpipe_equals_unsharded",),
    "pipeline (1F1B, TP=2)": ("test_1f1b_equals_unsharded",),
    "pipeline (interleaved)": ("test_interleaved_equals_unsharded",),
}
BEGIN, END = "<!-- support-matrix:begin -->", "<!-- support-matrix:end -->"
# every tests/test_models*.py (one per zoo module), and the other files holding the feature tests above
TEST_FILES = sorted(os.path.relpath(f, ROOT) for f in glob.glob(os.path.join(ROOT, "tests", "test_models*.py"))) + [
    "tests/test_kernels.py", "tests/test_attention.py", "tests/test_optimizations.py", "tests/test_lazy.py",
    "tests/test_from_pretrained.py", "tests/test_sequence_parallel.py", "tests/test_sequence_attention.py",
    "tests/test_sequence_parallel_more.py", "tests/test_pipeline.py"]


def registry() -> dict[str, list[str]]:
    from shardformer.autopolicy import registry

    families = defaultdict(list)
    for key, (family, _) in registry().items():
        families[family].append(key.rsplit(".", 1)[-1])
    return {f: sorted(c) for f, c in sorted(families.items())}


def run_tests(junit: str) -> None:
    files = [f for f in TEST_FILES if os.path.exists(os.path.join(ROOT, f))]
    subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", f"--junitxml={junit}", *files],
                   cwd=ROOT, check=False)


def outcomes(junit: str, classes: set[str]) -> dict[tuple[str, str], list[bool]]:
    """(feature, model class) -> pass/fail of every matching test case."""
    by_test = {t: f for f, tests in FEATURES.items() for t in tests}
    result = defaultdict(list)
    for case in ET.parse(junit).getroot().iter("testcase"):
        m = re.match(r"([A-Za-z0-9_]+)\[(.*)\]$", case.get("name", ""))
        if not m or m.group(1) not in by_test:
            continue
        names = [tok for tok in re.split(r"[-\[\], ]", m.group(2)) if tok in classes]
        failed = case.find("failure") is not None or case.find("error") is not None
        skipped = case.find("skipped") is not None
        for name in names:
            if not skipped:
                result[(by_test[m.group(1)], name)].append(not failed)
    return result


def table(families: dict[str, list[str]], results) -> str:
    header = "| family | classes | " + " | ".join(FEATURES) + " |"
    lines = [header, "|" + "---|" * (len(FEATURES) + 2)]
    for family, classes in families.items():
        cells = []
        for feature in FEATURES:
            ok = [c for c in classes if results.get((feature, c)) and all(results[(feature, c)])]
            bad = [c for c in classes if results.get((feature, c)) and not all(results[(feature, c)])]
            if bad:
                cells.append(f"✗ {len(bad)} failing")
            elif ok:
                cells.append(f"✔ {len(ok)}/{len(classes)}")
            else:
                cells.append("")
        lines.append(f"| {family} | {len(classes)} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def class_list(families: dict[str, list[str]]) -> str:
    """The registered classes of each family, as a two-column table."""
    lines = ["| family | registered classes |", "|---|---|"]
    for family, classes in families.items():
        lines.append(f"| {family} | " + ", ".join(f"`{c}`" for c in classes) + " |")
    return "\n".join(lines)


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--junit", help="an existing pytest --junitxml file (default: run the model tests)")
    p.add_argument("--write", help="replace the section between the support-matrix markers in this file")
    args = p.parse_args()
    families = registry()
    junit = args.junit
    if junit is None:
        junit = os.path.join(tempfile.mkdtemp(), "results.xml")
        run_tests(junit)
    text = table(families, outcomes(junit, {c for cs in families.values() for c in cs}))
    text += "\n\nA cell counts the classes of the family for which every test of that feature passed.\n\n"
    text += class_list(families)
    print(text)
    if args.write:
        with open(args.write) as f:
            doc = f.read()
        if BEGIN not in doc or END not in doc:
            raise SystemExit(f"{args.write}: no {BEGIN} ... {END} section")
        head, rest = doc.split(BEGIN, 1)
        _, tail = rest.split(END, 1)
        with open(args.write, "w") as f:
            f.write(f"{head}{BEGIN}\n{text}\n{END}{tail}")


if __name__ == "__main__":
    main()
