"""The example database works for seeded searches (every sweep round is one): a failure found once is saved,
and the next search of the row replays it first, whatever its seed. From a folder and from Redis."""

from __future__ import annotations

import dataclasses
import shutil
import socket
import subprocess
import time

import pytest

from properties.verdict import Verdict
from search.profiles import PROFILES
from search.search_row import search_row
from tests.stand_ins import StandInProperty, row_with

PROFILE = PROFILES["ci"]


@dataclasses.dataclass(frozen=True)
class FailsOnThreeTokens(StandInProperty):
    """Fails on any batch of 3 tokens or more (never on Hypothesis's first, minimal example)."""

    def run(self, composition, spec, device) -> Verdict:
        ok = spec.num_tokens < 3
        self.seen.append((spec, ok))
        return Verdict(self.name, ok, "ok" if ok else "too many tokens")


def replayed_first(database, tmp_path) -> None:
    first = FailsOnThreeTokens()
    found = search_row(row_with(first), PROFILE, "cpu", database=database, max_examples=50, out_dir=tmp_path,
                       seed=1)
    assert not found.ok, "the stand-in property should fail within 50 examples"
    assert first.seen[0][1], "the first case of a fresh search is the minimal one, which passes"

    again = FailsOnThreeTokens()
    replay = search_row(row_with(again), PROFILE, "cpu", database=database, max_examples=50, out_dir=tmp_path,
                        seed=2)
    assert not replay.ok
    spec, ok = again.seen[0]
    assert not ok, "the saved failure was not replayed first"
    assert spec == found.spec  # the shrunk failure of the first search


def test_seeded_search_saves_and_replays_from_a_folder(tmp_path):
    from hypothesis.database import DirectoryBasedExampleDatabase

    folder = tmp_path / "examples"
    replayed_first(DirectoryBasedExampleDatabase(str(folder)), tmp_path)
    assert any(p.is_file() for p in folder.rglob("*")), "nothing was saved in the folder"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def redis_url(tmp_path):
    server = shutil.which("redis-server")
    if server is None:
        pytest.skip("redis-server is not installed")
    try:
        import redis
    except ImportError:
        pytest.skip("the redis package is not installed (pip install -e '.[redis]')")
    port = free_port()
    proc = subprocess.Popen([server, "--bind", "127.0.0.1", "--port", str(port), "--save", "", "--appendonly", "no",
                             "--dir", str(tmp_path)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"redis://127.0.0.1:{port}/0"
    try:
        for _ in range(100):
            try:
                redis.Redis.from_url(url).ping()
                break
            except redis.ConnectionError:
                if proc.poll() is not None:
                    pytest.skip(f"redis-server exited with status {proc.returncode}")
                time.sleep(0.05)
        else:
            pytest.skip("redis-server did not answer within 5 s")
        yield url
    finally:
        proc.terminate()
        proc.wait(10)


def test_seeded_search_saves_and_replays_from_redis(redis_url, tmp_path):
    import redis

    from harness.sweep_worker import example_database

    replayed_first(example_database(None, redis_url), tmp_path)
    assert redis.Redis.from_url(redis_url).dbsize() > 0, "nothing was saved on the server"


@dataclasses.dataclass(frozen=True)
class FailsOnce(StandInProperty):
    """A stand-in property whose first failure does not repeat: as an engine that changes state after a failure
    (torch.compile running a frame eagerly once its compile failed)."""

    def run(self, composition, spec, device) -> Verdict:
        self.seen.append(spec)
        ok = len(self.seen) != 2
        return Verdict(self.name, ok, "ok" if ok else "crashed: InductorError: no valid choices")


def test_a_failure_that_does_not_repeat_is_reported_as_itself(tmp_path):
    # Hypothesis calls it flaky ("failed on the first call but did not on a subsequent one"); the harness reported
    # "search could not run", which hid SGLang's flex_attention compile failure on CUDA. The first failure is the
    # finding, with its case file.
    from pathlib import Path

    result = search_row(row_with(FailsOnce()), PROFILE, "cpu", max_examples=10, out_dir=tmp_path, seed=1)
    assert not result.ok and result.failure.reason.startswith("crashed: InductorError: no valid choices")
    assert "failed once; passed when run again" in result.failure.reason
    assert result.case_file is not None and Path(result.case_file).exists()
