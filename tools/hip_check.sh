#!/usr/bin/env bash
# Compile-check the HIP core without ROCm installed and without an AMD GPU:
#   bash tools/hip_check.sh fetch DIR               # real hipBLASLt 1.x + HIP headers from Debian's archive
#   bash tools/hip_check.sh check ROOT [TARGET ...] # ROOT/include: hip/, hipblaslt/, hipblas-common/, hsa/
# `check` compiles
#   - the host sources (csrc/*.cpp, kernels/sm90_gemm.cpp) with FUSEDENC_HIP against ROOT's hipBLASLt
#     (g++ -fsyntax-only), and reports which of vendor.h's hipBLASLt branches the headers select;
#   - every kernel (.cu) as HIP for each target (default gfx90a gfx942 gfx1100 gfx1101 gfx1151) with
#     clang's HIP compiler, device pass to assembly and host pass, and reports per target the wavefront
#     size its kernels are compiled for, the warp widths the reductions are instantiated for, and what
#     the compiler's __AMDGCN_WAVEFRONT_SIZE says in the device and in the host pass (the host pass is
#     why the core takes the width from the device at run time: csrc/kernels/warp.cuh).
# ROOT can be a ROCm install (/opt/rocm) or what `fetch` extracts: Debian's sid/experimental packages
# libhipblaslt-dev 7.1.1 (hipBLASLt 1.1.0, ROCm 7.1) and 7.2.4 (hipBLASLt 1.2.2, ROCm 7.2), with the
# HIP headers of the same suite (libamdhip64-dev 6.4.3 / 7.2.4, libhsa-runtime-dev), unpacked, not
# installed: DIR/hipblaslt-1.1 and DIR/hipblaslt-1.2.  The device pass links no device libraries
# (-nogpulib): it checks the code and the wavefront, not a loadable binary.
# Needs: g++, clang++ >= 17 ($HIP_CLANG; default clang++-19, then clang++), python3 with pybind11;
# `fetch` needs apt-get (Debian).  Exit 0: everything compiled; 1: something did not.
set -uo pipefail
cd "$(dirname "$0")/.."

fetch() {
  local dir=${1:?usage: bash tools/hip_check.sh fetch DIR}
  mkdir -p "$dir" && dir=$(realpath "$dir")
  local apt=$dir/apt
  mkdir -p "$apt/lists/partial" "$apt/cache/archives/partial" "$dir/debs"
  cat > "$apt/sources.list" <<'EOF'
deb [signed-by=/usr/share/keyrings/debian-archive-keyring.gpg] http://deb.debian.org/debian sid main
deb [signed-by=/usr/share/keyrings/debian-archive-keyring.gpg] http://deb.debian.org/debian experimental main
EOF
  # A private package list: the machine's own apt configuration and packages stay untouched.
  local opts=(-o "Dir::Etc::sourcelist=$apt/sources.list" -o Dir::Etc::sourceparts=- -o "Dir::State::Lists=$apt/lists"
              -o "Dir::Cache=$apt/cache" -o APT::Sandbox::User=root)
  apt-get "${opts[@]}" update -qq || return 1
  local -A sets=(
    [1.1]="libhipblaslt-dev=7.1.1+dfsg-4 libhipblas-common-dev=7.1.0-1+b1 libamdhip64-dev=6.4.3-5 libhsa-runtime-dev=6.4.3+dfsg-5"
    [1.2]="libhipblaslt-dev=7.2.4+dfsg-1~exp1 libhipblas-common-dev=7.2.4-1~exp1 libamdhip64-dev=7.2.4-1~exp2 libhsa-runtime-dev=6.4.3+dfsg-5"
  )
  for version in "${!sets[@]}"; do
    local root=$dir/hipblaslt-$version
    rm -rf "$root"; mkdir -p "$root"
    for spec in ${sets[$version]}; do
      (cd "$dir/debs" && apt-get "${opts[@]}" download "$spec" -qq) || { echo "cannot download $spec"; return 1; }
      local deb
      deb=$(ls "$dir/debs/${spec%%=*}_$(echo "${spec#*=}" | sed 's/^[0-9]*://')"_*.deb | head -1)
      dpkg-deb -x "$deb" "$root/pkg"
    done
    # share/hip/version: clang's HIP driver reads the HIP version there (its wrappers depend on it).
    mv "$root/pkg/usr/include" "$root/include"; mkdir -p "$root/share"; mv "$root/pkg/usr/share/hip" "$root/share/"
    rm -rf "$root/pkg"
    grep -h "define HIPBLASLT_VERSION_M" "$root/include/hipblaslt/hipblaslt-version.h" | tr -s ' ' | tr '\n' ' '
    echo "-> $root"
  done
}

check() {
  local root=${1:?usage: bash tools/hip_check.sh check ROOT [TARGET ...]}; shift
  local targets=("$@"); [ ${#targets[@]} -gt 0 ] || targets=(gfx90a gfx942 gfx1100 gfx1101 gfx1151)
  local clang=${HIP_CLANG:-$(command -v clang++-19 || command -v clang++)}
  local inc=$root/include failed=0 out
  out=$(mktemp -d)
  [ -f "$inc/hipblaslt/hipblaslt-version.h" ] || { echo "no $inc/hipblaslt/hipblaslt-version.h"; return 1; }
  local pyinc pybind
  pyinc=$(python3 -c "import sysconfig; print(sysconfig.get_paths()['include'])")
  pybind=$(python3 -c "import pybind11; print(pybind11.get_include())") || return 1
  echo "hipBLASLt $(sed -n 's/#define HIPBLASLT_VERSION_\(MAJOR\|MINOR\|PATCH\) *\([0-9]*\).*/\2/p' "$inc/hipblaslt/hipblaslt-version.h" | paste -sd.)" \
       "($root), HIP $(grep -h 'define HIP_VERSION_M[AI]' "$inc/hip/hip_version.h" | awk '{print $3}' | paste -sd.)," \
       "$("$clang" --version | head -1), $(g++ --version | head -1)"

  # vendor.h's branches as these headers select them.
  cat > "$out/probe.cpp" <<'EOF'
#include "vendor.h"
#define FUSEDENC_STR2(x) #x
#define FUSEDENC_STR(x) FUSEDENC_STR2(x)
#pragma message("FUSEDENC_HAS_SWISH_EPILOGUE=" FUSEDENC_STR(FUSEDENC_HAS_SWISH_EPILOGUE) " FUSEDENC_HAS_FP8_GEMM=" FUSEDENC_STR(FUSEDENC_HAS_FP8_GEMM) " A_SCALE=" FUSEDENC_STR(BLASLT_MATMUL_DESC_A_SCALE_POINTER) " SWISH_BIAS=" FUSEDENC_STR(BLASLT_EPILOGUE_SWISH_BIAS))
// The 1.x scale API: the mode attribute and the OUTER_VEC_32F value, used as vendor.h uses them.
static_assert(HIPBLASLT_VERSION_MAJOR < 1 || sizeof(&blasLtSetOuterVectorScales) > 0, "");
EOF
  local host_flags=(-std=c++17 -Wall -DFUSEDENC_HIP=1 -D__HIP_PLATFORM_AMD__ -Icsrc -isystem "$inc" -I"$pybind" -I"$pyinc")
  echo "== vendor.h's hipBLASLt branches"
  g++ "${host_flags[@]}" -fsyntax-only "$out/probe.cpp" 2>&1 | grep -o "pragma message: [^’']*" | sed "s/^/   /" || failed=1
  echo "== host sources (g++ -fsyntax-only)"
  for f in csrc/gemm.cpp csrc/fp8_gemm.cpp csrc/bindings.cpp csrc/kernels/sm90_gemm.cpp; do
    if g++ "${host_flags[@]}" -fsyntax-only "$f" > "$out/host.log" 2>&1 && [ ! -s "$out/host.log" ]; then
      echo "   ok   $f"
    else echo "   FAIL $f"; head -20 "$out/host.log" | sed 's/^/        /'; failed=1; fi
  done
  echo "== kernels per target (HIP device pass to assembly, and the host pass)"
  local hip_flags=(-x hip -std=c++17 -O3 --rocm-path="$root" -nogpulib -DFUSEDENC_HIP=1 -Icsrc -isystem "$inc")
  for t in "${targets[@]}"; do
    local dev host
    dev=$("$clang" "${hip_flags[@]}" --offload-arch="$t" --cuda-device-only -dM -E /dev/null 2>/dev/null |
          sed -n 's/#define __AMDGCN_WAVEFRONT_SIZE \([0-9]*\)/\1/p')
    host=$("$clang" "${hip_flags[@]}" --offload-arch="$t" --cuda-host-only -dM -E /dev/null 2>/dev/null |
           sed -n 's/#define __AMDGCN_WAVEFRONT_SIZE \([0-9]*\)/\1/p')
    echo "   $t: __AMDGCN_WAVEFRONT_SIZE ${dev:-undefined} in the device pass, ${host:-undefined} in the host pass"
    for f in csrc/kernels/*.cu; do
      local s=$out/$(basename "$f" .cu)-$t.s
      if ! "$clang" "${hip_flags[@]}" --offload-arch="$t" --cuda-device-only -S -o "$s" "$f" > "$out/dev.log" 2>&1; then
        echo "      FAIL device $f"; head -20 "$out/dev.log" | sed 's/^/        /'; failed=1; continue
      fi
      if ! "$clang" "${hip_flags[@]}" --offload-arch="$t" --cuda-host-only -fsyntax-only "$f" > "$out/host.log" 2>&1; then
        echo "      FAIL host pass $f"; head -20 "$out/host.log" | sed 's/^/        /'; failed=1; continue
      fi
      local kernels wave32 widths
      kernels=$(grep -c "^\s*\.amdhsa_kernel " "$s")
      wave32=$(grep -c "\.amdhsa_wavefront_size32 1" "$s")
      # The reduction kernels' last template argument is their warp width (fusedenc::WarpWidth).
      widths=$(grep -oE "^_Z[A-Za-z0-9_]*(layer_norm_kernel|fp8_quantize[a-z_]*kernel)[A-Za-z0-9_]*:" "$s" |
               sed -E 's/.*Li([0-9]+)EEEv.*/\1/' | sort -un | paste -sd,)
      printf "      %-22s %3d kernels, %s%s\n" "$(basename "$f")" "$kernels" \
        "$([ "$wave32" -eq "$kernels" ] && echo wave32 || { [ "$wave32" -eq 0 ] && echo wave64 || echo "mixed ($wave32 wave32)"; })" \
        "${widths:+, reductions for warps of $widths lanes}"
    done
  done
  rm -rf "$out"
  [ $failed -eq 0 ] && echo "HIP CHECK PASSED" || echo "HIP CHECK FAILED"
  return $failed
}

case "${1:-}" in
  fetch) shift; fetch "$@" ;;
  check) shift; check "$@" ;;
  *) echo "usage: bash tools/hip_check.sh fetch DIR | check ROOT [TARGET ...]"; exit 2 ;;
esac
