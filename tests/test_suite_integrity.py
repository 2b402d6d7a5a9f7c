"""The suite checks what it says it checks: a test function defined twice in
one module is collected once (the second definition replaces the first), so
every case of the first stops running without a word.  This happened once
(two `test_sp_overlap_equals_unsharded` in test_sequence_parallel_more.py);
this test finds any such pair before it can hide a check again."""
import ast
import pathlib

HERE = pathlib.Path(__file__).parent


def _top_level_tests(path: pathlib.Path) -> list[tuple[str, int]]:
    tree = ast.parse(path.read_text(), filename=str(path))
    return [(node.name, node.lineno) for node in tree.body
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.name.startswith("test")]


def test_no_test_function_is_defined_twice_in_a_module():
    twice = []
    for path in sorted(HERE.rglob("test_*.py")):
        seen: dict[str, int] = {}
        for name, line in _top_level_tests(path):
            if name in seen:
                twice.append(f"{path.relative_to(HERE)}: {name} at lines {seen[name]} and {line}")
            seen[name] = line
    assert not twice, "test functions defined twice (only the last runs):\n" + "\n".join(twice)
