"""What a user installs: the sdist, the wheel built from it (without torch in
the build), and that wheel installed non-editable into a fresh venv, used from
outside the checkout.

The wheel is compared with the tree (every module of python/shardformer and
policies/ is in it: packages are found by setup.py, not listed); the installed
copy imports every module and shards one model of every family at TP=2
(tests/installed_copy.py)."""
import json
import os
import subprocess
import sys
import sysconfig
import tarfile
import zipfile

import pytest
import zoo

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _tree_modules() -> set[str]:
    """Every .py file the wheel must hold, as its path inside the wheel."""
    found = set()
    for folder, prefix in ((os.path.join(ROOT, "python", "shardformer"), "shardformer"),
                           (os.path.join(ROOT, "policies"), "shardformer/policies")):
        for here, dirs, files in os.walk(folder):
            dirs[:] = [d for d in dirs if d != "__pycache__"]
            rel = os.path.relpath(here, folder)
            for f in files:
                if f.endswith(".py"):
                    found.add("/".join(p for p in (prefix, "" if rel == "." else rel, f) if p))
    return found


@pytest.fixture(scope="module")
def dist(tmp_path_factory):
    """The sdist, and the wheel built from that sdist (as `python -m build` does)."""
    out = tmp_path_factory.mktemp("dist")
    # SHARDFORMER_CUDA=0: the CPU package (what a machine without nvcc builds); the CI install
    # builds the CUDA extension once already (tests/test_cuda_build.py checks it there), and a
    # second nvcc pass here would cost CI its time again.
    subprocess.run([sys.executable, "-m", "build", "--no-isolation", "-o", str(out), ROOT], check=True,
                   cwd=str(out), capture_output=True, env=dict(os.environ, SHARDFORMER_CUDA="0"))
    files = sorted(os.listdir(out))
    wheels = [f for f in files if f.endswith(".whl")]
    sdists = [f for f in files if f.endswith(".tar.gz")]
    assert len(wheels) == 1 and len(sdists) == 1, files
    return {"wheel": os.path.join(out, wheels[0]), "sdist": os.path.join(out, sdists[0])}


def test_wheel_holds_every_module_of_the_tree(dist):
    names = set(zipfile.ZipFile(dist["wheel"]).namelist())
    missing = sorted(_tree_modules() - names)
    assert not missing, f"the wheel lacks {missing}"
    assert "shardformer/pipeline/stages.py" in names
    assert any(n.startswith("shardformer/_C.") and n.endswith(".so") for n in names)
    assert not any(n.startswith("shardformer/_cuda.") for n in names), "SHARDFORMER_CUDA=0 built _cuda"
    assert not any(n.startswith(("tests/", "python/", "policies/")) for n in names), sorted(names)[:10]


def test_sdist_holds_what_the_build_needs(dist):
    with tarfile.open(dist["sdist"]) as tar:
        names = {n.split("/", 1)[1] for n in tar.getnames() if "/" in n}
    for needed in ("setup.py", "pyproject.toml", "README.md", "csrc/module.c", "policies/llama.py",
                   "python/shardformer/pipeline/stages.py"):
        assert needed in names, needed
    sources = {os.path.relpath(os.path.join(d, f), ROOT) for d, _, fs in os.walk(os.path.join(ROOT, "csrc"))
               for f in fs if f.endswith((".c", ".h", ".cu", ".cuh"))}
    assert not sources - names, sorted(sources - names)


def test_installed_wheel_imports_without_transformers(dist, tmp_path):
    target = tmp_path / "site"
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", str(target),
                    dist["wheel"]], check=True)
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


@pytest.fixture(scope="module")
def fresh_venv(dist, tmp_path_factory):
    """A new venv with the wheel installed non-editable.  Its dependencies (torch,
    transformers, ...) are this interpreter's, reached through a .pth line naming
    our site-packages folders: a path in a .pth file is not itself scanned for .pth
    files, so this venv's editable shardformer (its finder is started by one) is
    not seen, and the venv's own site-packages comes first."""
    home = tmp_path_factory.mktemp("venv")
    venv = home / "v"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    python = str(venv / "bin" / "python")
    # The wheel first: with our site-packages on its path, pip would find a non-editable
    # shardformer there (CI installs one) and take it as already installed.
    subprocess.run([python, "-m", "pip", "install", "-q", "--disable-pip-version-check", "--no-deps",
                    "--no-index", dist["wheel"]], check=True)
    site = subprocess.run([python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                          check=True, capture_output=True, text=True).stdout.strip()
    ours = {sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"]}
    with open(os.path.join(site, "_shardformer_test_deps.pth"), "w") as f:
        f.write("\n".join(sorted(ours)) + "\n")
    return {"python": python, "home": str(home), "site": site}


def test_installed_copy_imports_every_module_and_shards_every_family(fresh_venv):
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env["OMP_NUM_THREADS"] = "1"
    out = subprocess.run([fresh_venv["python"], os.path.join(ROOT, "tests", "installed_copy.py")], env=env,
                         cwd=fresh_venv["home"], capture_output=True, text=True, timeout=900)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-6000:]
    report = json.loads(out.stdout.strip().splitlines()[-1])
    assert set(report["families"]) == set(zoo.family_classes()), report
    tree = {p[:-3].replace("/", ".").removesuffix(".__init__") for p in _tree_modules()} | {"shardformer._C"}
    assert set(report["modules"]) == tree, sorted(tree ^ set(report["modules"]))
