"""The package builds into a wheel without torch in the build, and the
installed (non-editable) package imports, with policies as shardformer.policies."""
import os
import subprocess
import sys
import zipfile

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope="module")
def wheel(tmp_path_factory):
    out = tmp_path_factory.mktemp("wheel")
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-build-isolation", "--no-deps",
                    "-w", str(out), ROOT], check=True, cwd=str(out))
    wheels = [f for f in os.listdir(out) if f.endswith(".whl")]
    assert len(wheels) == 1, wheels
    return os.path.join(out, wheels[0])


def test_wheel_contents(wheel):
    names = zipfile.ZipFile(wheel).namelist()
    assert any(n.startswith("shardformer/_C.") and n.endswith(".so") for n in names)
    for f in ("shardformer/policies/llama.py", "shardformer/policies/gpt2.py", "shardformer/policies/bert.py",
              "shardformer/layer/linear.py", "shardformer/distributed/mappings.py"):
        assert f in names, f
    assert not any(n.startswith("tests/") for n in names)


def test_installed_wheel_imports_without_transformers(wheel, tmp_path):
    target = tmp_path / "site"
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", str(target), wheel],
                   check=True)
    code = (
        "import sys; import shardformer, shardformer._C, shardformer.policies;"
        "assert shardformer.__file__.startswith(sys.argv[1]), shardformer.__file__;"
        "assert 'transformers' not in sys.modules, 'import shardformer imported transformers';"
        "from shardformer.autopolicy import supported_models; assert len(supported_models()) >= 20;"
        "print('ok')"
    )
    env = dict(os.environ, PYTHONPATH=str(target))
    out = subprocess.run([sys.executable, "-c", code, str(target)], env=env, cwd=str(tmp_path),
                         capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "ok"
