"""The matrix: one test per (composition, mode, property) row derived from the backends' declarations.

``pytest -k 'hybrid and decode and outputs'`` selects rows; ``--backends`` and ``--profile`` shape the
matrix. A failing row writes its shrunk case under harness-out/cases and ends its message with the
command that replays it.
"""

from __future__ import annotations

import pytest
import torch

from search.matrix import matrix_rows
from search.profiles import profile as named_profile
from search.search_row import search_row

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def pytest_generate_tests(metafunc):
    if "row" not in metafunc.fixturenames:
        return
    profile = named_profile(metafunc.config.getoption("--profile"))
    rows, skipped = matrix_rows(DEVICE, profile, metafunc.config.getoption("--backends"))
    params = [pytest.param(r, id=r.id) for r in rows]
    params += [pytest.param(None, id=f"{c}-unavailable", marks=pytest.mark.skip(reason=f"{c}: {why}"))
               for c, why in skipped]
    metafunc.parametrize("row", params)


def test_row(row, profile, device):
    from hypothesis import settings

    result = search_row(row, profile, device, database=settings.default.database)
    if not result.ok:
        message = f"{row.id}: {result.failure}"
        if result.case_file:
            message += f"\nshrunk case: {result.spec.batch_size} request(s), {result.spec.num_tokens} token(s)"
            message += f"\nreproduce with: python -m harness repro {result.case_file}"
        pytest.fail(message, pytrace=False)
    assert result.cases > 0, "the search ran no example"
