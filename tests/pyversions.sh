#!/usr/bin/env bash
# tierkv on every Python requires-python claims besides the main suite's (3.11): on each, every module compiles
# and imports, and the core store tests pass.  tests/run.sh calls it; TIERKV_SKIP_PYVERSIONS=1 skips it there.
#
#   bash tests/pyversions.sh                      # 3.10, 3.12 and 3.13
#   TIERKV_PYVERSIONS="3.10" bash tests/pyversions.sh
#
# The interpreter: python3.X on PATH, else pyenv's ($PYENV_ROOT/versions/3.X.*), else /usr/bin or /usr/local/bin.
# Each Python gets a venv kept between runs under $TIERKV_PYVERSIONS_HOME (default ~/.cache/tierkv/pyversions):
# torch there is the package index's build (a CPU torch wheel exists here for 3.11 only), 0.5 GB of wheel plus
# CUDA libraries, ~4.9 GB installed per Python, downloaded on a machine's first run and reused after.  Cost
# (docs/history.md, 2026-12-06): 4 to 6 min for the three Pythons once their venvs exist; 3 to 6 min more per
# Python on a machine's first run.
# A Python that cannot be found, or whose install fails (after one retry), is a failure: one line names it, the
# summary counts it, and the script exits 1.  Nothing is skipped in silence.
set -uo pipefail
cd "$(dirname "$0")/.."
VERSIONS="${TIERKV_PYVERSIONS:-3.10 3.12 3.13}"
VENVS="${TIERKV_PYVERSIONS_HOME:-${XDG_CACHE_HOME:-$HOME/.cache}/tierkv/pyversions}"
PIP_QUIET=(-q --disable-pip-version-check --progress-bar off)
# the core: store, tiers, policies, SSD engine, typed contracts; none needs vLLM, Mooncake or SGLang
TESTS=(tests/test_python_versions.py tests/test_typed_contracts.py tests/test_store.py tests/test_store_truth.py
       tests/test_policies.py tests/test_tiers_local.py tests/test_misses.py tests/test_ssd_engine.py)

is_version() {  # $1 runs and is Python $2
  "$1" -c "import sys; sys.exit('%d.%d' % sys.version_info[:2] != '$2')" >/dev/null 2>&1
}

find_python() {  # the interpreter of version $1 that runs, or nothing
  local v=$1 c
  for c in "$(command -v "python$v" 2>/dev/null)" "${PYENV_ROOT:-$HOME/.pyenv}"/versions/"$v".*/bin/"python$v" \
           "/usr/local/bin/python$v" "/usr/bin/python$v"; do
    if [ -n "$c" ] && [ -x "$c" ] && is_version "$c" "$v"; then
      echo "$c"
      return 0
    fi
  done
  return 1
}

install() {  # $1: the venv's python.  torch pinned as in tests/run.sh, then this checkout with its test extras
  "$1" -m pip install "${PIP_QUIET[@]}" "torch==2.13.0" && "$1" -m pip install "${PIP_QUIET[@]}" -e ".[test]"
}

# every tierkv module imports, but those that need an engine this venv lacks (vLLM, Mooncake, SGLang, NIXL)
IMPORT_ALL='
import importlib, pkgutil, sys
if sys.version_info >= (3, 11):
    import tomllib
else:
    import tomli as tomllib
OPTIONAL = {"vllm", "mooncake", "sglang", "nixl", "transformers"}
NOT_PYTHON = {"tierkv._copysum"}  # a C library loaded with ctypes (tierkv/xxh3.py)
with open("pyproject.toml", "rb") as f:
    packages = tomllib.load(f)["tool"]["setuptools"]["packages"]
names = set(packages)
for p in packages:
    names.update(m.name for m in pkgutil.iter_modules(importlib.import_module(p).__path__, p + "."))
done, failed = 0, []
for name in sorted(names - NOT_PYTHON):
    if name.endswith(".__main__"):  # runs the command
        continue
    try:
        importlib.import_module(name)
        done += 1
    except ModuleNotFoundError as e:
        if (e.name or "").split(".")[0] not in OPTIONAL:
            failed.append(f"{name}: {e!r}")
    except Exception as e:
        failed.append(f"{name}: {e!r}")
print(f"imported {done} tierkv modules on Python {sys.version.split()[0]}")
sys.exit("cannot import:\n  " + "\n  ".join(failed) if failed else 0)
'

passed=() failed=() ready=()
fail() { echo "pyversions: Python $1 FAILED: $2"; failed+=("$1 ($2)"); }
# one Python at a time: interpreter, venv, install (pip builds in this checkout: never two at once), imports
for v in $VERSIONS; do
  start=$SECONDS
  if ! py=$(find_python "$v"); then
    fail "$v" "no python$v interpreter found (PATH, ${PYENV_ROOT:-$HOME/.pyenv}/versions, /usr/local/bin, /usr/bin)"
    continue
  fi
  venv="$VENVS/$v"
  vpy="$venv/bin/python"
  if ! is_version "$vpy" "$v"; then
    rm -rf "$venv"
    mkdir -p "$VENVS"
    if ! "$py" -m venv "$venv"; then fail "$v" "cannot create a venv with $py"; continue; fi
  fi
  echo "pyversions: Python $v ($py), venv $venv"
  if ! install "$vpy"; then
    echo "pyversions: Python $v: install failed, retrying once"
    sleep 10
    if ! install "$vpy"; then fail "$v" "install of torch==2.13.0 and .[test] failed twice (package index reachable?)"; continue; fi
  fi
  echo "pyversions: Python $v: installed in $((SECONDS - start)) s ($(du -sm "$venv" | cut -f1) MB in the venv)"
  if ! PYTHONPYCACHEPREFIX="$venv/pycache" "$vpy" -m compileall -q tierkv tiers policies adapters >/dev/null; then
    fail "$v" "a module does not compile"; continue
  fi
  if ! PYTHONDONTWRITEBYTECODE=1 "$vpy" -c "$IMPORT_ALL"; then fail "$v" "a module does not import"; continue; fi
  ready+=("$v")
done

# the tests of every Python at once (they wait on files and threads more than on the CPU), each log printed whole
logs=$(mktemp -d)
start=$SECONDS
for v in ${ready[@]+"${ready[@]}"}; do
  PYTHONDONTWRITEBYTECODE=1 "$VENVS/$v/bin/python" -m pytest -p no:cacheprovider -q --basetemp "$logs/tmp-$v" \
    "${TESTS[@]}" >"$logs/$v.log" 2>&1 &
  echo $! >"$logs/$v.pid"
done
for v in ${ready[@]+"${ready[@]}"}; do
  wait "$(cat "$logs/$v.pid")"
  rc=$?
  echo "pyversions: Python $v, core store tests:"
  cat "$logs/$v.log"
  if [ "$rc" = 0 ]; then passed+=("$v"); else fail "$v" "core store tests (pytest exit $rc)"; fi
done
rm -rf "$logs"
echo "pyversions: tests of ${#ready[@]} Pythons together in $((SECONDS - start)) s"

echo "pyversions: Pythons passed ${#passed[@]}, failed ${#failed[@]} (passed: ${passed[*]:-none}${failed[*]:+; failed: ${failed[*]}})"
[ "${#failed[@]}" = 0 ]
