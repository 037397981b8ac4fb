"""Reproducer files: a failing case as a small JSON document (DESIGN.md section 6).

It holds the batch specification (with its seed), the composition, the property, the device and profile,
the tolerances in force and the package versions; the same tensors are regenerated from it bit for bit.
"""

from __future__ import annotations

import datetime
import importlib.metadata
import json
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path

from batch.spec import BatchSpec, SpecError

# 2: tensors come from the counter-based draws of engine.materialize; a version-1 seed gives other tensors.
CASE_SCHEMA_VERSION = 2
VERSIONED_PACKAGES = ("torch", "triton", "hypothesis", "flashinfer-python", "fla-core")


def package_versions() -> dict[str, str | None]:
    out = {}
    for name in VERSIONED_PACKAGES:
        try:
            out[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            out[name] = None
    return out


@dataclass
class CaseFile:
    composition: str
    property: str
    spec: BatchSpec
    device: str
    profile: str
    verdict: dict | None = None
    tolerances: dict | None = None
    versions: dict | None = None
    created: str | None = None

    def to_json(self) -> str:
        return json.dumps({
            "case_schema_version": CASE_SCHEMA_VERSION,
            "composition": self.composition,
            "property": self.property,
            "device": self.device,
            "profile": self.profile,
            "batch": self.spec.to_json_dict(),
            "verdict": self.verdict,
            "tolerances": self.tolerances,
            "versions": self.versions or package_versions(),
            "created": self.created or datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        }, indent=1, sort_keys=True)

    def write(self, path: str | Path) -> Path:
        """Write atomically (a crash mid-write never leaves half a file)."""
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".tmp-", suffix=".json")
        with os.fdopen(fd, "w") as f:
            f.write(self.to_json() + "\n")
        os.replace(tmp, path)
        return path

    @classmethod
    def read(cls, path: str | Path) -> "CaseFile":
        try:
            text = Path(path).read_text()
        except OSError as e:
            raise SpecError(f"cannot read case file {path}: {e.strerror}") from None
        try:
            d = json.loads(text)
        except json.JSONDecodeError as e:
            raise SpecError(f"{path} is not a case file: invalid JSON ({e})") from None
        if not isinstance(d, dict) or d.get("case_schema_version") != CASE_SCHEMA_VERSION:
            found = d.get("case_schema_version") if isinstance(d, dict) else None
            raise SpecError(f"{path}: case_schema_version {found!r} is not supported "
                            f"(this harness reads version {CASE_SCHEMA_VERSION})")
        for key in ("composition", "property", "batch"):
            if key not in d:
                raise SpecError(f"{path}: missing field {key!r}")
        return cls(d["composition"], d["property"], BatchSpec.from_json_dict(d["batch"]), d.get("device", "cpu"),
                   d.get("profile", "ci"), d.get("verdict"), d.get("tolerances"), d.get("versions"), d.get("created"))


def safe_name(text: str) -> str:
    return "".join(ch if ch.isalnum() or ch in "-_." else "_" for ch in text)


def case_name(composition: str, property: str, mode: str, spec: BatchSpec) -> str:
    return f"{safe_name(composition)}--{mode}--{property}--{spec.seed:x}.json"
