"""``harness bisect CASE --versions A..B``: replay one case on each SGLang release, each in its own environment.

Each release gets a virtualenv of its own under ``--envs`` (default ``~/.cache/attn-harness/envs``), built once and
kept: this machine's torch, the harness (editable: the checkout replaying is the checkout under test), and the
release through ``ci/install-sglang.sh`` (its own pins, never its CUDA ones). The case is replayed there with
``harness repro`` in a fresh process; its exit status says pass (0), fail (1) or unavailable (2, with the line
that says why: a feature the release lacks, a shape it cannot build). The table ends with the first failing
release and the first release after it that passes (fixed).
"""

from __future__ import annotations

import importlib.metadata
import os
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from harness.options import UsageError

PROJECT = Path(__file__).resolve().parents[1]
OLDEST = (0, 5, 10)  # the oldest release the install script supports
DEFAULT_ENVS = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "attn-harness" / "envs"
_RELEASE = re.compile(r"^\d+\.\d+\.\d+(?:\.post\d+)?$")  # no rc/dev: releases only


def release_key(version: str) -> tuple[int, ...] | None:
    """Ordering key of a release version (``0.5.12.post1`` after ``0.5.12``); None for anything else (rc, dev)."""
    from backends.sglang.features import version_key

    return version_key(version) if _RELEASE.match(version) else None


def index_releases() -> list[str]:
    """Every SGLang release on the package index, oldest first (``pip index versions``)."""
    try:
        out = subprocess.run([sys.executable, "-m", "pip", "index", "versions", "sglang"], capture_output=True,
                             text=True, timeout=120)
    except (OSError, subprocess.SubprocessError) as e:
        raise UsageError(f"--versions: cannot ask the package index for SGLang's releases: {e}") from None
    m = re.search(r"Available versions:\s*(.+)", out.stdout)
    if out.returncode != 0 or m is None:
        raise UsageError("--versions: the package index did not list SGLang's releases "
                         f"({(out.stderr or out.stdout).strip().splitlines()[-1:] or 'no answer'})")
    return sorted((v.strip() for v in m.group(1).split(",") if release_key(v.strip())), key=release_key)


def chosen_versions(spec: list[str], available: list[str] | None = None) -> list[str]:
    """``["A..B"]`` (every release from A to B on the index) or a list of releases; each at least the oldest
    supported and, for a range, at least one in it. Bad input is a UsageError (one line, exit 2)."""
    if not spec:
        raise UsageError("--versions: name a range A..B or a list of releases")
    for v in (part for item in spec for part in item.split("..") if part):
        key = release_key(v)
        if key is None:
            raise UsageError(f"--versions: {v!r} is not a release version (like 0.5.22 or 0.5.12.post1)")
        if key[:3] < OLDEST:  # (major, minor, patch)
            raise UsageError(f"--versions: {v} is older than the oldest supported release "
                             f"{'.'.join(map(str, OLDEST))}")
    if len(spec) == 1 and ".." in spec[0]:
        low, _, high = spec[0].partition("..")
        if release_key(low) > release_key(high):
            raise UsageError(f"--versions: {spec[0]} is an empty range")
        available = index_releases() if available is None else available
        picked = [v for v in available if release_key(low) <= release_key(v) <= release_key(high)]
        if not picked:
            raise UsageError(f"--versions: no release on the package index in {spec[0]}")
        return picked
    return sorted(dict.fromkeys(spec), key=release_key)


def build_env(version: str, envs: Path, log, name: str | None = None) -> Path:
    """The environment of ``version`` (a release, or the path of a source checkout, whose environment is then
    called ``name``), built on first use; a half-built one is rebuilt."""
    env = envs / (name or f"sglang-{version}")
    done = env / ".harness-ready"
    if done.exists():
        return env
    torch_version = importlib.metadata.version("torch")
    pin = envs / "torch-pin.txt"
    envs.mkdir(parents=True, exist_ok=True)
    pin.write_text(f"torch=={torch_version}\n")
    py = env / "bin" / "python"
    steps = [[sys.executable, "-m", "venv", "--clear", str(env)],
             [str(py), "-m", "pip", "install", "-q", f"torch=={torch_version}"],
             [str(py), "-m", "pip", "install", "-q", "-c", str(pin), "hypothesis>=6.100", "pytest>=8,<9.2",
              "pytest-xdist>=3", "numpy", "matplotlib"],
             [str(py), "-m", "pip", "install", "-q", "--no-deps", "-e", str(PROJECT)],
             ["bash", str(PROJECT / "ci" / "install-sglang.sh"), version]]
    for step in steps:
        log(f"  {version}: {' '.join(step[-3:])}")
        # No bytecode compiled at install (pip's PIP_COMPILE=false): 14,348 modules, of which a run imports a
        # fraction and compiles those on first import; the build's CPU time is CI's, beside its tests.
        result = subprocess.run(step, capture_output=True, text=True,
                                env=os.environ | {"VENV": str(env), "PIP_COMPILE": "false"})
        if result.returncode != 0:
            last = (result.stderr or result.stdout).strip().splitlines()[-1:] or ["(no output)"]
            raise RuntimeError(f"building the environment of {version} failed: {last[0]}")
    done.write_text(version + "\n")
    return env


@dataclass
class Outcome:
    version: str
    status: str  # pass, fail, unavailable, error
    why: str


def replay(env: Path, case: str, device: str, timeout: float) -> tuple[str, str]:
    """(status, the line that says why) of ``harness repro CASE`` in ``env``."""
    cmd = [str(env / "bin" / "python"), "-m", "harness", "repro", case, "--device", device]
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, cwd=PROJECT, timeout=timeout,
                             env=os.environ | ({"TRITON_INTERPRET": "1"} if device == "cpu" else {}))
    except subprocess.TimeoutExpired:
        return "error", f"no answer in {timeout:.0f}s"
    lines = (out.stdout + out.stderr).strip().splitlines()
    verdict = next((x.split(":", 1)[1].strip() for x in lines if x.startswith("verdict:")), None)
    if out.returncode == 0:
        return "pass", verdict or "passed"
    if out.returncode == 1:
        return "fail", verdict or (lines[-1] if lines else "failed")
    if out.returncode == 2:
        return "unavailable", (out.stderr.strip().splitlines() or ["(no reason given)"])[-1]
    return "error", f"exit status {out.returncode}: {lines[-1] if lines else '(no output)'}"


def summary(outcomes: list[Outcome]) -> tuple[str | None, str | None]:
    """(first failing release, first release after it that passes): where the bug came, and where it went."""
    first_fail = next((o.version for o in outcomes if o.status == "fail"), None)
    if first_fail is None:
        return None, None
    after = outcomes[[o.version for o in outcomes].index(first_fail) + 1:]
    return first_fail, next((o.version for o in after if o.status == "pass"), None)


def cmd_bisect(args) -> int:
    from search.casefile import CaseFile

    CaseFile.read(args.case)  # a bad case file is one line, before anything is built
    versions = chosen_versions(args.versions)
    envs = Path(args.envs).expanduser()
    device = args.device if args.device != "auto" else "cpu"
    outcomes = []
    for version in versions:
        try:
            env = build_env(version, envs, lambda line: print(line, file=sys.stderr, flush=True))
            status, why = replay(env, str(Path(args.case).resolve()), device, args.case_timeout)
        except RuntimeError as e:
            status, why = "unavailable", str(e)
        outcomes.append(Outcome(version, status, why))
        print(f"{version:<14} {status:<12} {why}", flush=True)
    first_fail, fixed = summary(outcomes)
    print(f"\nfirst failing release: {first_fail or 'none'}; fixed in: {fixed or ('-' if first_fail is None else 'not yet')}")
    return 0


def add_parser(sub) -> None:
    sp = sub.add_parser("bisect", help="replay one case on each SGLang release (each in its own environment)")
    sp.add_argument("case", help="a case file")
    sp.add_argument("--versions", nargs="+", required=True, help="A..B (the releases on the index between them) "
                                                                 "or a list of releases")
    sp.add_argument("--envs", default=str(DEFAULT_ENVS), help=f"where the environments live (default {DEFAULT_ENVS})")
    sp.add_argument("--device", default="auto", help="auto (cpu), cpu or cuda")
    sp.add_argument("--case-timeout", type=float, default=900.0, help="seconds one replay may take")
    sp.set_defaults(fn=cmd_bisect)
