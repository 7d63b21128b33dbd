#!/usr/bin/env bash
# Builds .venv-sglang: SGLang 0.5.23 (its own torch 2.14.1, beside tierkv's 2.13.0 in .venv) with tierkv installed
# editable into it, for the `sglang` tests (tests/test_sglang_*.py).  A lean install: sglang without its
# dependencies, then the plain ones a CPU server imports (its kernel package, flashinfer and the CUDA libraries
# are left out; tests/sglang_cpu/sitecustomize.py stands in for what a CPU run needs of them).  Idempotent: a venv
# built by this very recipe is kept (a stamp in it).  About 5 min and 6 GB.
set -euo pipefail
SELF="$(cd "$(dirname "$0")" && pwd)/$(basename "$0")"
cd "$(dirname "$0")/../.."
PY="${PYTHON:-python3}"
VENV=.venv-sglang
PIP_QUIET=(-q --disable-pip-version-check --progress-bar off)
# the stamp names this script's content: an edit to the recipe rebuilds on top of what is there
STAMP="$VENV/.tierkv-built"
WANT=$(sha256sum "$SELF" | cut -c1-16)
if [ -x "$VENV/bin/python" ] && [ "$(cat "$STAMP" 2>/dev/null)" = "$WANT" ]; then
  exit 0
fi
start=$(date +%s)
[ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV"
VPIP=("$VENV/bin/python" -m pip)
TORCH_INDEX=()
[ -z "${TIERKV_TORCH_INDEX_URL:-}" ] || TORCH_INDEX=(--index-url "$TIERKV_TORCH_INDEX_URL")
"${VPIP[@]}" install "${PIP_QUIET[@]}" ${TORCH_INDEX[@]+"${TORCH_INDEX[@]}"} "torch==2.14.1" "torchvision==0.29.1"
"${VPIP[@]}" install "${PIP_QUIET[@]}" --no-deps "sglang==0.5.23"
"${VPIP[@]}" install "${PIP_QUIET[@]}" numpy psutil requests pydantic msgspec orjson packaging pyzmq prometheus-client \
  setproctitle pybase64 aiohttp fastapi "uvicorn>=0.51" uvloop pillow "transformers==5.19.0" dill \
  "apache-tvm-ffi==0.1.11" "sentencepiece==0.2.1" "compressed-tensors==0.18.0" gguf "openai==2.8.0" \
  partial-json-parser einops jsonschema "xgrammar==0.2.7" "soundfile==0.13.1" python-multipart IPython \
  "kernels>=0.14.1,<0.15" pyyaml "tokenizers==0.23.2" "torch==2.14.1"
# tierkv itself, editable, with its runtime dependencies (not its torch pin: SGLang's torch stays) and Mooncake
# for the shared-pool tests
"${VPIP[@]}" install "${PIP_QUIET[@]}" --no-deps -e .
"${VPIP[@]}" install "${PIP_QUIET[@]}" lz4 aiofiles sortedcontainers xxhash crc32c tqdm matplotlib prometheus_client \
  pyyaml "mooncake-transfer-engine-non-cuda==0.3.13.post1" "torch==2.14.1"
"$VENV/bin/python" -c "import sglang.srt.mem_cache.hicache_storage, tierkv.store"
echo "$WANT" > "$STAMP"
echo "built $VENV in $(( $(date +%s) - start )) s"
