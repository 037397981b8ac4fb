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
    units = [line for line in table[1:] if not line.startswith("all ")]
    assert len(units) == (1 if shared else 4)
    assert all(f"[{n}/{len(units)}]" in out.stderr for n in range(1, len(units) + 1))  # as each one ends
    if shared:
        assert units[0].startswith("decode: torch_native, tbo(torch_native) (4 rows)")


def test_bad_input_is_one_line():
    out = benchmark("--cases", "0")
    assert out.returncode == 2 and len(out.stderr.strip().splitlines()) == 1, out.stderr
