"""Reproducer files: a failing case as a small JSON document (DESIGN.md section 6).

It holds the batch specification (with its seed), the composition, the property, the device and profile,
the tolerances in force and the package versions; the same tensors are regenerated from it bit for bit.
"""

from __future__ import annotations

import datetime
import functools
import importlib.metadata
import json
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path

from batch.spec import MAX_GRAPH_PADDING, BatchSpec, SpecError

# 2: tensors come from the counter-based draws of engine.materialize; a version-1 seed gives other tensors.
CASE_SCHEMA_VERSION = 2
VERSIONED_PACKAGES = ("torch", "triton", "hypothesis", "flashinfer-python", "fla-core", "sglang")


def package_versions() -> dict[str, str | None]:
    """Each versioned package's version; for an SGLang source checkout also ``sglang-commit`` (its git commit,
    ``+dirty`` when its tree has changes): a dev version string alone does not say which code ran. Read once a
    process: every case written before it runs asks (a pending case file), and reading them took 4 ms a time, a
    fifth of a CPU sweep's case (2026-11-27)."""
    return dict(_package_versions())


@functools.lru_cache(maxsize=1)
def _package_versions() -> dict[str, str | None]:
    out = {}
    for name in VERSIONED_PACKAGES:
        try:
            out[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            out[name] = None
    if out.get("sglang") is not None:
        from backends.sglang.features import source_identity

        source = source_identity()
        if source:
            out["sglang-commit"] = source["commit"] + ("+dirty" if source["dirty"] else "")
    return out


_PARTIAL = ".tmp-"  # CaseFile.write's file before its rename: never a case yet


def modified(path: Path) -> float | None:
    """``path``'s modification time, or None when it is gone: a searching process removes its pending case
    when the row ends, so a supervisor's look at it may come just after."""
    try:
        return path.stat().st_mtime
    except FileNotFoundError:
        return None


def pending_cases(directory: Path) -> list[Path]:
    """The finished case files in ``directory``, oldest first; the one being written (and renamed under a
    supervisor's feet) is left out, as is any removed while looking."""
    found = [(t, p) for p in directory.glob("*.json")
             if not p.name.startswith(_PARTIAL) and (t := modified(p)) is not None]
    return [p for _, p in sorted(found)]


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

    @property
    def row_id(self) -> str:
        """The id of the matrix row this case is of (``search.matrix.Row.id``)."""
        return f"{self.composition}-{self.spec.mode.value}-{self.property}"

    def settle(self, pending: Path, reason: str, out_dir: Path) -> Path:
        """This case, read from ``pending`` (a case its process never finished: it died, hung or raised), as the case
        file of its row's finding: ``reason`` its verdict, written under ``out_dir/cases``, the pending file removed."""
        self.verdict = {"reason": reason, "worst_error": None, "bound": None, "where": None}
        path = self.write(Path(out_dir) / "cases" / case_name(self.composition, self.property, self.spec.mode.value,
                                                               self.spec))
        Path(pending).unlink(missing_ok=True)
        return path

    def write(self, path: str | Path) -> Path:
        """Write atomically (a crash mid-write never leaves half a file)."""
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=_PARTIAL, suffix=".json")
        with os.fdopen(fd, "w") as f:
            f.write(self.to_json() + "\n")
        os.replace(tmp, path)
        return path

    @classmethod
    def read(cls, path: str | Path) -> "CaseFile":
        """Read and check a case file; anything wrong with it is a :class:`SpecError` of one line."""
        try:
            text = Path(path).read_text(encoding="utf-8")
        except UnicodeDecodeError:
            raise SpecError(f"{path} is not a case file: it is not UTF-8 text") from None
        except OSError as e:
            raise SpecError(f"cannot read case file {path}: {e.strerror}") from None
        try:
            d = json.loads(text)
        except json.JSONDecodeError as e:
            raise SpecError(f"{path} is not a case file: invalid JSON ({e})") from None
        if not isinstance(d, dict):
            raise SpecError(f"{path} is not a case file: its top level is a JSON {_json_type(d)}, not an object")
        if d.get("case_schema_version") != CASE_SCHEMA_VERSION:
            raise SpecError(f"{path}: case_schema_version {d.get('case_schema_version')!r} is not supported "
                            f"(this harness reads version {CASE_SCHEMA_VERSION})")
        unknown = sorted(set(d) - set(CASE_FIELDS))
        if unknown:
            raise SpecError(f"{path}: unknown field(s) {', '.join(unknown)}")
        for key in ("composition", "property", "batch"):
            if key not in d:
                raise SpecError(f"{path}: missing field {key!r}")
        for key, types_, json_name in CASE_FIELDS.values():
            if key in d and not isinstance(d[key], types_):
                raise SpecError(f"{path}: {key} must be {json_name}, got {_json_type(d[key])}")
        try:
            spec = BatchSpec.from_json_dict(d["batch"])
        except SpecError as e:
            raise SpecError(f"{path}: {e}") from None
        return cls(d["composition"], d["property"], spec, d.get("device", "cpu"), d.get("profile", "ci"),
                   d.get("verdict"), d.get("tolerances"), d.get("versions"), d.get("created"))


# Top-level fields of a case file: (name, accepted Python types, what to call them in an error).
_NULL = type(None)
CASE_FIELDS = {k: (k, t, n) for k, t, n in [
    ("case_schema_version", (int,), "an integer"),
    ("composition", (str,), "a string (a composition term)"),
    ("property", (str,), "a string (a property name)"),
    ("device", (str,), "a string"),
    ("profile", (str,), "a string"),
    ("batch", (dict,), "a JSON object"),
    ("verdict", (dict, _NULL), "a JSON object or null"),
    ("tolerances", (dict, _NULL), "a JSON object or null"),
    ("versions", (dict, _NULL), "a JSON object or null"),
    ("created", (str, _NULL), "a string or null"),
]}


def _json_type(value) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, (int, float)):
        return "number"
    return {str: "string", list: "list", dict: "object"}.get(type(value), type(value).__name__)


# ---- how much memory replaying a case takes --------------------------------------------------------------

DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2, "float64": 8}


def estimated_bytes(spec: BatchSpec) -> int:
    """A rough estimate of the memory that materializing and checking ``spec`` takes (engine.materialize
    and the reference), computed from lengths and shapes alone: the KV pool (slots x heads x dim per layer,
    drawn as int32 words, looked up as float32, then cast), req_to_token (requests x context_len), per-token inputs and outputs, the
    linear-attention states, and the reference's largest score matrix (heads x new tokens x keys)."""
    ps = spec.page_size
    kv_lens = spec.kv_lens
    pages = sum(-(-n // ps) for n in spec.cache_lens)  # what materialize allocates (a draft loop's every slot)
    slots = (1 + pages + 2 + pages // 4) * ps
    reqs = 1 + spec.batch_size + MAX_GRAPH_PADDING  # engine.materialize.SPARE_REQ_ROWS
    T = spec.num_tokens
    draw = 8 + DTYPE_BYTES.get(spec.dtype, 4)  # an element's int32 word and float32 draw, then its cast copy
    total = reqs * spec.context_len * 12  # drawn as int64, kept as int32
    total += sum(kv_lens) * 8 * 6  # per-token slot bookkeeping (int64)
    D = spec.spec.draft_token_num if spec.spec is not None else 0
    widest = 0  # the largest per-request score matrix of any layer
    for layer in spec.layers:
        if layer.kind == "mha":
            total += slots * layer.num_kv_heads * (layer.head_dim + layer.v_head_dim) * draw
            total += T * (layer.num_q_heads * (layer.head_dim + layer.v_head_dim)
                          + layer.num_kv_heads * (layer.head_dim + layer.v_head_dim)) * draw * 2
            heads = layer.num_q_heads
        elif layer.kind == "mla":
            C, R = layer.kv_lora_rank, layer.qk_rope_head_dim
            total += slots * (C + R) * draw
            total += T * (layer.num_heads * (layer.qk_nope_head_dim + R + layer.v_head_dim) + C + R) * draw * 2
            total += layer.num_heads * C * (layer.qk_nope_head_dim + layer.v_head_dim) * 4
            heads = layer.num_heads
        elif layer.kind == "lightning":
            H, Dh = layer.num_heads, layer.head_dim
            total += reqs * H * Dh * Dh * (1 + D) * (4 + 4)  # states (and per-draft-step states), float32
            total += T * 3 * H * Dh * draw * 2
            total += (T if D else 1) * H * Dh * Dh * 8  # the reference's float64 state (one per verified token)
            heads = 0
        elif layer.kind == "mamba2":
            state = layer.conv_dim * (layer.conv_kernel - 1) + layer.num_heads * layer.head_dim * layer.state_size
            total += reqs * state * (1 + D) * (4 + 4)  # states (and per-draft-step ones)
            total += T * (layer.input_width + layer.intermediate) * draw * 2
            total += (T if D else 1) * state * 8  # the reference's float64 states
            heads = 0
        elif layer.kind == "kda":
            H, K, V, W = layer.num_heads, layer.head_k_dim, layer.head_v_dim, layer.conv_kernel
            state = layer.conv_dim * (W - 1) + H * K * V
            total += reqs * state * (1 + D) * (4 + 4)
            total += T * (layer.conv_dim + H * K + H + H * V) * draw * 2
            total += T * H * K * V * 8  # the reference's float64 state after each token
            heads = 0
        elif layer.kind == "short_conv":
            Dh, W = layer.hidden, layer.conv_kernel
            total += reqs * Dh * (W - 1) * (1 + D) * (4 + 4)  # conv states (and per-draft-step ones)
            total += T * 4 * Dh * draw * 2  # B, C, x in; the output
            heads = 0
        else:
            Hv, K, V, W = layer.num_v_heads, layer.head_k_dim, layer.head_v_dim, layer.conv_kernel
            state = layer.conv_dim * (W - 1) + Hv * K * V
            total += reqs * state * (1 + D) * (4 + 4)
            total += T * (layer.conv_dim + 2 * Hv + Hv * V) * draw * 2
            heads = 0
        widest = max([widest] + [heads * e * n for e, n in zip(spec.extend_lens, kv_lens)])
    return total + widest * 4 * 2  # scores and probabilities, float32


def memory_limit() -> int | None:
    """Half this machine's physical memory, or half the process's address-space limit (ulimit -v) where that
    is lower; None where the system says neither."""
    limits = []
    try:
        limits.append(os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE") // 2)
    except (ValueError, OSError, AttributeError):
        pass
    try:
        import resource

        soft, _ = resource.getrlimit(resource.RLIMIT_AS)
        if soft != resource.RLIM_INFINITY:
            limits.append(soft // 2)
    except (ImportError, ValueError, OSError):
        pass
    return min(limits) if limits else None


def check_fits(spec: BatchSpec, limit: int | None = None, where: str = "this case") -> None:
    """Refuse, before anything is allocated, a case too large for this machine."""
    limit = memory_limit() if limit is None else limit
    need = estimated_bytes(spec)
    if limit is not None and need > limit:
        raise SpecError(f"{where} needs about {_gb(need)} of memory to replay, more than the limit of "
                        f"{_gb(limit)} (half this machine's memory or address-space limit); it has {spec.batch_size} request(s), "
                        f"{spec.num_tokens} new token(s), {sum(spec.kv_lens)} key(s) in all, "
                        f"context_len {spec.context_len}")


def _gb(n: int) -> str:
    unit = next((u for u in range(6, 0, -1) if n >= 1024**u), 0)
    return f"{n / 1024**unit:.1f} {('bytes', 'KiB', 'MiB', 'GiB', 'TiB', 'PiB', 'EiB')[unit]} ({n} bytes)"


def safe_name(text: str) -> str:
    return "".join(ch if ch.isalnum() or ch in "-_." else "_" for ch in text)


def case_name(composition: str, property: str, mode: str, spec: BatchSpec) -> str:
    return f"{safe_name(composition)}--{mode}--{property}--{spec.seed:x}.json"
