#!/usr/bin/env bash
# Build fusedenc's binary wheel, install it in a fresh virtual environment with no CUDA compiler
# on the PATH, and run the GPU suite from it (outside the checkout, so the wheel is what runs).
#   bash tools/wheel_check.sh build      # -> dist/fusedenc-<version>-<python>-linux_x86_64.whl
#   bash tools/wheel_check.sh test [pytest args]   # installs dist/*.whl in a fresh venv, runs -m gpu
# The build is the README's command: FUSEDENC_GPU=cuda python3 -m pip wheel --no-build-isolation
# --no-deps -w dist . (CUDA core for sm80/89/90, the Triton kernels, the shipped tables).  A wheel
# must carry the Hopper kernels: CMake refuses a wheel for sm90 without CUTLASS's headers
# (pip install --no-deps nvidia-cutlass: only its headers are used; FUSEDENC_SM90_BUILD=off
# builds one without them on purpose), and `build` checks the wheel's _build_info says they were built.
# The test venv takes torch, Triton, nvidia-cublas and the test packages from the Python that
# runs this script (a .pth file: the GPU machine has no internet to install them from); it gets
# no fusedenc but the wheel's.  Triton still needs a C compiler at run time for its launcher
# stubs, so only the CUDA toolkit (nvcc) is taken off the PATH.  Logs under $OUT (./gpu-out).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-$PWD/gpu-out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
case "${1:-}" in
  build)
    rm -rf dist
    if ! FUSEDENC_GPU=cuda python3 -m pip wheel --no-build-isolation --no-deps -w dist . > "$OUT/wheel-build.log" 2>&1; then
      tail -30 "$OUT/wheel-build.log"; echo "WHEEL BUILD FAILED"; exit 1
    fi
    ls -l dist
    python3 -m zipfile -l dist/*.whl | grep -E "_C\.|configs/|triton_short|triton_gemm"
    sm90=$(python3 - dist/*.whl <<'PY'
import sys, zipfile
text = zipfile.ZipFile(sys.argv[1]).read("fusedenc/_build_info.py").decode()
print(next((line.split("=", 1)[1].strip().strip('"') for line in text.splitlines() if line.startswith("SM90_GEMM")), ""))
PY
)
    echo "Hopper kernels: ${sm90:-unknown}"
    case "$sm90" in
      built:*) ;;
      *) if [ "${FUSEDENC_SM90_BUILD:-auto}" != off ]; then echo "WHEEL WITHOUT HOPPER KERNELS"; exit 1; fi ;;
    esac ;;
  test)
    shift
    wheel=${WHEEL:-$(ls dist/fusedenc-*.whl 2>/dev/null | head -1)}  # WHEEL=path: a wheel built elsewhere
    [ -n "$wheel" ] || { echo "no dist/fusedenc-*.whl: run 'bash tools/wheel_check.sh build' first"; exit 1; }
    env_dir=$(mktemp -d)/venv; work=$(mktemp -d)
    python3 -m venv "$env_dir"
    deps=$(python3 -c "import site; print(site.getsitepackages()[0])")
    echo "$deps" > "$("$env_dir/bin/python" -c "import site; print(site.getsitepackages()[0])")/host-packages.pth"
    "$env_dir/bin/python" -m pip install -q --no-index --no-deps "$wheel" || exit 1
    cp -r tests pyproject.toml "$work/"
    # No CUDA compiler: PATH without the directories that hold nvcc, CUDA_HOME pointing nowhere.
    clean_path=$(echo "$PATH" | tr ':' '\n' | while read -r d; do [ -e "$d/nvcc" ] || echo "$d"; done | paste -sd:)
    cd "$work"
    run() { env PATH="$env_dir/bin:$clean_path" CUDA_HOME=/nonexistent "$@"; }
    if run sh -c 'command -v nvcc'; then echo "nvcc is still on the PATH"; exit 1; fi
    run python -c "import fusedenc, sys; print('fusedenc from', fusedenc.__file__); sys.exit('fusedenc' not in fusedenc.__file__ or 'site-packages' not in fusedenc.__file__)" || exit 1
    run python -m fusedenc
    run env FUSEDENC_REQUIRE_GPU=1 FUSEDENC_REQUIRE_NATIVE=cuda python -m pytest -m gpu -q -p no:cacheprovider "$@" \
      > "$OUT/wheel-gpu-tests.log" 2>&1
    rc=$?
    tail -3 "$OUT/wheel-gpu-tests.log"; grep -E "^(FAILED|ERROR)" "$OUT/wheel-gpu-tests.log" | head -20
    exit $rc ;;
  *) echo "usage: bash tools/wheel_check.sh build | test [pytest args]"; exit 2 ;;
esac
