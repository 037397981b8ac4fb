"""Profiles and their head rotation: NAME@K picks a rotation, a plain name takes the day's plus the shard's,
every rotating configuration comes round within a week of two-shard nightly runs."""

from __future__ import annotations

import datetime
import os

import pytest

from search.profiles import PROFILES, ProfileError, profile


def test_a_profile_without_rotation_is_itself():
    assert profile("ci") is PROFILES["ci"]
    assert profile("ci").heads == PROFILES["ci"].head_configs


def test_name_at_k_picks_the_rotation():
    gpu = profile("gpu@3")
    assert gpu.name == "gpu@3" and gpu.base_name == "gpu"
    assert gpu.heads == PROFILES["gpu"].head_configs + (PROFILES["gpu"].rotating_head_configs[3],)
    assert profile(gpu.name) == gpu  # what workers and case files receive names the same profile


def test_the_day_and_the_shard_rotate_and_cover_every_configuration_in_a_week():
    start = datetime.date(2026, 1, 5)
    for name in ("gpu", "nightly"):
        n = len(PROFILES[name].rotating_head_configs)
        seen = {profile(name, shard, start + datetime.timedelta(days=d)).rotation
                for d in range(7) for shard in (0, 1)}
        assert seen == set(range(n))
        assert profile(name, 0, start).rotation != profile(name, 1, start).rotation


@pytest.mark.parametrize("name, message", [("nosuch", "unknown profile"), ("gpu@x", "rotation number"),
                                           ("ci@1", "no rotating head configurations")])
def test_bad_names(name, message):
    with pytest.raises(ProfileError, match=message):
        profile(name)


@pytest.mark.parametrize("device, backend, slow, long_drawn", [
    ("cpu", "triton", True, False), ("cpu", "triton", False, False), ("cpu", "torch_native", False, True),
    ("cuda", "triton", True, True)])
def test_interpreted_rows_on_a_cpu_draw_no_long_context(monkeypatch, tmp_path, device, backend, slow, long_drawn,
                                                         cpu_rows_listed):
    """A nightly case of interpreted Triton over 36k cached keys ran for over 25 minutes: on a CPU the rows
    whose kernels are interpreted search without the long-context shape, whether or not they declare slow_on_cpu
    (SGLang's Triton does not: it draws the profile's examples); the PyTorch backends and a GPU keep it. Only a
    slow_on_cpu row draws fewer examples there."""
    import dataclasses

    import search.search_row as search_row_module
    from search.matrix import matrix_rows

    nightly = profile("nightly")
    row = next(r for r in matrix_rows("cpu", nightly, [backend])[0] if r.id == f"{backend}-extend-outputs")
    support = row.composition.support()
    assert support.interpreted_on_cpu == (backend == "triton")
    if not slow:  # an interpreted composition that is not declared slow, as SGLang's Triton backend is
        monkeypatch.setattr(type(row.composition), "support",
                            lambda self: dataclasses.replace(support, slow_on_cpu=None))
    seen = []

    def capture(row, profile):
        seen.append(profile)
        raise RuntimeError("captured")

    monkeypatch.setattr(search_row_module, "row_strategy", capture)
    settings = []
    real_settings = search_row_module.hypothesis_settings
    monkeypatch.setattr(search_row_module, "hypothesis_settings",
                        lambda profile, **kw: settings.append(kw["max_examples"]) or real_settings(profile, **kw))
    with pytest.raises(RuntimeError, match="captured"):
        search_row_module.search_row(row, nightly, device, out_dir=tmp_path)
    assert (seen[0].long_context is not None) == long_drawn
    assert seen[0].long_context in (None, nightly.long_context) and seen[0].name == nightly.name
    capped = device == "cpu" and slow and bool(nightly.slow_row_examples)
    # The harness's own backends are also a control sample (Profile.control_examples)
    limits = [n for n in (nightly.slow_row_examples if capped else None, nightly.control_examples) if n]
    assert settings == [min(limits) if limits else None]


@pytest.mark.device  # what it checks differs on a GPU host
def test_a_broken_triton_interpreter_makes_interpreted_rows_unavailable_not_findings(monkeypatch):
    # The lent GPU host's image (triton 3.6.0): every interpreted kernel raised a TypeError inside Triton's
    # interpreter, and a CPU sweep there blamed 480 cases on the backends.
    from backends import interpreter
    from backends.registry import leaf_capabilities

    monkeypatch.setenv("TRITON_INTERPRET", "1")
    fault = "Triton's interpreter fails on this machine (triton 3.6.0, numpy 2.5.2): InterpreterError: TypeError(...)"
    monkeypatch.setattr(interpreter, "interpreter_fault", lambda: fault)
    assert leaf_capabilities("triton").unavailable_reason("cpu") == fault
    assert leaf_capabilities("torch_native").unavailable_reason("cpu") is None  # no interpreter, no question


@pytest.mark.device  # what it checks differs on a GPU host
def test_the_interpreter_probe_passes_where_the_interpreter_works(monkeypatch):
    import torch

    if torch.cuda.is_available():
        pytest.skip("a GPU host's tests run Triton compiled, never interpreted (and the lent image's interpreter, "
                    "triton 3.6.0, is broken: its CPU rows are then unavailable, the test above)")
    from backends.interpreter import interpreter_fault

    monkeypatch.setenv("TRITON_INTERPRET", "1")
    pytest.importorskip("triton")
    assert interpreter_fault() is None


@pytest.mark.device  # what it checks differs on a GPU host
def test_a_switch_set_after_triton_was_imported_is_not_taken_for_an_interpreter(monkeypatch):
    """On the lent H100, a CPU-device test set TRITON_INTERPRET=1 in a pytest worker that had imported triton:
    SGLang's kernels defined later were interpreted, triton's own stayed compiled, and every SGLang Triton row on
    the GPU then crashed in that worker ("Cannot call @triton.jit'd outside of the scope of a kernel")."""
    triton = pytest.importorskip("triton")
    from triton.runtime.jit import JITFunction

    from backends import interpreter
    from backends.registry import leaf_capabilities
    from harness.options import resolve_device

    standard = triton.language.standard
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    compiled_max = JITFunction(standard.max.fn) if not isinstance(standard.max, JITFunction) else standard.max
    monkeypatch.setattr(standard, "max", compiled_max)  # triton as imported before the switch was set
    monkeypatch.setattr(interpreter, "environment_fault", lambda: pytest.fail("probed in a process that cannot tell"))
    assert "after triton was imported" in interpreter.interpreter_fault()
    assert "after triton was imported" in leaf_capabilities("triton").unavailable_reason("cpu")
    monkeypatch.delenv("TRITON_INTERPRET")
    assert resolve_device("cpu") == "cpu" and "TRITON_INTERPRET" not in os.environ  # too late: left unset


def test_the_interpreter_probe_runs_once_per_environment(monkeypatch, tmp_path):
    # Every process of a sweep asks; the probe imports Triton and runs a kernel (seconds): its verdict is kept
    from backends import interpreter

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    calls = []
    monkeypatch.setattr(interpreter, "_probe", lambda: calls.append(1) or "broken here")
    for env in ("triton 3.6.0 ...", "triton 3.6.0 ...", "triton 3.8.0 ..."):
        monkeypatch.setattr(interpreter, "_environment", lambda env=env: env)
        interpreter.environment_fault.cache_clear()
        assert interpreter.environment_fault() == "broken here"
    assert len(calls) == 2  # once per environment, the second process read the first one's verdict
    interpreter.environment_fault.cache_clear()


def test_draws_take_no_constants_from_local_source():
    # Hypothesis parses every loaded module outside site-packages for literals to draw; with SGLang as a source
    # checkout that is ~1,000 modules (18 s a process), and a loaded CPU campaign called a worker's first draw a
    # hang (search/strategies.py). The harness's own modules are local here, so without the switch this pool fills.
    import search.strategies  # noqa: F401 - importing it turns the pool off
    from hypothesis.internal.conjecture import providers

    assert len(providers._get_local_constants().integers) == 0


def test_a_test_that_takes_the_device_is_marked_for_the_gpu_runner(request, device):
    # ci/gpu.sh runs `pytest -m device`: a test handed the device must be among them, or the GPU never runs it
    assert request.node.get_closest_marker("device") is not None


def test_a_test_that_runs_alike_on_any_host_is_left_to_the_cpu_ci(request):
    assert request.node.get_closest_marker("device") is None
