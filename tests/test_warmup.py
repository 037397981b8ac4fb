"""``harness warmup``: the kernel variants a profile's rows need, listed from seeded draws, each run once in parallel
processes; a process that dies is replaced and the warmup goes on."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

from batch.spec import BatchSpec, ForwardMode, MHALayer, MLALayer
from harness.warmup import Pool, interleave, kernel_variants, leaf_rows, warm_order
from search.matrix import matrix_rows
from search.profiles import PROFILES

ROOT = Path(__file__).resolve().parents[1]


def warmup(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "harness", "warmup", "--device", "cpu", *args], cwd=ROOT,
                          capture_output=True, text=True, timeout=600)


def test_a_batchs_variants_are_its_layers_compiled_features():
    spec = BatchSpec(ForwardMode.DECODE, (3, 1), (1, 1),
                     (MHALayer(0, 8, 2, 64, 64, sliding_window=5), MHALayer(1, 8, 2, 64, 64, logit_cap=30.0),
                      MHALayer(2, 8, 2, 64, 64)), kv_cache_dtype="fp8_e4m3")
    assert kernel_variants(spec) == {
        ("mha", (8, 2, 64, 64), True, False, "fp8_e4m3", False),
        ("mha", (8, 2, 64, 64), False, True, "fp8_e4m3", False),
        ("mha", (8, 2, 64, 64), False, False, "fp8_e4m3", False)}
    mla = BatchSpec(ForwardMode.EXTEND, (0,), (2,), (MLALayer(0, 4), MHALayer(1, 4, 4, 32, 32)))
    assert kernel_variants(mla) == {("mla", (4, 128, 64, 512, 128), False, False, "auto", False),
                                    ("mha", (4, 4, 32, 32), False, False, "auto", False)}


def test_each_leaf_is_warmed_by_its_simplest_outputs_row():
    rows = matrix_rows("cpu", PROFILES["ci"], ["torch_native", "tbo(torch_native)", "linear_torch",
                                               "hybrid(torch_native,linear_torch)"], None, ["decode"])[0]
    chosen = leaf_rows(rows)
    assert chosen[("torch_native", "decode")].id == "torch_native-decode-outputs"
    # An idle batch runs no attention kernel: nothing to warm (on the H100 the first 12 FlashInfer "builds" warmed
    # were idle rows', 2 s each)
    idle = matrix_rows("cpu", PROFILES["ci"], ["torch_native"], None, ["idle"])[0]
    assert idle and leaf_rows(idle) == {}
    assert chosen[("linear_torch", "decode")].id == "linear_torch-decode-outputs"
    assert set(chosen) == {("torch_native", "decode"), ("linear_torch", "decode")}


def test_interleaving_puts_different_kernels_side_by_side():
    tasks = [("a", 1), ("a", 2), ("a", 3), ("b", 1), ("c", 1), ("c", 2)]
    assert interleave(tasks, key=lambda t: t[0]) == [("a", 1), ("b", 1), ("c", 1), ("a", 2), ("c", 2), ("a", 3)]


def test_the_slow_builders_variants_go_first_each_kind_interleaved():
    # On a cold H100 the interleaved order started its first FlashInfer build 2.5 minutes in and never reached the
    # prefill modules in 9 minutes (gpu53.sh): the nvcc builds must all be under way from the start.
    tasks = [("triton", "v1"), ("triton", "v2"), ("flashinfer", "v1"), ("sglang.flashinfer", "v1"),
             ("flashinfer", "v2"), ("torch_native", "v1")]
    ordered = warm_order(tasks, leaf=lambda t: t[0], variant=lambda t: t[1])
    assert ordered == [("flashinfer", "v1"), ("flashinfer", "v2"), ("sglang.flashinfer", "v1"),
                       ("triton", "v1"), ("triton", "v2"), ("torch_native", "v1")]


def test_the_list_is_fixed_and_the_warmup_runs_each_variant_once():
    args = ["--backends", "torch_native", "--modes", "decode", "extend", "--profile", "ci"]
    listed = [warmup(*args, "--list") for _ in range(2)]
    assert all(out.returncode == 0 for out in listed), listed[0].stderr
    # Seeded: the same variants (past the header and the line with the time it took)
    assert listed[0].stdout.splitlines()[2:] == listed[1].stdout.splitlines()[2:]
    lines = listed[0].stdout.splitlines()
    assert "torch_native decode (by torch_native-decode-outputs):" in lines
    variants = [line for line in lines if line.startswith("    ")]
    assert any("window" in v for v in variants) and any("fp8" in v for v in variants)
    out = warmup(*args, "--workers", "2")
    assert out.returncode == 0, out.stdout + out.stderr
    assert f"warmup: {len(variants)} of {len(variants)} variant(s) run in" in out.stdout
    assert "0 raised" in out.stdout


def _die_on(x: int) -> int:
    """A task whose process dies on 3 (as a kernel's segfault would), once: the marker file says it did."""
    marker = Path(os.environ["WARMUP_TEST_MARKER"])
    if x == 3 and not marker.exists():
        marker.write_text("died")
        os._exit(1)
    time.sleep(0.05)
    return x * 10


def test_a_process_that_dies_is_replaced_and_the_warmup_goes_on(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("WARMUP_TEST_MARKER", str(tmp_path / "died"))
    pool = Pool("cpu", 2)
    done = {}
    try:
        assert pool.map(_die_on, [(i,) for i in range(6)], time.time() + 300, lambda t, r: done.update({t[0]: r}))
    finally:
        pool.close()
    assert done == {i: i * 10 for i in range(6)} and pool.died == 0  # 3 went again, alone, and passed
    assert "a worker process died" in capsys.readouterr().out


def _always_die_on(x: int) -> int:
    if x == 3:
        os._exit(1)
    time.sleep(0.05)
    return x * 10


def test_a_case_that_always_kills_its_process_is_dropped_and_the_rest_run(capsys):
    """Found by review: the case that killed the pool went first again into each fresh pool, so one crashing variant
    ended the whole warmup (as bad input, exit 2) after 2 of 30 cases."""
    from concurrent.futures.process import BrokenProcessPool

    pool = Pool("cpu", 2)
    done = {}
    try:
        assert pool.map(_always_die_on, [(i,) for i in range(12)], time.time() + 300,
                        lambda t, r: done.update({t[0]: r}))
    finally:
        pool.close()
    assert pool.died == 1 and isinstance(done.pop(3), BrokenProcessPool)
    assert done == {i: i * 10 for i in range(12) if i != 3}


def _build_for_a_minute() -> None:
    """A case stuck in a build: a child process (as nvcc is), its pid left in the marker file."""
    build = subprocess.Popen(["sleep", "60"])
    Path(os.environ["WARMUP_TEST_MARKER"]).write_text(str(build.pid))
    build.wait()


def _gone_or_zombie(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1][:3]  # the name before it may hold a ")"
    except (FileNotFoundError, ProcessLookupError):  # reaped, possibly between opening the file and reading it
        return True
    return "Z" in state


def test_the_budget_stops_the_warmup_and_the_builds_it_started(tmp_path, monkeypatch):
    monkeypatch.setenv("WARMUP_TEST_MARKER", str(tmp_path / "build.pid"))
    pool = Pool("cpu", 1)
    started = time.time()
    try:
        assert not pool.map(_build_for_a_minute, [()], time.time() + 8, lambda t, r: None)
    finally:
        pool.close()
    assert time.time() - started < 20
    build = int((tmp_path / "build.pid").read_text())
    for _ in range(50):  # SIGKILL is delivered at once; the zombie's parent (the pool process) is gone too
        if _gone_or_zombie(build):
            break
        time.sleep(0.1)
    else:
        raise AssertionError(f"the build (pid {build}) outlived the warmup's budget")
