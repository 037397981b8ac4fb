#!/usr/bin/env bash
# Installs the SGLang extra into .venv (after ci/setup.sh): sglang 0.5.23, whose real attention backends the
# adapter (backends/sglang/) runs as sglang.* leaves of the matrix.
#
# sglang's own metadata pins CUDA packages (torch 2.14.1, flashinfer, sglang-kernel): pip must never resolve
# them, on a CPU machine least of all. So sglang goes in with --no-deps, and then only the packages it imports
# at import time. torchvision is not installed (its wheel needs a CUDA torch); the adapter serves an inert
# stand-in when it is absent. Triton is pinned to 3.8.0, the one SGLang 0.5.23's torch 2.14.1 ships with: the fla
# kernels it vendors for GDN use block pointers, which Triton 3.9 removed ("Block pointers have been removed in
# favor of the tensor descriptor API").
set -euo pipefail
cd "$(dirname "$0")/.."
PIP=(.venv/bin/python -m pip install -q --disable-pip-version-check)
"${PIP[@]}" --no-deps "sglang==0.5.23" "apache-tvm-ffi==0.1.11" "triton==3.8.0"
# Import-time dependencies (where sglang 0.5.23 pins a version, its pin).
"${PIP[@]}" numpy orjson psutil pybase64 requests packaging pillow starlette msgspec pydantic pyzmq tqdm \
  IPython aiohttp "transformers==5.19.0" "tokenizers==0.23.2" dill "sentencepiece==0.2.1" \
  "compressed-tensors==0.18.0" gguf "openai==2.8.0" partial_json_parser einops "uvicorn>=0.51" fastapi
.venv/bin/python -c "import importlib.metadata as m; print('sglang', m.version('sglang'), 'installed')"
