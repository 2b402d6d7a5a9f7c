"""Generate the support matrix of docs/supported-models.md from the policy registry and the test results.

    python scripts/support_matrix.py                  # run the model tests, print the table
    python scripts/support_matrix.py --write          # ... and write it into docs/supported-models.md
    python scripts/support_matrix.py --junit results.xml --write
    python scripts/support_matrix.py --junit all.xml --junit rerun.xml --write
        (a later file's test modules replace those modules' cases in the earlier ones:
        re-run one test file after a change without re-running the rest)
    python scripts/support_matrix.py --junit results.xml --check
        (exit 1 when the page's matrix is not what these results give)

Rows are the model families of shardformer.autopolicy; a cell counts the
classes of that family for which every test of that feature passed (and no
test of it failed).  A feature is a test function name, see FEATURES.
Nothing in the table is written by hand; the footnotes are NOT_SUPPORTED and CAVEATS
(each "not supported" claim of an optimization column is checked by tests/test_optimizations.py).
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

# column -> test function names that prove it
FEATURES = {
    "tensor parallel (TP=2,4)": ("test_fp32_forward_backward_step",),
    "generate()": ("test_generate_matches_unsharded",),
    "bf16": ("test_bf16_forward",),
    "fused normalization": ("test_fused_normalization", "test_fused_normalization_every_family"),
    "jit fused": ("test_models_with_fused_kernels", "test_jit_fused_every_family"),
    "flash attention": ("test_flash_attention", "test_flash_attention_every_family"),
    "full state dict": ("test_state_dict_round_trip",),
    "lazy init": ("test_lazy_shards_equal_eager_tp2",),
    "sharded load": ("test_from_pretrained_equals_hf", "test_from_pretrained_every_family"),
    "sequence parallel (split_gather)": ("test_sp_equals_unsharded", "test_sp_vision_equals_unsharded",
                                         "test_sp_mm_equals_unsharded", "test_sp_vision_windows_and_bias_equal_unsharded"),
    "sequence overlap": ("test_sp_overlap_equals_unsharded", "test_sp_window_overlap_equals_unsharded",
                         "test_sp_overlap_decoders_equal_unsharded",
                         "test_sp_overlap_mm_equals_unsharded"),
    "sequence parallel (all_to_all)": ("test_all_to_all_equals_unsharded", "test_all_to_all_mm_equals_unsharded"),
    "sequence parallel (ring_attn)": ("test_ring_attn_equals_unsharded", "test_ring_attn_mm_equals_unsharded"),
    "pipeline (GPipe)": ("test_gpipe_equals_unsharded", "test_swin_gpipe_equals_unsharded"),
    "pipeline (1F1B, TP=2)": ("test_1f1b_equals_unsharded", "test_swin_1f1b_equals_unsharded"),
    "pipeline (interleaved)": ("test_interleaved_equals_unsharded", "test_swin_interleaved_equals_unsharded"),
    "loss on vocabulary shards (parallel_output)": ("test_loss_on_vocabulary_shards",),
}
# (family, column) -> why the family's classes (all of them, or those the cell does
# not count) do not get it: printed as a footnote of the cell.  For the optimization
# columns, tests/test_optimizations.py checks each claim: a class listed here as not
# getting a kernel must not call it (test_nothing_fused_where_no_kernel_fits), so a
# footnote cannot outlive its reason.
NOT_SUPPORTED = {
    ("mixtral", "sequence overlap"):
        "the MoE block's router picks each token's experts from the gathered sequence, so no column matmul "
        "on a rank's rows can run during the gather (refused by name)",
    ("sam", "sequence parallel (all_to_all)"):
        "not implemented yet (refused by name; split_gather works): the vision layers take [B, H, W, C] "
        "grids and cut them into windows before their attention, so a split of the grid rows needs the "
        "layer's forward replaced (q/k/v exchanged by heads before the windowing), not only the attention's",
    ("sam", "sequence parallel (ring_attn)"):
        "not implemented yet (refused by name; split_gather works): the global layers could ring their "
        "row blocks with the relative-position bias block by block, but the windowed layers' windows "
        "straddle the ranks' grid rows and would need their rows exchanged first",
    ("blip2", "sequence parallel (all_to_all)"):
        "with an OPT or T5 language model; the classes without a language model are refused by name",
    ("blip2", "sequence parallel (ring_attn)"):
        "with an OPT or T5 language model; the classes without a language model are refused by name",
    ("gemma3", "sequence parallel (ring_attn)"):
        "the text classes; the multimodal ones are refused by name: an image's tokens attend to each "
        "other both ways, which the ring kernel cannot express",
    ("mixtral", "jit fused"):
        "Mixtral's experts are the policy's expert-parallel module (replaced by the policy, "
        "which the optimizations leave alone)",
}
# BEiT, Swin, Swinv2: all_to_all / ring_attn refused by name (tests/test_sequence_parallel_more.py
# test_sp_vision_modes_refused)
for _column in ("sequence parallel (all_to_all)", "sequence parallel (ring_attn)"):
    NOT_SUPPORTED[("beit", _column)] = (
        "refused by name: BEiT adds its relative position bias to the [S, S] scores inside its own attention, "
        "which this mode never builds (split_gather works)")
    for _family in ("swin", "swinv2"):
        NOT_SUPPORTED[(_family, _column)] = (
            "refused by name: each block's windowed attention reads the gathered (height, width) map, shifted "
            "and cut into windows, not a sequence this mode could split across its attention (split_gather works)")
# (family, column) -> a condition of the cell's tests
CAVEATS = {
    ("gemma2", "flash attention"):
        "tested with attn_logit_softcapping=0.05 (a cap that changes the tiny test model's logits), "
        "soft-capped by the kernel",
    ("mistral", "flash attention"): "with a sliding window (4) shorter than the test's sequences",
    ("falcon", "sequence parallel (ring_attn)"):
        "rotary Falcon (the zoo's config; the other fused layouts, SDPA and ALiBi in "
        "test_falcon_variants)",
}
# The families whose attention is outside transformers' registry get the kernel at their seam
# (AttentionSeam.kernel) where their attention dropout is inactive (eval, or p = 0)
for _family in ("bloom", "falcon", "gpt_neo", "gptj", "swinv2"):
    CAVEATS[(_family, "flash attention")] = (
        "at the attention's own seam (it is outside transformers' AttentionInterface); in training with "
        "attention dropout > 0 the model's own attention runs (the kernel's dropout draws are not torch's)")
BEGIN, END = "<!-- support-matrix:begin -->", "<!-- support-matrix:end -->"
# The page that holds the matrix, between BEGIN and END (tests/test_docs.py checks its
# footnotes and class list against the registry; mkdocs.yml puts it in the site).
PAGE = os.path.join(ROOT, "docs", "supported-models.md")
# every tests/test_models*.py (one per zoo module), and the other files holding the feature tests above
TEST_FILES = sorted(os.path.relpath(f, ROOT) for f in glob.glob(os.path.join(ROOT, "tests", "test_models*.py"))) + [
    "tests/test_kernels.py", "tests/test_attention.py", "tests/test_optimizations.py", "tests/test_lazy.py",
    "tests/test_from_pretrained.py", "tests/test_sequence_parallel.py", "tests/test_sequence_attention.py",
    "tests/test_sequence_heads.py",
    "tests/test_sequence_parallel_more.py", "tests/test_sequence_parallel_mm.py", "tests/test_pipeline.py", "tests/test_lm_loss.py",
    "tests/test_derived_policy.py", "tests/test_derived_sequence.py"]


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


def test_cases(junits: list[str]) -> list:
    """The testcase elements of the junit files; a test module (classname) found
    in a later file replaces every case of that module in the earlier ones."""
    cases: dict[str, list] = {}
    for junit in junits:
        found: dict[str, list] = defaultdict(list)
        for case in ET.parse(junit).getroot().iter("testcase"):
            found[case.get("classname", "")].append(case)
        cases.update(found)
    return [c for cs in cases.values() for c in cs]


def outcomes(junits: list[str], classes: set[str]) -> dict[tuple[str, str], list[bool]]:
    """(feature, model class) -> pass/fail of every matching test case."""
    by_test = {t: f for f, tests in FEATURES.items() for t in tests}
    result = defaultdict(list)
    for case in test_cases(junits):
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


def footnotes(families: dict[str, list[str]]) -> dict[tuple[str, str], tuple[int, str]]:
    """(family, column) -> (footnote number, text), numbered in table order."""
    notes = {**{k: v for k, v in CAVEATS.items()}, **NOT_SUPPORTED}
    unknown = sorted(k for k in notes if k[0] not in families or k[1] not in FEATURES)
    if unknown:
        raise SystemExit(f"support_matrix.py: footnotes for no family / column: {unknown}")
    out = {}
    for family in families:
        for feature in FEATURES:
            if (family, feature) in notes:
                out[(family, feature)] = (len(out) + 1, notes[(family, feature)])
    return out


def table(families: dict[str, list[str]], results, notes=None) -> str:
    notes = {} if notes is None else notes
    header = "| family | classes | " + " | ".join(FEATURES) + " |"
    lines = [header, "|" + "---|" * (len(FEATURES) + 2)]
    for family, classes in families.items():
        cells = []
        for feature in FEATURES:
            ok = [c for c in classes if results.get((feature, c)) and all(results[(feature, c)])]
            bad = [c for c in classes if results.get((feature, c)) and not all(results[(feature, c)])]
            if bad:
                cell = f"✗ {len(bad)} failing"
            elif ok:
                cell = f"✔ {len(ok)}/{len(classes)}"
            else:
                cell = ""
            if (family, feature) in notes:
                cell = f"{cell} [{notes[(family, feature)][0]}]".strip()
            cells.append(cell)
        lines.append(f"| {family} | {len(classes)} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def class_list(families: dict[str, list[str]]) -> str:
    """The registered classes of each family, as a two-column table."""
    lines = ["| family | registered classes |", "|---|---|"]
    for family, classes in families.items():
        lines.append(f"| {family} | " + ", ".join(f"`{c}`" for c in classes) + " |")
    return "\n".join(lines)


# Architectures without a built-in policy, sharded from their own tensor-parallel plan
# (shardformer.derived_policy), as tests/test_derived_policy.py names them.
DERIVED_TESTS = {"TP=2": "test_forward_backward_step", "generate()": "test_generate_matches_unsharded"}
# Sequence parallelism on derived plans (tests/test_derived_sequence.py, params "<arch>-<mode>-<sp>-<seq>"):
# one column per mode, SP=2 and 4.
DERIVED_SP_TEST = "test_derived_sp_equals_unsharded"
DERIVED_SP_MODES = ("split_gather", "all_to_all", "ring_attn")
# Pipeline parallelism on derived plans (params "<arch>-<tp>"): the stage split from base_model_pp_plan,
# or from the module tree where the config has none.
DERIVED_PP_TESTS = ("test_pipeline_from_pp_plan", "test_pipeline_without_pp_plan")


def derived_section(junits: list[str]) -> str:
    """One row per architecture of tests/test_derived_policy.py: whether every
    forward/backward/step case passed at TP=2 and 4, and generate()."""
    rows: dict[str, dict[str, list[bool]]] = defaultdict(lambda: defaultdict(list))
    refused = []
    for case in test_cases(junits):
        classname = case.get("classname", "")
        if not classname.endswith(("test_derived_policy", "test_derived_sequence")):
            continue
        m = re.match(r"([A-Za-z0-9_]+)\[(.*)\]$", case.get("name", ""))
        if not m:
            continue
        failed = case.find("failure") is not None or case.find("error") is not None
        if case.find("skipped") is not None:
            continue
        test, params = m.group(1), m.group(2)
        if test == "test_plan_refused_naming_style_path_class" and not failed:
            refused.append(params)
            continue
        if test in DERIVED_PP_TESTS:
            rows[params.rpartition("-")[0]]["PP=2"].append(not failed)
            continue
        if test == DERIVED_SP_TEST:
            arch, mode, _sp, _seq = params.rsplit("-", 3)
            rows[arch][f"SP {mode}"].append(not failed)
            continue
        for label, name in DERIVED_TESTS.items():
            if test == name:
                arch, _, tp = params.rpartition("-")
                rows[arch][label].append(not failed)
                rows[arch]["tp"].append(tp)
    if not rows:
        return ""
    labels = list(DERIVED_TESTS) + [f"SP {mode}" for mode in DERIVED_SP_MODES] + ["PP=2"]
    lines = ["| architecture | TP=2 and 4 (logits, loss, gradients, after a step) | generate() | "
             + " | ".join(f"SP {mode} (2 and 4)" for mode in DERIVED_SP_MODES) + " | PP=2 (TP=1 and 2) |",
             "|---" * len(labels) + "|---|"]
    for arch in sorted(rows, key=str.lower):
        cells = []
        for label in labels:
            got = rows[arch].get(label)
            cells.append("" if not got else ("✔" if all(got) else "✗"))
        lines.append(f"| {arch} | " + " | ".join(cells) + " |")
    passed = {arch.split("-")[0] for arch in rows if rows[arch].get("TP=2") and all(rows[arch]["TP=2"])}
    text = (f"**Derived from the model's own plan** (no built-in policy; `shardformer.derived_policy`): "
            f"{len(passed)} architectures pass (a name with a suffix is a second configuration: other head "
            f"counts, or the plan edited as the suffix says), from `tests/test_derived_policy.py` and (sequence "
            f"parallelism, odd lengths) `tests/test_derived_sequence.py`.\n\n" + "\n".join(lines))
    if refused:
        text += ("\n\nRefused at plan time, naming the style, module and class (tested): "
                 + ", ".join(sorted(refused)) + ".")
    return text


def notes_and_classes(families: dict[str, list[str]], notes) -> str:
    """What follows the table: the legend, the footnotes and the class list (no test results needed)."""
    text = "A cell counts the classes of the family for which every test of that feature passed; "
    text += "[n] refers to a note below.\n\n"
    for (family, feature), (number, note) in notes.items():
        text += f"{number}. {family}, {feature}: {note}\n"
    return text + "\n" + class_list(families)


def matrix(families: dict[str, list[str]], junits: list[str]) -> str:
    """The whole generated section, as it stands between BEGIN and END."""
    notes = footnotes(families)
    text = table(families, outcomes(junits, {c for cs in families.values() for c in cs}), notes)
    text += "\n\n" + notes_and_classes(families, notes)
    derived = derived_section(junits)
    if derived:
        text += "\n\n" + derived
    return text


def page_section(path: str = PAGE) -> str:
    """The text between BEGIN and END in `path` (without the newlines next to the markers)."""
    with open(path) as f:
        doc = f.read()
    if BEGIN not in doc or END not in doc:
        raise SystemExit(f"{path}: no {BEGIN} ... {END} section")
    return doc.split(BEGIN, 1)[1].split(END, 1)[0].strip("\n")


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--junit", action="append",
                   help="an existing pytest --junitxml file (default: run the model tests); may be repeated, "
                        "a later file's test modules replacing the earlier files' cases of those modules")
    p.add_argument("--write", nargs="?", const=PAGE, metavar="FILE",
                   help="replace the section between the support-matrix markers in FILE "
                        "(default: docs/supported-models.md)")
    p.add_argument("--check", nargs="?", const=PAGE, metavar="FILE",
                   help="exit 1 unless FILE's section (default: docs/supported-models.md) is what the results give")
    args = p.parse_args()
    families = registry()
    junits = args.junit
    if not junits:
        junits = [os.path.join(tempfile.mkdtemp(), "results.xml")]
        run_tests(junits[0])
    text = matrix(families, junits)
    print(text)
    if args.check and page_section(args.check) != text:
        raise SystemExit(f"{args.check}: the support matrix differs from these results; "
                         f"python scripts/support_matrix.py --junit ... --write {args.check}")
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
