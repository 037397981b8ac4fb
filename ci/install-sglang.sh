#!/usr/bin/env bash
# Installs the SGLang extra into a venv (after ci/setup.sh): SGLang's real attention backends, which the
# adapter (backends/sglang/) runs as sglang.* leaves of the matrix.
#
# Usage:  bash ci/install-sglang.sh [VERSION | PATH-TO-CHECKOUT]
#   (none)     the newest SGLang release on the package index (no rc/dev), at or after 0.5.10
#   VERSION    that release from the package index (0.5.10 or newer; post releases too: 0.5.12.post1)
#   PATH       a git clone of sgl-project/sglang (its root, with python/pyproject.toml), installed editable
# Env: VENV, the venv to install into (default: .venv of this checkout).
# Bad input (not a version, older than 0.5.10, not on the index, not a checkout) is one line on stderr and
# exit status 2.
#
# sglang's own metadata pins CUDA packages (torch, flashinfer, sglang-kernel, nvidia-*, ...): pip must never
# resolve them, on a CPU machine least of all. So sglang goes in with --no-deps, and then only the packages it
# imports at import time (IMPORT_DEPS below), each with the version specifier THAT release declares for it
# (an == pin, a range, or none), read from the release's wheel METADATA or the checkout's pyproject.toml by
# ci/sglang_pins.py: releases differ (0.5.14 does not import with 0.5.23's transformers 5.19.0). Every pip
# call after sglang gets a constraint file pinning the venv's installed torch, so no resolver step can
# replace it (compressed-tensors depends on torch). torchvision is not installed (its wheel needs a CUDA
# torch); the adapter serves an inert stand-in when it is absent.
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
HELPER="$ROOT/ci/sglang_pins.py"

# The packages SGLang imports when its attention backends load (checked for 0.5.10, 0.5.14, 0.5.22 and
# 0.5.23: no other module was named by an ImportError). uvicorn's floor, pyzmq's, etc. come from the release.
IMPORT_DEPS=(numpy orjson psutil pybase64 requests packaging pillow starlette msgspec pydantic pyzmq tqdm
  IPython aiohttp transformers tokenizers dill sentencepiece compressed-tensors gguf openai partial_json_parser
  einops uvicorn fastapi)
# Installed with --no-deps, last, so that no resolver step moves them: apache-tvm-ffi (the release's own
# specifier), xgrammar and triton. Triton stays 3.8.0 whatever the release pins: the fla kernels SGLang vendors for
# GDN use block pointers, which Triton 3.9 removed ("Block pointers have been removed in favor of the tensor
# descriptor API"), and 3.8.0 is the Triton that torch 2.13 and 2.14 ship with.
# xgrammar too: 0.5.16 to 0.5.21 import it when server_args loads (function_call/inkling_detector.py), and its
# wheel requires a CUDA build of torch.
NO_DEPS=(apache-tvm-ffi xgrammar)
TRITON="triton==3.8.0"

fail() { echo "error: $*" >&2; exit 2; }

# Where to install: VENV as given (relative to where this was called: nothing here changes directory) or
# this checkout's .venv.
VENV=${VENV:-$ROOT/.venv}
PY="$VENV/bin/python"
# The helper is standard library only; before the venv exists (bad input is refused first) python3 runs it.
HELPER_PY=$PY
[ -x "$HELPER_PY" ] || HELPER_PY=python3

# 1. What to install, checked before any network access. An existing directory is a checkout; anything
#    else must be a version.
ARG=${1:-}
[ $# -le 1 ] || fail "usage: bash ci/install-sglang.sh [VERSION | PATH-TO-CHECKOUT]"
CHECKOUT=""
VERSION=""
if [ -n "$ARG" ] && [ -d "$ARG" ]; then
  CHECKOUT=$(cd "$ARG" && pwd)
  "$HELPER_PY" "$HELPER" check-checkout "$CHECKOUT" || exit 2
  # Which source goes in, read before the editable install writes its build outputs (egg-info) there.
  if COMMIT=$(git -C "$CHECKOUT" rev-parse HEAD 2>/dev/null); then
    STATE=clean
    [ -z "$(git -C "$CHECKOUT" status --porcelain)" ] || STATE="dirty: uncommitted changes"
  else
    COMMIT=unknown STATE="not a git work tree"
  fi
elif [[ "$ARG" == */* ]]; then
  fail "$ARG is not a directory (an SGLang checkout) nor a version"
elif [ -n "$ARG" ]; then
  VERSION=$("$HELPER_PY" "$HELPER" check-version "$ARG") || exit 2
fi

# 2. The venv and its torch, which must stay: read its version for the constraint file.
[ -x "$PY" ] || { echo "error: $VENV has no bin/python: create it first (bash ci/setup.sh)" >&2; exit 1; }
TORCH=$("$PY" -c "import importlib.metadata as m; print(m.version('torch'))" 2>/dev/null) ||
  { echo "error: torch is not installed in $VENV: install it first (bash ci/setup.sh), or pip would bring" \
      "a CUDA build as compressed-tensors' dependency" >&2; exit 1; }
TMP=$(mktemp -d)
trap 'rm -rf "$TMP"' EXIT
echo "torch==$TORCH" > "$TMP/constraints.txt"
PIP=("$PY" -m pip)
# --no-warn-conflicts: sglang's own (CUDA) requirements are left unmet on purpose; pip would list them all.
INSTALL=("${PIP[@]}" install -q --disable-pip-version-check --no-warn-conflicts -c "$TMP/constraints.txt")

# 3. The release: asked of the package index (--pre, so that an rc named explicitly is found; the default
#    skips rc and dev releases). No fallback version: where the index cannot be asked, pip could not
#    download sglang either.
if [ -z "$CHECKOUT" ]; then
  "${PIP[@]}" index versions --pre --disable-pip-version-check sglang > "$TMP/listing" 2> "$TMP/listing.err" ||
    fail "cannot list sglang's releases: 'pip index versions sglang' failed" \
      "($(grep -m1 ERROR "$TMP/listing.err" || echo "no error message"))"
  VERSION=$("$HELPER_PY" "$HELPER" select ${VERSION:+"$VERSION"} < "$TMP/listing") || exit 2
  # The wheel for this venv's Python, kept to install from; its METADATA is the release's own requirements.
  "${PIP[@]}" download -q --disable-pip-version-check --no-deps --only-binary=:all: -d "$TMP/wheel" \
    "sglang==$VERSION"
  WHEEL=$(ls "$TMP"/wheel/sglang-*.whl)
  SOURCE=$WHEEL
else
  SOURCE=$CHECKOUT
fi
mapfile -t DEPS < <("$PY" "$HELPER" pins "$SOURCE" "${IMPORT_DEPS[@]}")
mapfile -t DEPS_NO_DEPS < <("$PY" "$HELPER" pins "$SOURCE" "${NO_DEPS[@]}")
[ ${#DEPS[@]} -eq ${#IMPORT_DEPS[@]} ] && [ ${#DEPS_NO_DEPS[@]} -eq ${#NO_DEPS[@]} ] ||
  { echo "error: ci/sglang_pins.py could not read the requirements of $SOURCE" >&2; exit 1; }

# 4. Install: sglang alone, then its import-time dependencies (resolved, torch held), then the --no-deps ones.
if [ -z "$CHECKOUT" ]; then
  "${INSTALL[@]}" --no-deps "$WHEEL"
else
  "${INSTALL[@]}" --no-deps -e "$CHECKOUT/python"
fi
echo "beside sglang (its own specifiers): ${DEPS[*]} ${DEPS_NO_DEPS[*]} $TRITON" >&2
"${INSTALL[@]}" "${DEPS[@]}"
"${INSTALL[@]}" --no-deps "${DEPS_NO_DEPS[@]}" "$TRITON"

INSTALLED=$("$PY" -c "import importlib.metadata as m; print(m.version('sglang'))")
if [ -z "$CHECKOUT" ]; then
  echo "sglang $INSTALLED installed"
else
  echo "sglang $INSTALLED installed from the checkout $CHECKOUT at commit $COMMIT ($STATE)"
fi
