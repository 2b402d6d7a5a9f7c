"""The supported transformers range (shardformer/_versions.py) is checked when
shardformer first needs transformers, with a message naming the installed
version, the range and the fix; pyproject.toml's extras, the CI pins and the
compat run's test subset agree with it."""
import os
import re
import subprocess
import sys
import textwrap

import pytest

from shardformer import _versions as V

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _pins(path):
    """{name: version} of the `name==version` lines of a requirements file."""
    pins = {}
    with open(os.path.join(ROOT, path)) as f:
        for line in f:
            line = line.split("#", 1)[0].strip()
            if line:
                name, eq, version = line.partition("==")
                assert eq, f"{path}: {line!r} is not an exact pin"
                pins[name.strip().lower()] = version.strip()
    return pins


# --- the check itself, on version strings --------------------------------------------------------

def test_installed_version_accepted():
    import transformers

    assert V.is_supported(transformers.__version__), transformers.__version__
    assert V.check_transformers_version() == transformers.__version__


@pytest.mark.parametrize("version", [V.TRANSFORMERS_MIN, "5.18.0", "5.18.0+cpu", "5.20.2", "5.20.0.post1",
                                     "5.20.3.dev0"])
def test_in_range_accepted(version):
    assert V.is_supported(version)
    assert V.check_transformers_version(version) == version


@pytest.mark.parametrize("version", ["4.57.1", "4.57.6", "3.5.1", "5.0.0", "5.8.1", "5.14.1",
                                     f"{V.TRANSFORMERS_MIN}rc1", f"{V.TRANSFORMERS_MIN}.dev0", V.TRANSFORMERS_BELOW,
                                     f"{V.TRANSFORMERS_BELOW}.0rc1", f"{V.TRANSFORMERS_BELOW}.0.dev0",
                                     f"{V.TRANSFORMERS_BELOW}.5", "6.0.0", "7.1"])
def test_out_of_range_refused(version, monkeypatch):
    monkeypatch.delenv(V.SKIP_ENV, raising=False)
    assert V.is_supported(version) is False
    with pytest.raises(V.TransformersVersionError) as err:
        V.check_transformers_version(version)
    assert isinstance(err.value, ImportError)
    msg = str(err.value)
    assert version in msg
    assert V.TRANSFORMERS_REQUIREMENT in msg
    assert f'pip install "{V.TRANSFORMERS_REQUIREMENT}"' in msg
    assert V.SKIP_ENV in msg


def test_4x_message_says_why():
    msg = V.version_error_message("4.57.1")
    assert "transformers 4.x is not supported" in msg
    assert "4.x" not in V.version_error_message("6.0.0")


def test_skip_env_turns_the_error_into_a_warning(monkeypatch):
    monkeypatch.setenv(V.SKIP_ENV, "1")
    with pytest.warns(RuntimeWarning, match=re.escape("4.57.2")):
        assert V.check_transformers_version("4.57.2") == "4.57.2"


def test_unparsable_version_warns_only():
    with pytest.warns(RuntimeWarning, match="cannot parse"):
        assert V.check_transformers_version("main") == "main"


# --- the hooks: import of shardformer.policies, get_autopolicy -----------------------------------

def _start(code, env_extra=None, pythonpath=None) -> subprocess.Popen:
    """`code` in a fresh interpreter, started (not waited for): tests that need several start them at once."""
    env = {k: v for k, v in os.environ.items() if k != V.SKIP_ENV}
    env.update(env_extra or {})
    if pythonpath:
        env["PYTHONPATH"] = os.pathsep.join([pythonpath] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
    return subprocess.Popen([sys.executable, "-c", textwrap.dedent(code)], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, cwd=ROOT)


def _finish(proc: subprocess.Popen) -> subprocess.CompletedProcess:
    try:
        stdout, stderr = proc.communicate(timeout=300)
    except subprocess.TimeoutExpired:
        proc.kill()
        raise
    return subprocess.CompletedProcess(proc.args, proc.returncode, stdout, stderr)


def _run(code, env_extra=None, pythonpath=None):
    return _finish(_start(code, env_extra, pythonpath))


def test_policies_import_refuses_faked_old_transformers():
    out = _run("""
        import transformers
        transformers.__version__ = "4.57.1"
        import shardformer  # no check: shardformer alone does not need transformers
        try:
            import shardformer.policies
        except ImportError as e:
            print(type(e).__name__); print(e)
        else:
            print("imported")
        """)
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("TransformersVersionError\n"), out.stdout
    assert "4.57.1" in out.stdout and V.TRANSFORMERS_REQUIREMENT in out.stdout
    assert f'pip install "{V.TRANSFORMERS_REQUIREMENT}"' in out.stdout


def test_autopolicy_refuses_faked_old_transformers():
    out = _run("""
        import sys
        import transformers
        from shardformer.autopolicy import get_autopolicy
        model = transformers.GPT2LMHeadModel(transformers.GPT2Config(n_layer=1, n_embd=8, n_head=2, vocab_size=16))
        sys.modules["transformers"].__version__ = "6.1.0"  # (building a model re-registers the module)
        try:
            get_autopolicy(model)
        except ImportError as e:
            print(type(e).__name__); print(e)
        else:
            print("no error")
        """)
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("TransformersVersionError\n"), out.stdout
    assert "6.1.0" in out.stdout and V.TRANSFORMERS_REQUIREMENT in out.stdout


def test_autopolicy_skip_env_warns_instead():
    code = """
        import sys
        import warnings
        import transformers
        from shardformer.autopolicy import get_autopolicy
        model = transformers.GPT2LMHeadModel(transformers.GPT2Config(n_layer=1, n_embd=8, n_head=2, vocab_size=16))
        sys.modules["transformers"].__version__ = "4.57.1"
        with warnings.catch_warnings(record=True) as w:
            warnings.simplefilter("always")
            policy = get_autopolicy(model)
        print(type(policy).__name__, sum("4.57.1" in str(x.message) for x in w))
        """
    skipped, checked = _start(code, {V.SKIP_ENV: "1"}), _start(code)     # at once (CI time)
    out = _finish(skipped)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["GPT2LMHeadModelPolicy", "1"], out.stdout
    out = _finish(checked)
    assert out.returncode != 0 and "TransformersVersionError" in out.stderr and "4.57.1" in out.stderr


def test_metadata_checked_without_importing_transformers(tmp_path):
    """Before transformers is imported, the installed distribution's metadata
    is checked; transformers stays unimported."""
    info = tmp_path / "transformers-4.57.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: transformers\nVersion: 4.57.1\n")
    out = _run("""
        import sys
        import shardformer
        try:
            import shardformer.policies
        except ImportError as e:
            print(type(e).__name__); print(e)
        assert "transformers" not in sys.modules
        """, pythonpath=str(tmp_path))
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("TransformersVersionError\n"), out.stdout
    assert "4.57.1" in out.stdout


def test_in_range_import_does_not_import_transformers():
    out = _run("""
        import sys
        import shardformer, shardformer.policies, shardformer.policies.llama
        assert "transformers" not in sys.modules
        print("ok")
        """)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "ok"


# --- one range everywhere: pyproject, pins, CI ---------------------------------------------------

def test_pyproject_extras_match_the_module():
    try:
        import tomllib
    except ImportError:  # Python 3.10
        tomllib = pytest.importorskip("tomli")
    with open(os.path.join(ROOT, "pyproject.toml"), "rb") as f:
        extras = tomllib.load(f)["project"]["optional-dependencies"]
    for extra in ("hf", "test"):
        reqs = [r.replace(" ", "") for r in extras[extra] if re.match(r"transformers\b", r)]
        assert reqs == [V.TRANSFORMERS_REQUIREMENT], (extra, extras[extra], V.TRANSFORMERS_REQUIREMENT)


def test_ci_pins_are_the_two_ends():
    dev, compat = _pins("requirements-dev.txt"), _pins("requirements-compat.txt")
    assert compat["transformers"] == V.TRANSFORMERS_MIN, "requirements-compat.txt pins the lower end"
    assert V.is_supported(dev["transformers"]), "requirements-dev.txt pins a supported version"
    # Everything else pinned the same, so the two runs differ only in transformers.
    same = {k: v for k, v in dev.items() if k in compat and k != "transformers"}
    assert same == {k: compat[k] for k in same}
    assert {"torch", "numpy", "pytest", "setuptools"} <= set(same)


def test_compat_subset_collects_tests(request):
    """scripts/test_compat.sh's pytest selection exists and is not empty
    (pytest's exit status 5, 'no tests collected', cannot happen).  Read from
    this session's own collection when it holds the whole suite (no second
    collection of every test module), else from a --collect-only run."""
    script = os.path.join(ROOT, "scripts", "test_compat.sh")
    args = subprocess.run(["bash", "-c", f'source <(grep "^SUBSET=" "{script}"); printf "%s\\n" "${{SUBSET[@]}}"'],
                          capture_output=True, text=True, check=True, cwd=ROOT).stdout.split("\n")
    args = [a for a in args if a]
    for a in args:
        if not a.startswith("-"):
            assert os.path.exists(os.path.join(ROOT, a)), a
    ignored = {os.path.normpath(a.split("=", 1)[1]) for a in args if a.startswith("--ignore=")}
    assert all(os.path.exists(os.path.join(ROOT, f)) for f in ignored), sorted(ignored)
    wanted = ("tests/test_transformers_version.py", "tests/test_models_llama_gpt2_bert.py",
              "tests/test_models_decoders.py", "tests/test_models_encoders.py", "tests/test_models_vision.py",
              "tests/test_attention.py")
    session = {os.path.relpath(str(item.path), ROOT) for item in request.session.items}
    if all(f in session for f in wanted):
        collected = session - ignored
    else:
        out = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider", *args],
                             capture_output=True, text=True, cwd=ROOT, timeout=300)
        assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
        collected = {line.split("::", 1)[0] for line in out.stdout.splitlines() if "::" in line}
    for f in wanted:
        assert f in collected, (f, sorted(collected))
