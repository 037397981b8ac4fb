#!/usr/bin/env bash
# Packs, on a machine with pip network access, what a GPU machine without network needs to run SGLang's
# real attention backends (the sglang.* leaves, FlashInfer's included) under the harness: an sglang release
# (--no-deps: its CUDA pins are never resolved), the FlashInfer it pins, and the packages it imports at import
# time that such a machine lacks. Python 3.12 (cp312) manylinux wheels, for the GPU image of
# ../shared/device/README.md (torch 2.11+cu130, triton 3.6, nvcc 13; it already has numpy, requests, packaging,
# pillow, psutil, tqdm, aiohttp, einops, transformers, sentencepiece, anyio, httpx).
#
# The wheels (~125 MB, FlashInfer 0.7.2 alone 65 MB) are over what one device call may carry (64 MiB), but
# mostly C++/CUDA source and Python: unpacked and xz-compressed they are far smaller. So this script
# downloads them into .sglwhl/wheels/, installs them (for cp312, without running anything) into
# .sglwhl/site/, and packs that folder as .sglwhl/part-*, pieces of one .tar.xz of at most PART_MIB MiB
# each (default 58). .sglwhl/ is ignored by git (.gitignore): never commit it.
#
# Usage, from the project root:   bash ci/gpu-sglang-wheels.sh [VERSION]
#   VERSION: an sglang release, 0.5.10 or newer (default: the newest on the package index, as
#   ci/install-sglang.sh picks it). Bad input is one line on stderr and exit status 2.
#   DRY_RUN=1 downloads only the sglang wheel and prints the bundle's package list, packing nothing.
# Which versions go in: sglang's own specifier wherever that release names a package (its == pin; else the
# version below when it meets the release's range, else that range), read from the cp312 wheel's METADATA
# by ci/sglang_pins.py; the versions below (seen working beside 0.5.23) for what the release leaves open.
# FlashInfer's prebuilt cubins (flashinfer_cubin, pinned by older releases) stay out: FlashInfer
# JIT-compiles its kernels with the machine's nvcc. transformers and tokenizers are the release's pins (the
# image's transformers imports 0.5.23 only); sentencepiece is the image's. 0.5.16 to 0.5.21 also import xgrammar
# with server_args, whose wheel alone would fill a call's carry: those releases need it carried on its own.
# Then, on the GPU machine, with .sglwhl carried (all parts in one call, or parts copied to /tmp over
# calls on one warm machine), before the harness runs:
#   mkdir -p /tmp/site && cat .sglwhl/part-* | python3 -c "import sys, tarfile; tarfile.open(fileobj=sys.stdin.buffer, mode='r|xz').extractall('/tmp/site')"
#   export PYTHONPATH=/tmp/site:$PWD MAX_JOBS=16
# The adapter (backends/sglang/runtime.py) stands in inert modules for IPython, sniffio, sgl_kernel and flash_mla
# where they are absent; nothing else is stubbed (opentelemetry travels for real: a stub would turn the ImportError
# SGLang's tracing catches into a RuntimeError).
# Seen on the lent H100 (2026-11-24), 0.5.23: 48 MB packed (one part), unpacked in 10 s, sglang imported in 32 s;
# with sgl-flash-mla (2026-11-29): 63 MB in two parts, which one call still carries beside the tree.
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=.sglwhl
PART_MIB=${PART_MIB:-58}
PY=${PYTHON:-python3}
HELPER=ci/sglang_pins.py
fail() { echo "error: $*" >&2; exit 2; }
[ $# -le 1 ] || fail "usage: bash ci/gpu-sglang-wheels.sh [VERSION]"
# The release, checked before any network access, then asked of the package index (see install-sglang.sh).
VERSION=""
if [ -n "${1:-}" ]; then
  VERSION=$("$PY" "$HELPER" check-version "$1") || exit 2
fi
LISTING=$("$PY" -m pip index versions --pre --disable-pip-version-check sglang 2>/dev/null) ||
  fail "cannot list sglang's releases: 'pip index versions sglang' failed"
VERSION=$("$PY" "$HELPER" select ${VERSION:+"$VERSION"} <<< "$LISTING") || exit 2
# What goes in besides sglang: the versions seen working beside 0.5.23, each replaced by the release's own
# specifier where it has one (0.5.23 pins flashinfer_python[cu13]==0.7.2, apache-tvm-ffi==0.1.11,
# openai==2.8.0, compressed-tensors==0.18.0).
DEFAULTS=(
  flashinfer-python==0.7.2 apache-tvm-ffi==0.1.11
  pydantic==2.14.3 pydantic-core==2.50.4 annotated-types==0.8.0 typing-inspection==0.4.5
  openai==2.8.0 jiter==0.19.0 distro==1.9.0
  dill==0.4.1 loguru==0.7.3 orjson==3.13.0 pybase64==1.5.1 msgspec==0.22.0 partial-json-parser==0.2.1.1.post7
  pyzmq==27.3.0 gguf==0.19.0 compressed-tensors==0.18.0
  uvicorn==0.54.0 fastapi==0.165.0 starlette==1.10.0 annotated-doc
  opentelemetry-api==1.45.2  # fastapi 0.165 imports it unguarded (fastapi/telemetry/_api.py)
  # FlashMLA's kernels (0.5.23 pins it; 10 MB, built on torch's stable ABI: it loads on the image's torch 2.11, seen on
  # the H200 2026-11-29): the sglang.flashmla rows run with it
  sgl-flash-mla==1.0.0
  # The image's transformers serves 0.5.23 only: 0.5.14 fails to import with it ('qwen3_asr' is already used by
  # a Transformers config, seen on the H100 2026-11-25), so each release travels with its own pins.
  transformers==5.19.0 tokenizers==0.22.2  # 0.22.2: what transformers up to 5.12 accept (<=0.23.0); 0.5.22 on pin their own
)
PLATFORM=(--python-version 3.12 --implementation cp --abi cp312 --abi abi3 --abi none --only-binary=:all:
  --platform manylinux_2_35_x86_64 --platform manylinux_2_34_x86_64 --platform manylinux_2_31_x86_64
  --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_24_x86_64
  --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform manylinux1_x86_64)
if [ "${DRY_RUN:-0}" = "1" ]; then  # leaves .sglwhl/ as it is
  WHEELS=$(mktemp -d)
  trap 'rm -rf "$WHEELS"' EXIT
else
  # wheels/ is emptied too: a wheel left by an earlier run (another sglang, another FlashInfer) would be packed.
  rm -rf "$OUT/site" "$OUT"/part-* "$OUT/wheels"
  WHEELS=$OUT/wheels
  mkdir -p "$WHEELS"
fi
"$PY" -m pip download -q --disable-pip-version-check --no-deps "${PLATFORM[@]}" -d "$WHEELS" "sglang==$VERSION"
mapfile -t PKGS < <("$PY" "$HELPER" bundle "$WHEELS"/sglang-*.whl --python-version 3.12 "${DEFAULTS[@]}")
[ ${#PKGS[@]} -eq ${#DEFAULTS[@]} ] || { echo "error: could not read sglang $VERSION's requirements" >&2; exit 1; }
echo "sglang $VERSION for cp312 with: ${PKGS[*]}"
if [ "${DRY_RUN:-0}" = "1" ]; then
  exit 0
fi
"$PY" -m pip download -q --disable-pip-version-check --no-deps "${PLATFORM[@]}" -d "$WHEELS" "${PKGS[@]}"
# abi3 and pure wheels too (pyzmq, pydantic-core ship cp312 or abi3 builds; pure ones are py3-none-any).
"$PY" -m pip install -q --disable-pip-version-check --no-deps --no-compile --no-index --target "$OUT/site" \
  "${PLATFORM[@]}" "$WHEELS"/*.whl
# Console scripts carry this machine's interpreter path; nothing there runs them.
rm -rf "$OUT/site/bin"
tar -C "$OUT/site" -cf - . | xz -T0 -6 | split -b "${PART_MIB}M" -d - "$OUT/part-"
du -sh "$OUT/wheels" "$OUT/site"
ls -la "$OUT"/part-*
