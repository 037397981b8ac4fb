"""ci/install-sglang.sh and its helper ci/sglang_pins.py: which SGLang release is installed, with which
versions of the packages beside it (the release's own specifiers), and one line plus exit status 2 for bad
input. Everything here runs without the network except the last test, skipped where the index is unreachable."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "ci" / "install-sglang.sh"
GPU_SCRIPT = ROOT / "ci" / "gpu-sglang-wheels.sh"

_spec = importlib.util.spec_from_file_location("sglang_pins", ROOT / "ci" / "sglang_pins.py")
sp = importlib.util.module_from_spec(_spec)
sys.modules["sglang_pins"] = sp  # dataclasses look their module up by name
_spec.loader.exec_module(sp)

# Linux x86_64 CPython 3.11, whatever runs the tests.
ENV = sp.default_environment("3.11")

# A made-up release: == pins, ranges, bare names, markers for other platforms, extras, a Python bound.
METADATA = """\
Metadata-Version: 2.4
Name: sglang
Version: 0.5.99
Requires-Python: >=3.10
Requires-Dist: aiohttp
Requires-Dist: apache-tvm-ffi<0.2,>=0.1.5
Requires-Dist: flashinfer_python[cu13]==0.7.2
Requires-Dist: torch==2.14.1
Requires-Dist: transformers==5.19.0
Requires-Dist: Tokenizers (==0.23.2)
Requires-Dist: uvicorn>=0.51
Requires-Dist: partial_json_parser
Requires-Dist: av==16.1.0; sys_platform == "linux" and (platform_machine == "aarch64" or platform_machine == "arm64")
Requires-Dist: sentencepiece==0.2.1; platform_machine == "aarch64"
Requires-Dist: sentencepiece>=0.2; platform_machine == "x86_64"
Requires-Dist: openai==2.8.0; python_version >= "3.11"
Requires-Dist: numpy<2; python_version < "3.11"
Requires-Dist: pytest; extra == "test"
Requires-Dist: compressed-tensors==0.18.0 ; extra == 'all'
Provides-Extra: test

A long description: Requires-Dist: not-a-header==1
"""

NAMES = ["numpy", "aiohttp", "transformers", "tokenizers", "sentencepiece", "compressed-tensors", "openai",
         "partial-json-parser", "uvicorn", "apache-tvm-ffi", "IPython"]


# --- versions ----------------------------------------------------------------------------------------------

def test_versions_order_as_pep_440_with_post_releases_and_rc():
    ordered = ["0.5.9", "0.5.10.dev1", "0.5.10a1", "0.5.10b2", "0.5.10rc0", "0.5.10rc1", "0.5.10",
               "0.5.10.post1", "0.5.10.post2", "0.5.11", "0.5.12", "0.5.12.post1", "0.5.13", "0.5.100", "1.0"]
    shuffled = ordered[::2] + ordered[1::2]
    assert [v.text for v in sorted(map(sp.parse_version, shuffled))] == ordered
    assert sp.parse_version("1.0") == sp.parse_version("1.0.0")
    assert sp.parse_version("0.5.12-1") == sp.parse_version("0.5.12.post1")
    assert sp.parse_version("0.5.10RC1") == sp.parse_version("0.5.10rc1")
    assert sp.parse_version("0.5.10rc0").is_prerelease and not sp.parse_version("0.5.10.post1").is_prerelease
    for bad in ("", "not-a-version", "0.5.x", "1..2", "a b"):
        with pytest.raises(ValueError):
            sp.parse_version(bad)


def test_oldest_supported_release_is_the_floor():
    assert sp.OLDEST_SUPPORTED == "0.5.10"
    for ok in ("0.5.10", "0.5.10.post1", "0.5.12.post1", "0.5.23", "0.6.0rc1", "1.0"):
        assert sp.check_version(ok).text == ok
    for old in ("0.5.9", "0.5.8.post1", "0.4.10.post2", "0.5.10rc0", "0.5.10.dev3"):
        with pytest.raises(sp.InputError, match=f"sglang {old} is older than the oldest supported release 0.5.10"):
            sp.check_version(old)
    with pytest.raises(sp.InputError, match="'not-a-version' is not a version"):
        sp.check_version("not-a-version")
    with pytest.raises(sp.InputError, match="local version label"):
        sp.check_version("0.5.22+cpu")


def test_specifiers():
    assert sp.satisfies("0.1.9", ">=0.1.5,<0.2") and sp.satisfies("0.1.15.post2", ">=0.1.5,<0.2")
    assert not sp.satisfies("0.2.0", ">=0.1.5,<0.2") and not sp.satisfies("0.1.4", ">=0.1.5,<0.2")
    assert not sp.satisfies("0.2.0rc1", "<0.2")  # <V leaves out V's pre-releases
    assert not sp.satisfies("0.51.post1", ">0.51") and sp.satisfies("0.52", ">0.51")
    assert sp.satisfies("5.19.0", "==5.19.0") and sp.satisfies("5.19", "==5.19.0")
    assert sp.satisfies("2.13.0+cpu", "==2.13.0") and not sp.satisfies("2.13.0+cpu", "==2.13.0+cu130")
    assert sp.satisfies("3.11.7", "==3.11.*") and not sp.satisfies("3.12.0", "==3.11.*")
    assert sp.satisfies("3.12.0", "!=3.11.*")
    assert sp.satisfies("2.2.5", "~=2.2") and not sp.satisfies("3.0", "~=2.2")
    assert sp.satisfies("1.4.9", "~=1.4.5") and not sp.satisfies("1.5.0", "~=1.4.5")
    assert sp.satisfies("1.0", "")
    assert sp.is_exact_pin("==0.7.2") and not sp.is_exact_pin(">=0.51") and not sp.is_exact_pin("==3.*")
    assert not sp.is_exact_pin(">=0.1.5,<0.2")


# --- requirements and markers ------------------------------------------------------------------------------

def test_requirements_parse_names_extras_specifiers_and_markers():
    r = sp.parse_requirement('flashinfer_python[cu13]==0.7.2 ; sys_platform == "linux"')
    assert (r.name, r.extras, r.specifier, r.marker) == ("flashinfer_python", ("cu13",), "==0.7.2",
                                                        'sys_platform == "linux"')
    assert sp.parse_requirement("Tokenizers (==0.23.2)").specifier == "==0.23.2"
    assert sp.parse_requirement("kernels<0.15,>=0.14.1").specifier == "<0.15,>=0.14.1"
    assert sp.parse_requirement("IPython").specifier == ""
    assert sp.parse_requirement("pkg @ https://example.invalid/pkg.whl").url
    assert sp.normalize("partial_json_parser") == sp.normalize("Partial-JSON.parser") == "partial-json-parser"
    with pytest.raises(ValueError):
        sp.parse_requirement("transformers=5.0")


def test_markers():
    arm = dict(ENV, platform_machine="aarch64")
    marker = 'sys_platform == "linux" and (platform_machine == "aarch64" or platform_machine == "arm64")'
    assert not sp.evaluate_marker(marker, ENV) and sp.evaluate_marker(marker, arm)
    assert sp.evaluate_marker('sys_platform != "linux" or (sys_platform == "linux" and platform_machine != '
                              '"aarch64" and platform_machine != "arm64")', ENV)
    assert sp.evaluate_marker('python_version >= "3.10"', ENV)
    assert not sp.evaluate_marker('python_version >= "3.12"', ENV)
    assert sp.evaluate_marker('python_version >= "3.12"', sp.default_environment("3.12"))
    assert sp.evaluate_marker("python_version == '3.11.0'", ENV)  # compared as versions
    assert sp.evaluate_marker('"3.10" < python_version', ENV)
    assert sp.evaluate_marker("platform_machine in 'x86_64 amd64'", ENV)
    assert sp.evaluate_marker("platform_machine not in 'aarch64 arm64'", ENV)
    assert not sp.evaluate_marker('extra == "test"', ENV)
    assert sp.evaluate_marker('extra == "Test_X"', dict(ENV, extra="test-x"))
    for bad in ('python_version >= ', 'nonsense == "x"', '(python_version > "3")  or', 'os_name "posix"'):
        with pytest.raises(ValueError):
            sp.evaluate_marker(bad, ENV)


def test_pins_take_the_release_specifier_and_leave_other_platforms_extras_and_unlisted_packages_out():
    reqs = sp.requirements_from_metadata(METADATA)
    assert "not-a-header==1" not in " ".join(reqs)
    assert sp.pins(reqs, NAMES, ENV) == [
        "numpy",  # its pin is for Python < 3.11 only
        "aiohttp",
        "transformers==5.19.0",
        "tokenizers==0.23.2",
        "sentencepiece>=0.2",  # the x86_64 line, not the aarch64 one
        "compressed-tensors",  # pinned for an extra only
        "openai==2.8.0",
        "partial-json-parser",  # named as partial_json_parser
        "uvicorn>=0.51",
        "apache-tvm-ffi<0.2,>=0.1.5",
        "IPython",  # not named by the release at all
    ]
    assert sp.pins(reqs, ["numpy"], sp.default_environment("3.10")) == ["numpy<2"]
    # Nothing outside the list is ever returned: torch, flashinfer, av stay out.
    assert all("torch" not in p and "flashinfer" not in p for p in sp.pins(reqs, NAMES, ENV))


def test_bundle_pins_prefer_the_release_pin_then_a_default_within_its_range():
    reqs = sp.requirements_from_metadata(METADATA)
    defaults = ["flashinfer-python==0.6.0", "apache-tvm-ffi==0.1.11", "uvicorn==0.50.0", "openai==2.6.1",
                "dill==0.4.1", "annotated-doc"]
    assert sp.bundle_pins(reqs, defaults, sp.default_environment("3.12")) == [
        "flashinfer-python==0.7.2",  # the release's == pin wins
        "apache-tvm-ffi==0.1.11",  # the default meets the release's range
        "uvicorn>=0.51",  # the default does not: the range
        "openai==2.8.0",
        "dill==0.4.1",  # the release leaves it open
        "annotated-doc",
    ]


def _wheel(path: Path, metadata: str) -> Path:
    with zipfile.ZipFile(path, "w") as wheel:
        wheel.writestr("sglang/__init__.py", "")
        wheel.writestr("sglang-0.5.99.dist-info/METADATA", metadata)
    return path


def _checkout(root: Path, name: str = "sglang", deps: str = '["transformers==5.3.0", "IPython"]') -> Path:
    (root / "python").mkdir(parents=True)
    (root / "python" / "pyproject.toml").write_text(
        f'[project]\nname = "{name}"\ndynamic = ["version"]\ndependencies = {deps}\n')
    return root


def test_requirements_from_a_wheel_a_metadata_file_and_a_checkout(tmp_path):
    wheel = _wheel(tmp_path / "sglang-0.5.99-py3-none-any.whl", METADATA)
    assert sp.requirements_from_source(wheel) == sp.requirements_from_metadata(METADATA)
    (tmp_path / "METADATA").write_text(METADATA)
    assert sp.requirements_from_source(tmp_path / "METADATA") == sp.requirements_from_metadata(METADATA)
    checkout = _checkout(tmp_path / "clone")
    assert sp.pins(sp.requirements_from_source(checkout), ["transformers", "ipython", "numpy"], ENV) == [
        "transformers==5.3.0", "ipython", "numpy"]


def test_what_is_not_a_checkout(tmp_path):
    with pytest.raises(sp.InputError, match="is not an SGLang checkout: it has no python/pyproject.toml"):
        sp.checkout_pyproject(tmp_path)
    other = _checkout(tmp_path / "other", name="vllm")
    with pytest.raises(sp.InputError, match="names project 'vllm', not 'sglang'"):
        sp.checkout_pyproject(other)
    broken = tmp_path / "broken"
    (broken / "python").mkdir(parents=True)
    (broken / "python" / "pyproject.toml").write_text("[project\n")
    with pytest.raises(sp.InputError, match="is not TOML"):
        sp.checkout_pyproject(broken)
    dynamic = _checkout(tmp_path / "dynamic", deps='["x"]\ndynamic = ["dependencies"]')
    (dynamic / "python" / "pyproject.toml").write_text('[project]\nname = "sglang"\ndynamic = ["dependencies"]\n')
    with pytest.raises(sp.InputError, match="dynamically"):
        sp.requirements_from_source(dynamic)


# --- choosing the release ----------------------------------------------------------------------------------

LISTING = """\
WARNING: pip index is currently an experimental command. It may be removed/changed in a future release.
sglang (0.5.24rc0)
Available versions: 0.5.24rc0, 0.5.23, 0.5.22, 0.5.12.post1, 0.5.12, 0.5.10.post1, 0.5.10, 0.5.10rc0, 0.5.9
  INSTALLED: 0.5.23
  LATEST:    0.5.24rc0
"""


def test_select_the_newest_final_release_or_the_one_asked_for():
    listing = sp.listed_versions(LISTING)
    assert listing[:3] == ["0.5.24rc0", "0.5.23", "0.5.22"]
    assert sp.select(listing) == "0.5.23"  # no rc by default
    assert sp.select(["0.5.12", "0.5.12.post1", "0.5.11"]) == "0.5.12.post1"
    assert sp.select(listing, "0.5.12.post1") == "0.5.12.post1"
    assert sp.select(listing, "0.5.24rc0") == "0.5.24rc0"  # an rc asked for by name
    assert sp.select(listing, "0.5.22.0") == "0.5.22"  # the index's spelling
    with pytest.raises(sp.InputError, match="sglang 0.5.21 does not exist on the package index"):
        sp.select(listing, "0.5.21")
    with pytest.raises(sp.InputError, match="older than the oldest supported release"):
        sp.select(listing, "0.5.9")
    with pytest.raises(sp.InputError, match="cannot tell the newest sglang release"):
        sp.select(["0.5.9", "0.5.10rc0"])
    with pytest.raises(sp.InputError, match="cannot tell the newest sglang release"):
        sp.select(sp.listed_versions("ERROR: No matching distribution found for sglang"))


def test_helper_command_line_reports_bad_input_in_one_line(capsys, tmp_path):
    assert sp.main(["check-version", "0.5.9"]) == 2
    err = capsys.readouterr().err
    assert err == "error: sglang 0.5.9 is older than the oldest supported release 0.5.10\n"
    assert sp.main(["check-checkout", str(tmp_path)]) == 2
    assert capsys.readouterr().err.count("\n") == 1
    assert sp.main(["check-version", "0.5.12.post1"]) == 0
    assert capsys.readouterr().out == "0.5.12.post1\n"
    (tmp_path / "METADATA").write_text(METADATA)
    assert sp.main(["pins", str(tmp_path / "METADATA"), "transformers", "triton"]) == 0
    assert capsys.readouterr().out == "transformers==5.19.0\ntriton\n"


# --- the scripts refuse bad input before any network access ------------------------------------------------

def _run(script: Path, *args: str, venv: str) -> subprocess.CompletedProcess:
    # No index for pip (PIP_NO_INDEX) and a venv that does not exist: bad input must be refused before either
    # is needed, so the one line is the refusal, not a failure further on.
    env = dict(os.environ, VENV=venv, PIP_NO_INDEX="1", PYTHON=sys.executable)
    return subprocess.run(["bash", str(script), *args], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=120)


def _one_line(result: subprocess.CompletedProcess, *needles: str) -> str:
    lines = result.stderr.strip().splitlines()
    assert result.returncode == 2, (result.returncode, result.stdout, result.stderr)
    assert len(lines) == 1 and lines[0].startswith("error: "), result.stderr
    assert "Traceback" not in result.stderr and result.stdout == ""
    for needle in needles:
        assert needle in lines[0], lines[0]
    return lines[0]


@pytest.mark.parametrize("arg, needles", [
    ("0.5.9", ("sglang 0.5.9 is older than the oldest supported release 0.5.10",)),
    ("0.4.10.post2", ("older than the oldest supported release 0.5.10",)),
    ("not-a-version", ("'not-a-version' is not a version",)),
    ("./no/such/dir", ("./no/such/dir is not a directory",)),
])
def test_install_script_refuses_bad_versions(tmp_path, arg, needles):
    _one_line(_run(SCRIPT, arg, venv=str(tmp_path / "no-venv")), *needles)


def test_install_script_refuses_a_directory_that_is_not_a_checkout(tmp_path):
    plain = tmp_path / "plain"
    plain.mkdir()
    _one_line(_run(SCRIPT, str(plain), venv=str(tmp_path / "no-venv")), "is not an SGLang checkout",
              "no python/pyproject.toml")
    other = _checkout(tmp_path / "other", name="not-sglang")
    _one_line(_run(SCRIPT, str(other), venv=str(tmp_path / "no-venv")), "names project 'not-sglang'")


def test_install_script_takes_one_argument(tmp_path):
    _one_line(_run(SCRIPT, "0.5.22", "0.5.23", venv=str(tmp_path / "no-venv")), "usage:")


def test_gpu_bundle_script_refuses_bad_versions(tmp_path):
    _one_line(_run(GPU_SCRIPT, "0.5.9", venv=str(tmp_path / "no-venv")), "older than the oldest supported")
    _one_line(_run(GPU_SCRIPT, "nope", venv=str(tmp_path / "no-venv")), "'nope' is not a version")


def _index_reachable() -> bool:
    try:
        probe = subprocess.run([sys.executable, "-m", "pip", "index", "versions", "sglang", "--timeout", "5",
                                "--retries", "0", "--disable-pip-version-check"], capture_output=True, text=True,
                               timeout=60)
    except (OSError, subprocess.TimeoutExpired):
        return False
    return probe.returncode == 0 and "Available versions:" in probe.stdout


def test_install_script_refuses_a_version_the_index_does_not_have():
    if not _index_reachable():
        pytest.skip("the package index cannot be reached")
    # The venv running the tests (it has torch). The listing refuses the version before any install; were it
    # ever published, PIP_DRY_RUN still keeps every `pip install` from changing that venv.
    env = dict(os.environ, VENV=sys.prefix, PIP_DRY_RUN="1")
    result = subprocess.run(["bash", str(SCRIPT), "0.5.10.post99"], cwd=ROOT, env=env, capture_output=True,
                            text=True, timeout=300)
    _one_line(result, "sglang 0.5.10.post99 does not exist on the package index")
