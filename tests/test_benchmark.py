"""``benchmarks/throughput.py``: row by row and one batch for every composition (``--shared``) time the same rows,
each row its cases, and a failure the ledger explains is counted as known, apart from new ones."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def benchmark(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "benchmarks/throughput.py", "--device", "cpu", "--profile", "ci",
                           "--backends", "torch_native", "--modes", "decode", "--properties", "outputs", "cache",
                           "--cases", "3", "--warmup", "0", *args],
                          cwd=ROOT, capture_output=True, text=True, timeout=300)


@pytest.mark.parametrize("shared", [False, True])
def test_every_row_gets_its_cases_and_each_unit_is_printed_when_done(shared):
    out = benchmark(*(["--shared"] if shared else []))
    assert out.returncode == 0, out.stdout + out.stderr
    table = out.stdout.splitlines()
    total = next(line for line in table if line.startswith("all "))
    assert int(total.split()[1]) == 4 * 3  # torch_native and tbo(torch_native), outputs and cache: 3 cases each
    assert float(total.split()[3]) > 0  # the engine-only loop's cases/s over the same batches
    assert "of the engine-only loop's over the same batches" in out.stdout
    assert "first case: every unit's took" in out.stdout and "GPU busy: not measured (no GPU: cpu)" in out.stdout
    units = [line for line in table[1:] if not line.startswith(("all ", "checked cases/s", "first case", "GPU busy"))]
    assert len(units) == (1 if shared else 4)
    assert all(f"[{n}/{len(units)}]" in out.stderr for n in range(1, len(units) + 1))  # as each one ends
    if shared:
        assert units[0].startswith("decode: torch_native, tbo(torch_native) (4 rows)")


def test_bad_input_is_one_line():
    out = benchmark("--cases", "0")
    assert out.returncode == 2 and len(out.stderr.strip().splitlines()) == 1, out.stderr


@pytest.mark.parametrize("shared", [False, True])
def test_known_bugs_stop_costing_cases(shared):
    """SGLang's torch_native ignores a soft-cap and KV scales (two ledger entries, steerable): after a row's first case
    of each, its batches with what that bug needs are not run, and the last column counts them."""
    from backends.registry import parse

    why = parse("sglang.torch_native").unavailable_reason("cpu")
    if why:
        pytest.skip(why)
    out = subprocess.run([sys.executable, "benchmarks/throughput.py", "--device", "cpu", "--profile", "ci",
                          "--backends", "sglang.torch_native", "--modes", "decode", "--properties",
                          "refuse_or_correct", "--cases", "6", "--warmup", "0", *(["--shared"] if shared else [])],
                         cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout + out.stderr
    (row,) = [line for line in out.stdout.splitlines()[1:]
              if not line.startswith(("all ", "checked cases/s", "first case", "GPU busy"))]
    cases, *_, fails, known, steered, first = row.split()[-12:]
    assert int(fails) == 0 and int(known) >= 1 and int(steered) > 0 and int(cases) < 6, row


def test_the_busy_fraction_is_the_mean_of_the_utilization_read_while_units_were_timed():
    import time

    sys.path.insert(0, str(ROOT / "benchmarks"))
    from throughput import BusySampler

    readings = iter([40, 60, 80, 100] + [100] * 1000)
    sampler = BusySampler(lambda: next(readings), period=0.01)
    time.sleep(0.3)
    sampler.stop()
    assert [pct for _, pct in sampler.samples[:4]] == [40, 60, 80, 100]
    everything = (sampler.samples[0][0], sampler.samples[-1][0])
    assert 0.7 < sampler.busy([everything]) <= 1.0
    first_two = (sampler.samples[0][0], sampler.samples[1][0])  # a unit timed while the first two were read
    assert sampler.busy([first_two]) == 0.5 and sampler.busy([(0.0, 1.0)]) is None

    def no_nvml() -> float:
        raise ModuleNotFoundError("pynvml")

    broken = BusySampler(no_nvml, period=0.01)
    assert broken.tried.wait(5)
    broken.stop()
    assert broken.busy([everything]) is None and "pynvml" in broken.error


def test_nvidia_smi_is_asked_for_the_visible_device():
    sys.path.insert(0, str(ROOT / "benchmarks"))
    from throughput import smi_device

    assert smi_device(0, "3") == "3" and smi_device(1, "2, GPU-abc") == "GPU-abc"
    assert smi_device(0, "") == "0" and smi_device(2, "1") == "2"


def test_workers_engine_only_loops_run_side_by_side_so_the_slowest_is_theirs():
    """The limit of several workers is theirs together, as their checked rate is: a sum of their loops' times counted
    the device as running one worker at a time (4 workers' checked rate read 1.67 times their "limit" on an H200)."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import throughput

    parts = [throughput.RowTiming("r", "c", "decode", "outputs", 10, 0, dict.fromkeys(throughput.PHASES, 1.0),
                                  started=0.0, finished=2.0, engine_seconds=seconds) for seconds in (2.0, 3.0)]
    whole = throughput.combine(parts)
    assert whole.cases == 20 and whole.cases_per_second == 10.0 and whole.limit == 20 / 3.0


def test_workers_time_each_unit_together_and_say_their_engine_only_rate():
    out = benchmark("--workers", "2", "--shared", "--mps")
    assert out.returncode == 0, out.stdout + out.stderr
    total = next(line for line in out.stdout.splitlines() if line.startswith("all "))
    assert int(total.split()[1]) == 2 * 4 * 3 and float(total.split()[3]) > 0
    assert "MPS: asked for, but it serves several workers on a GPU: not used" in out.stderr


@pytest.mark.parametrize("shared", [False, True])
def test_a_workers_engine_only_loop_runs_between_two_barriers_after_its_timed_part(shared, monkeypatch):
    """Every worker times the unit, waits, runs its engine-only loop, and waits again: the loops run side by side and
    none runs beside another worker's next unit (whose checks would slow it, and the max would take that one)."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import throughput

    from search.group import group_rows
    from search.matrix import matrix_rows
    from search.profiles import profile

    waits: list[str] = []

    class Barrier:
        def wait(self) -> None:
            waits.append("wait")

    real = throughput.engine_only
    monkeypatch.setattr(throughput, "engine_only", lambda *a: waits.append("engine") or real(*a))
    rows, _ = matrix_rows("cpu", profile("ci"), ["torch_native"], ["outputs"], ["decode"])
    unit = group_rows(rows, profile("ci"), "cpu")[0] if shared else rows[0]
    timing = throughput.bench(unit, profile("ci"), "cpu", 1, 0, 0, Barrier())
    assert waits == ["wait", "wait", "engine", "wait"] and timing.engine_seconds > 0
