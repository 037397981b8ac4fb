"""What ci/install-sglang.sh and ci/gpu-sglang-wheels.sh need to know about an SGLang release: which
version to install, and the version specifiers that release itself declares for the packages the harness
installs beside it. Standard library only (it runs with python3 before any venv exists, and on the GPU
bundle's packing machine), so it carries the small parts of PEP 440 (versions, specifiers) and PEP 508
(requirements, environment markers) it needs instead of importing `packaging`.

Why the pins must come from the release: sglang is installed with --no-deps (its metadata pins CUDA torch,
flashinfer, sglang-kernel, ...), so pip never reads its requirements; but each release needs its own
transformers, openai, apache-tvm-ffi, ... (0.5.14 does not import with 0.5.23's transformers). So the
requirements are read from the release's wheel METADATA (Requires-Dist) or, for a source checkout, from
python/pyproject.toml's [project] dependencies, and only the names the caller lists are kept.

Command line (errors: one line on stderr starting with "error: ", exit status 2):
  sglang_pins.py check-version V          V is a version and not older than OLDEST_SUPPORTED
  sglang_pins.py check-checkout PATH      PATH is the root of an SGLang source checkout
  sglang_pins.py select [V] < LISTING     LISTING: `pip index versions sglang --pre` output; prints V if it
                                          is listed, else (no V) the newest final release >= OLDEST_SUPPORTED
  sglang_pins.py pins SOURCE NAME...      one requirement per NAME: NAME plus SOURCE's specifier for it
  sglang_pins.py bundle SOURCE --python-version X.Y REQ...
                                          one requirement per REQ (NAME==VERSION or NAME): the release's
                                          == pin, else REQ where its version satisfies the release's range,
                                          else the release's range (markers for linux x86_64 CPython X.Y)
SOURCE is a wheel (.whl), a METADATA file, or a checkout root.
"""

from __future__ import annotations

import email.parser
import os
import platform
import re
import sys
import zipfile
from dataclasses import dataclass
from pathlib import Path

# The oldest release the harness's adapter has been checked against (research: 0.5.10, 0.5.14, 0.5.22, 0.5.23).
OLDEST_SUPPORTED = "0.5.10"


class InputError(Exception):
    """Bad input: the command line prints its message as one line and exits 2."""


# --- PEP 440 versions --------------------------------------------------------------------------------------

_VERSION = re.compile(
    r"""^\s*v?
    (?:(?P<epoch>[0-9]+)!)?
    (?P<release>[0-9]+(?:\.[0-9]+)*)
    (?:[-_.]?(?P<pre_l>a|b|c|rc|alpha|beta|pre|preview)[-_.]?(?P<pre_n>[0-9]+)?)?
    (?:(?:-(?P<post_n1>[0-9]+))|(?:[-_.]?(?P<post_l>post|rev|r)[-_.]?(?P<post_n2>[0-9]+)?))?
    (?:[-_.]?(?P<dev_l>dev)[-_.]?(?P<dev_n>[0-9]+)?)?
    (?:\+(?P<local>[a-z0-9]+(?:[-_.][a-z0-9]+)*))?
    \s*$""",
    re.VERBOSE | re.IGNORECASE,
)
_PRE_ORDER = {"a": 0, "alpha": 0, "b": 1, "beta": 1, "c": 2, "rc": 2, "pre": 2, "preview": 2}


@dataclass(frozen=True, eq=False)
class Version:
    """A parsed PEP 440 version; compares as PEP 440 orders them (dev < pre < final < post)."""

    text: str
    epoch: int
    release: tuple[int, ...]
    pre: tuple[int, int] | None
    post: int | None
    dev: int | None
    local: str | None

    @property
    def is_prerelease(self) -> bool:
        return self.pre is not None or self.dev is not None

    @property
    def base(self) -> tuple:
        """Epoch and release alone (1.0rc1 and 1.0.0.post2 share 1.0's)."""
        return self.key()[:2]

    @property
    def public(self) -> Version:
        return parse_version(self.text.split("+", 1)[0])

    def key(self) -> tuple:
        release = list(self.release)
        while len(release) > 1 and release[-1] == 0:  # 1.0 == 1.0.0
            release.pop()
        if self.pre is None and self.post is None and self.dev is not None:
            pre = (-1,)  # 1.0.dev1 sorts before 1.0a1
        elif self.pre is None:
            pre = (1,)  # a final release sorts after its pre-releases
        else:
            pre = (0, *self.pre)
        post = (-1,) if self.post is None else (0, self.post)
        dev = (1,) if self.dev is None else (0, self.dev)
        return (self.epoch, tuple(release), pre, post, dev, self.local or "")

    def __lt__(self, other: Version) -> bool:
        return self.key() < other.key()

    def __le__(self, other: Version) -> bool:
        return self.key() <= other.key()

    def __gt__(self, other: Version) -> bool:
        return self.key() > other.key()

    def __ge__(self, other: Version) -> bool:
        return self.key() >= other.key()

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Version) and self.key() == other.key()

    def __hash__(self) -> int:
        return hash(self.key())

    def __str__(self) -> str:
        return self.text


def parse_version(text: str) -> Version:
    """The version ``text`` names; ValueError if it is not a PEP 440 version."""
    m = _VERSION.match(text)
    if not m:
        raise ValueError(f"not a version: {text!r}")
    pre = None
    if m["pre_l"]:
        pre = (_PRE_ORDER[m["pre_l"].lower()], int(m["pre_n"] or 0))
    post = None
    if m["post_n1"] is not None:
        post = int(m["post_n1"])
    elif m["post_l"]:
        post = int(m["post_n2"] or 0)
    dev = int(m["dev_n"] or 0) if m["dev_l"] else None
    return Version(text.strip(), int(m["epoch"] or 0), tuple(int(p) for p in m["release"].split(".")),
                   pre, post, dev, m["local"].lower() if m["local"] else None)


def check_version(text: str) -> Version:
    """``text`` as a release this harness can install: InputError if it is not a version or is older than
    the oldest supported release."""
    try:
        version = parse_version(text)
    except ValueError:
        raise InputError(f"{text!r} is not a version (such as 0.5.22 or 0.5.12.post1)") from None
    if version.local:
        raise InputError(f"{text!r} has a local version label; PyPI releases have none")
    if version < parse_version(OLDEST_SUPPORTED):
        raise InputError(f"sglang {text} is older than the oldest supported release {OLDEST_SUPPORTED}")
    return version


# --- PEP 440 specifiers ------------------------------------------------------------------------------------

_CLAUSE = re.compile(r"^\s*(~=|===|==|!=|<=|>=|<|>)\s*([^\s,]+)\s*$")


def _prefix_match(version: Version, pattern: str) -> bool:
    """``version`` == ``pattern``.*: its release starts with the pattern's (zero-padded), pre/dev/post kept."""
    want = parse_version(pattern)
    have = list(version.release) + [0] * max(0, len(want.release) - len(version.release))
    if version.epoch != want.epoch or tuple(have[:len(want.release)]) != want.release:
        return False
    # a pattern such as 1.0rc1.* must also match the suffix it names
    return want.pre is None or version.pre == want.pre


def satisfies(version: Version | str, specifier: str) -> bool:
    """Whether ``version`` meets every clause of ``specifier`` (such as ">=0.1.5,<0.2"; "" is anything)."""
    if isinstance(version, str):
        version = parse_version(version)
    for clause in filter(None, (c.strip() for c in specifier.split(","))):
        m = _CLAUSE.match(clause)
        if not m:
            raise ValueError(f"not a version specifier: {clause!r}")
        op, target = m.groups()
        if op == "===":
            ok = version.text == target
        elif target.endswith(".*"):
            if op not in ("==", "!="):
                raise ValueError(f"a wildcard needs == or !=: {clause!r}")
            ok = _prefix_match(version, target[:-2]) == (op == "==")
        else:
            spec = parse_version(target)
            # a local label on the candidate is ignored unless the specifier names one (PEP 440)
            have = version if spec.local else version.public
            if op == "==":
                ok = have == spec
            elif op == "!=":
                ok = have != spec
            elif op == "<=":
                ok = have <= spec
            elif op == ">=":
                ok = have >= spec
            elif op == "<":  # <V excludes V's own pre-releases unless V is one
                ok = have < spec and (spec.is_prerelease or not (have.is_prerelease and have.base == spec.base))
            elif op == ">":  # >V excludes V's post releases unless V is one
                ok = have > spec and (spec.post is not None or not (have.post is not None and have.base == spec.base))
            else:  # ~=V.N: >=V.N, ==V.*
                if len(spec.release) < 2:
                    raise ValueError(f"~= needs at least two release parts: {clause!r}")
                prefix = ".".join(str(p) for p in spec.release[:-1])
                ok = have >= spec and _prefix_match(have, f"{spec.epoch}!{prefix}" if spec.epoch else prefix)
        if not ok:
            return False
    return True


def is_exact_pin(specifier: str) -> bool:
    """Whether ``specifier`` is one ``==V`` (or ``===V``) clause naming a single version."""
    clauses = [c.strip() for c in specifier.split(",") if c.strip()]
    return len(clauses) == 1 and bool(re.match(r"^(==|===)[^*]+$", clauses[0]))


# --- PEP 508 requirements and markers ----------------------------------------------------------------------


def normalize(name: str) -> str:
    """PEP 503: the name pip compares (case and -_. runs do not matter)."""
    return re.sub(r"[-_.]+", "-", name).lower()


@dataclass(frozen=True)
class Requirement:
    name: str
    extras: tuple[str, ...]
    specifier: str  # "" when bare; clauses joined by "," without spaces
    marker: str  # "" when none
    url: str = ""


_REQUIREMENT = re.compile(
    r"""^\s*(?P<name>[A-Za-z0-9](?:[A-Za-z0-9._-]*[A-Za-z0-9])?)\s*
    (?:\[(?P<extras>[^\]]*)\])?\s*
    (?:@\s*(?P<url>[^;\s]+)\s*|(?P<spec>\(?[^;]*?\)?))\s*
    (?:;(?P<marker>.*))?$""",
    re.VERBOSE,
)


def parse_requirement(text: str) -> Requirement:
    m = _REQUIREMENT.match(text)
    if not m:
        raise ValueError(f"not a requirement: {text!r}")
    spec = (m["spec"] or "").strip()
    if spec.startswith("(") and spec.endswith(")"):
        spec = spec[1:-1]
    spec = re.sub(r"\s+", "", spec)
    for clause in filter(None, spec.split(",")):
        if not _CLAUSE.match(clause):
            raise ValueError(f"not a requirement: {text!r}")
    extras = tuple(e.strip() for e in (m["extras"] or "").split(",") if e.strip())
    return Requirement(m["name"], extras, spec, (m["marker"] or "").strip(), m["url"] or "")


_MARKER_TOKEN = re.compile(r"""\s*(?:(?P<str>'[^']*'|"[^"]*")|(?P<op>===|==|!=|<=|>=|~=|<|>|\(|\))|"""
                           r"""(?P<word>not\s+in\b|[A-Za-z_][A-Za-z0-9_.]*))""")


def default_environment(python_version: str | None = None) -> dict[str, str]:
    """PEP 508's marker variables for this interpreter, or, with ``python_version`` ("3.12"), for CPython
    of that version on linux x86_64 (the GPU bundle's target)."""
    if python_version is not None:
        return {"python_version": python_version, "python_full_version": python_version + ".0",
                "implementation_name": "cpython", "implementation_version": python_version + ".0",
                "platform_python_implementation": "CPython", "sys_platform": "linux", "os_name": "posix",
                "platform_system": "Linux", "platform_machine": "x86_64", "platform_release": "",
                "platform_version": "", "extra": ""}
    info = sys.implementation.version
    impl_version = f"{info.major}.{info.minor}.{info.micro}"
    return {"python_version": ".".join(platform.python_version_tuple()[:2]),
            "python_full_version": platform.python_version(), "implementation_name": sys.implementation.name,
            "implementation_version": impl_version,
            "platform_python_implementation": platform.python_implementation(), "sys_platform": sys.platform,
            "os_name": os.name, "platform_system": platform.system(), "platform_machine": platform.machine(),
            "platform_release": platform.release(), "platform_version": platform.version(), "extra": ""}


def evaluate_marker(marker: str, environment: dict[str, str]) -> bool:
    """Whether the PEP 508 ``marker`` holds in ``environment`` (``extra`` "" means the base requirements)."""
    tokens: list[tuple[str, str]] = []
    pos = 0
    text = marker.strip()
    while pos < len(text):
        m = _MARKER_TOKEN.match(text, pos)
        if not m or m.end() == pos:
            raise ValueError(f"not a marker: {marker!r}")
        kind = m.lastgroup
        value = m[kind]
        tokens.append((kind, " ".join(value.split()) if kind == "word" else value))
        pos = m.end()
        while pos < len(text) and text[pos].isspace():
            pos += 1
    index = 0

    def peek() -> tuple[str, str] | None:
        return tokens[index] if index < len(tokens) else None

    def take() -> tuple[str, str]:
        nonlocal index
        if index >= len(tokens):
            raise ValueError(f"not a marker (ends early): {marker!r}")
        index += 1
        return tokens[index - 1]

    def value() -> tuple[str, str]:  # (its value, the variable's name or "" for a literal)
        kind, tok = take()
        if kind == "str":
            return tok[1:-1], ""
        if kind == "word" and tok in environment:
            return environment[tok], tok
        raise ValueError(f"not a marker (unknown {tok!r}): {marker!r}")

    def compare() -> bool:
        if peek() == ("op", "("):
            take()
            result = disjunction()
            if take() != ("op", ")"):
                raise ValueError(f"not a marker (unbalanced): {marker!r}")
            return result
        left, left_name = value()
        kind, op = take()
        if kind == "word" and op in ("in", "not in"):
            right, _ = value()
            return (left in right) == (op == "in")
        if kind != "op" or op in ("(", ")"):
            raise ValueError(f"not a marker (no operator): {marker!r}")
        right, right_name = value()
        if op == "===":
            return left == right
        # As pip does: a comparison whose sides are versions compares them as versions (python_version >=
        # "3.10", "3.11" == "3.11.0"); any other one compares the strings.
        try:
            return satisfies(left, op + right)
        except ValueError:
            pass
        if op == "~=":
            raise ValueError(f"not a marker (~= needs versions, not {left!r}, {right!r}): {marker!r}")
        if "extra" in (left_name, right_name):
            left, right = normalize(left), normalize(right)
        return {"==": left == right, "!=": left != right, "<": left < right, "<=": left <= right,
                ">": left > right, ">=": left >= right}[op]

    def conjunction() -> bool:
        result = compare()
        while peek() == ("word", "and"):
            take()
            result = compare() and result
        return result

    def disjunction() -> bool:
        result = conjunction()
        while peek() == ("word", "or"):
            take()
            result = conjunction() or result
        return result

    if not tokens:
        return True
    result = disjunction()
    if index != len(tokens):
        raise ValueError(f"not a marker (trailing {tokens[index][1]!r}): {marker!r}")
    return result


# --- reading a release's requirements ----------------------------------------------------------------------


def requirements_from_metadata(text: str) -> list[str]:
    """The Requires-Dist lines of a core-metadata (METADATA / PKG-INFO) text."""
    message = email.parser.Parser().parsestr(text, headersonly=True)
    return [line.strip() for line in message.get_all("Requires-Dist") or []]


def metadata_from_wheel(path: Path) -> str:
    with zipfile.ZipFile(path) as wheel:
        names = [n for n in wheel.namelist() if re.fullmatch(r"[^/]+\.dist-info/METADATA", n)]
        if len(names) != 1:
            raise InputError(f"{path} has {len(names)} .dist-info/METADATA files, not one")
        return wheel.read(names[0]).decode("utf-8")


def checkout_pyproject(root: Path) -> dict:
    """python/pyproject.toml of the SGLang checkout at ``root``; InputError if ``root`` is not one."""
    path = Path(root) / "python" / "pyproject.toml"
    if not path.is_file():
        raise InputError(f"{root} is not an SGLang checkout: it has no python/pyproject.toml")
    try:
        import tomllib
    except ImportError:  # Python < 3.11
        raise InputError(f"reading {path} needs Python 3.11+ (tomllib); this is {platform.python_version()}") \
            from None
    try:
        data = tomllib.loads(path.read_text(encoding="utf-8"))
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as exc:
        raise InputError(f"{root} is not an SGLang checkout: {path} is not TOML ({exc})") from None
    name = data.get("project", {}).get("name", "")
    if normalize(str(name)) != "sglang":
        raise InputError(f"{root} is not an SGLang checkout: {path} names project {name!r}, not 'sglang'")
    return data


def requirements_from_source(source: Path) -> list[str]:
    """A release's requirement strings, from a wheel, a METADATA file, or a checkout's pyproject.toml."""
    source = Path(source)
    if source.is_dir():
        project = checkout_pyproject(source).get("project", {})
        if "dependencies" in project.get("dynamic", []):
            raise InputError(f"{source}/python/pyproject.toml declares its dependencies dynamically; "
                             f"their pins cannot be read from it")
        return [str(r) for r in project.get("dependencies", [])]
    if not source.is_file():
        raise InputError(f"{source} does not exist")
    if source.suffix == ".whl":
        return requirements_from_metadata(metadata_from_wheel(source))
    return requirements_from_metadata(source.read_text(encoding="utf-8"))


def release_specifiers(requirements: list[str], environment: dict[str, str]) -> dict[str, str | None]:
    """Normalized name -> the release's specifier ("" when it names the package bare) for every requirement
    whose marker holds in ``environment``; requirements for other platforms or extras are left out."""
    found: dict[str, str | None] = {}
    for text in requirements:
        req = parse_requirement(text)
        if req.marker and not evaluate_marker(req.marker, environment):
            continue
        key = normalize(req.name)
        clauses = [c for c in (found.get(key) or "", req.specifier) if c]
        found[key] = ",".join(clauses)
    return found


def pins(requirements: list[str], names: list[str], environment: dict[str, str]) -> list[str]:
    """For each of ``names``: the name (as given, without extras) plus the release's specifier for it —
    its == pin, its range, or nothing where the release names the package bare or not at all."""
    specs = release_specifiers(requirements, environment)
    return [name + (specs.get(normalize(name)) or "") for name in names]


def bundle_pins(requirements: list[str], defaults: list[str], environment: dict[str, str]) -> list[str]:
    """For each of ``defaults`` (NAME==VERSION seen working, or NAME): the release's == pin where it has
    one; the default where it satisfies the release's range (or the release has none); else the range."""
    specs = release_specifiers(requirements, environment)
    out = []
    for text in defaults:
        req = parse_requirement(text)
        spec = specs.get(normalize(req.name)) or ""
        if not spec:
            out.append(req.name + req.specifier)
        elif is_exact_pin(spec):
            out.append(req.name + spec)
        elif is_exact_pin(req.specifier) and satisfies(req.specifier.lstrip("="), spec):
            out.append(req.name + req.specifier)
        else:
            out.append(req.name + spec)
    return out


# --- choosing the release ----------------------------------------------------------------------------------


def listed_versions(listing: str) -> list[str]:
    """The versions of `pip index versions NAME` output ("Available versions: 0.5.23, 0.5.22, ...")."""
    for line in listing.splitlines():
        if line.strip().startswith("Available versions:"):
            return [v.strip() for v in line.split(":", 1)[1].split(",") if v.strip()]
    return []


def select(listing: list[str], wanted: str | None = None) -> str:
    """``wanted`` if the index lists it (InputError if not), else the newest final release (no rc, no dev)
    at or after OLDEST_SUPPORTED."""
    versions = []
    for text in listing:
        try:
            versions.append(parse_version(text))
        except ValueError:
            continue
    if wanted is not None:
        want = check_version(wanted)
        for version in versions:
            if version == want:
                return version.text
        raise InputError(f"sglang {wanted} does not exist on the package index (pip index versions sglang)")
    oldest = parse_version(OLDEST_SUPPORTED)
    candidates = [v for v in versions if not v.is_prerelease and v >= oldest]
    if not candidates:
        raise InputError(f"cannot tell the newest sglang release: the package index listed none at or after "
                         f"{OLDEST_SUPPORTED} (pip index versions sglang)")
    return max(candidates).text


# --- command line ------------------------------------------------------------------------------------------


def main(argv: list[str]) -> int:
    try:
        if not argv:
            raise InputError("usage: sglang_pins.py check-version|check-checkout|select|pins|bundle ...")
        command, args = argv[0], argv[1:]
        if command == "check-version" and len(args) == 1:
            print(check_version(args[0]).text)
        elif command == "check-checkout" and len(args) == 1:
            checkout_pyproject(Path(args[0]))
        elif command == "select" and len(args) <= 1:
            print(select(listed_versions(sys.stdin.read()), args[0] if args else None))
        elif command == "pins" and len(args) >= 1:
            for line in pins(requirements_from_source(Path(args[0])), args[1:], default_environment()):
                print(line)
        elif command == "bundle" and len(args) >= 3 and args[1] == "--python-version":
            env = default_environment(args[2])
            for line in bundle_pins(requirements_from_source(Path(args[0])), args[3:], env):
                print(line)
        else:
            raise InputError(f"usage: sglang_pins.py: bad arguments {argv!r}")
    except (InputError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
