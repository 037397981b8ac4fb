"""Test configuration: device, Triton interpreter, Hypothesis profiles and the example database.

Options: ``--profile`` (ci, dev, nightly, gpu) selects the Hypothesis settings and kernel configuration;
``--backends`` restricts the matrix to compositions made of the named backends (or given as terms).
"""

from __future__ import annotations

import os

import torch

# Triton must see this before its first import: on a machine without a GPU its kernels are interpreted.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

# Under pytest-xdist, each worker gets its share of the cores: torch's default, a thread per core in every worker,
# oversubscribes them (the matrix's tests with -n 2 on 2 cores: 204 s, with a thread a worker 153 s). Set in the
# environment too, for the harness processes a test starts.
_workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "0"))
if _workers > 1:
    _threads = max(1, (os.cpu_count() or 1) // _workers)
    if "OMP_NUM_THREADS" not in os.environ:  # a setting of the user's own (perhaps OpenMP's "4,2") is theirs
        os.environ["OMP_NUM_THREADS"] = str(_threads)
        torch.set_num_threads(_threads)

import pytest  # noqa: E402
from hypothesis import settings  # noqa: E402
from hypothesis.database import DirectoryBasedExampleDatabase  # noqa: E402

from search.profiles import PROFILES, hypothesis_settings  # noqa: E402
from search.profiles import profile as named_profile  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def pytest_addoption(parser):
    parser.addoption("--profile", default=os.environ.get("HARNESS_PROFILE", "ci"),
                     help=f"harness profile ({', '.join(PROFILES)}; NAME@K picks head rotation K): Hypothesis "
                          f"settings and kernel configuration")
    parser.addoption("--backends", nargs="*", default=None,
                     help="restrict the matrix to these backends or composition terms")


# Tests that reach the machine's accelerator where it has one: the ``device`` fixture's (it answers "cuda" there),
# the GPU kernels' and Triton kernel tests (tests/gpu, tests/triton_kernels), and those marked ``device`` by hand
# because what they check depends on the host having a GPU. The rest run alike on any host: the GPU runner's job
# (ci/gpu.sh) runs only these (``-m device``), as the CPU CI runs every test.
DEVICE_FOLDERS = ("gpu", "triton_kernels")


def pytest_collection_modifyitems(config, items):
    tests = config.rootpath / "tests"
    for item in items:
        folder = item.path.relative_to(tests).parts[0] if item.path.is_relative_to(tests) else ""
        if "device" in getattr(item, "fixturenames", ()) or item.get_closest_marker("gpu") or \
                folder in DEVICE_FOLDERS:
            item.add_marker(pytest.mark.device)


def pytest_configure(config):
    profile = named_profile(config.getoption("--profile"))
    db = DirectoryBasedExampleDatabase(os.path.join(config.rootpath, ".hypothesis", "examples"))
    settings.register_profile("harness-tests", hypothesis_settings(profile, database=db))
    settings.load_profile("harness-tests")


@pytest.fixture(scope="session")
def device() -> str:
    return DEVICE


@pytest.fixture(scope="session")
def profile(request):
    return named_profile(request.config.getoption("--profile"))


@pytest.fixture
def cpu_rows_listed(monkeypatch):
    """For tests of the planning over a CPU's rows (matrix, groups, budgets) that run no kernel: every CPU row is
    listed whatever this host can run. A GPU host's pytest never switches Triton's interpreter on (it would interpret
    the GPU rows' kernels too), the lent image's interpreter is broken (backends/interpreter.py), and SGLang's CPU
    path needs a host without CUDA (backends/sglang/runtime.py cpu_on_a_cuda_host); there such a test would plan
    over fewer rows and fail for the host's sake."""
    from backends import base, interpreter
    from backends.sglang import runtime

    real = base.env_flag
    monkeypatch.setattr(base, "env_flag", lambda name: name == "TRITON_INTERPRET" or real(name))
    monkeypatch.setattr(interpreter, "interpreter_fault", lambda: None)
    monkeypatch.setattr(runtime, "cpu_on_a_cuda_host", lambda: None)
