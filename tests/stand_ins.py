"""A stand-in property for the search's own tests: what ``search_row`` reads of a property, and a record of every
batch it was given; each test says what the stand-in answers (``run``)."""

from __future__ import annotations

import dataclasses

from search.matrix import matrix_rows
from search.profiles import PROFILES


@dataclasses.dataclass(frozen=True)
class StandInProperty:
    seen: list = dataclasses.field(default_factory=list, compare=False, hash=False)
    name: str = "outputs"
    strategy_options: tuple = ()
    runs_twice: bool = False
    before = None  # Property.before: no batch run ahead of the drawn one

    def options(self, composition, mode) -> dict:
        return dict(self.strategy_options)

    def run(self, composition, spec, device):
        raise NotImplementedError


def row_with(prop, profile=PROFILES["ci"]):
    """The torch_native extend outputs row, searched with ``prop`` instead."""
    row = matrix_rows("cpu", profile, ["torch_native"], ["outputs"], ["extend"])[0][0]
    return dataclasses.replace(row, property=prop)
