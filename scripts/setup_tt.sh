#!/usr/bin/env bash
# Set up .venv-tt: the Python 3.12 environment with the real ttnn 0.81.1 wheel, for the tests in
# tests/tt (mock-cluster mode, no Tenstorrent device). Idempotent: a second run only re-installs
# ttbundle itself. Needs nothing outside the checkout and a package index.
#
#   scripts/setup_tt.sh                      # then: .venv-tt/bin/python -m pytest tests/tt -q
#   PYTHON=/path/to/python3.12 VENV=dir scripts/setup_tt.sh
#
# No torch: the cp312 torch on PyPI is the ~5.5 GB CUDA build. The tests make ttnn tensors from
# numpy arrays (ttnn.Tensor(ndarray, dtype, device, layout), the constructor ttnn.from_torch
# calls), and ttbundle's block floats run on numpy. ttnn needs numpy<2, so this environment has
# numpy 1.26 while the main one has 2.x; ttbundle/blockfloat.py works with both.
#
# SFPI stub (TT_SFPI_STUB=0 to skip): ttnn.open_mesh_device on a mock cluster first checks for the
# SFPI RISC-V compiler, which is only on GitHub. A stub riscv-tt-elf-g++ that answers --version
# with the wheel's pinned SFPI version lets it fall back to the wheel's precompiled firmware, so
# mock meshes open (allocator, mesh mappers). Nothing that compiles a kernel works with it. The
# stub is never installed where a real SFPI exists (/opt/tenstorrent/sfpi).
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${VENV:-.venv-tt}
TTNN_VERSION=0.81.1

if [ -z "${PYTHON:-}" ]; then
  for p in "$HOME/.pyenv/versions/3.12.1/bin/python" python3.12 python3.10; do
    if command -v "$p" >/dev/null 2>&1; then PYTHON=$p; break; fi
  done
fi
: "${PYTHON:?no Python 3.12 or 3.10 found: set PYTHON=/path/to/python3.12 (ttnn wheels are cp310/cp312 only)}"
case "$("$PYTHON" -c 'import sys; print("%d.%d" % sys.version_info[:2])')" in
  3.12|3.10) ;;
  *) echo "[setup_tt] $PYTHON is not Python 3.12 or 3.10 (ttnn wheels are cp310/cp312 only)" >&2; exit 2 ;;
esac

if [ ! -x "$VENV/bin/python" ]; then
  echo "[setup_tt] venv $VENV with $PYTHON"
  "$PYTHON" -m venv "$VENV"
fi
py="$VENV/bin/python"
pip=("$py" -m pip --disable-pip-version-check)

if ! "$py" -c "import importlib.metadata as m, sys; sys.exit(m.version('ttnn') != '$TTNN_VERSION')" 2>/dev/null; then
  echo "[setup_tt] ttnn==$TTNN_VERSION (~100 MB wheel, ~650 MB installed; no torch)"
  "${pip[@]}" install -q "ttnn==$TTNN_VERSION"
fi
echo "[setup_tt] ttbundle (editable) with the tt and test extras"
"${pip[@]}" install -q -e '.[tt,test]'

site=$("$py" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
stub="$site/ttnn/runtime/sfpi/compiler/bin/riscv-tt-elf-g++"
if [ "${TT_SFPI_STUB:-1}" != 0 ] && [ ! -e /opt/tenstorrent/sfpi ] && [ ! -e "$stub" ]; then
  ver=$(sed -n "s/^sfpi_version='\(.*\)'/\1/p" "$site/ttnn/tt_metal/sfpi-version")
  build=$(sed -n "s/^sfpi_build='\(.*\)'/\1/p" "$site/ttnn/tt_metal/sfpi-version")
  echo "[setup_tt] SFPI stub for mock meshes (sfpi $ver build $build)"
  mkdir -p "$(dirname "$stub")"
  cat >"$stub" <<EOF
#!/bin/sh
# Written by ttbundle's scripts/setup_tt.sh: NOT a compiler. Answers --version so that ttnn on a
# mock cluster uses its precompiled firmware; anything else fails.
if [ "\$1" = "--version" ]; then echo "riscv-tt-elf-g++ (tenstorrent/sfpi:$ver[$build]) 15.1.0"; exit 0; fi
echo "riscv-tt-elf-g++: ttbundle's stub cannot compile kernels (mock cluster only)" >&2
exit 1
EOF
  chmod +x "$stub"
fi

# Smoke check, with everything ttnn writes (generated/, JIT cache, OpenMPI files) in a temp dir.
py_abs="$(cd "$VENV" && pwd)/bin/python"
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
if ! (cd "$tmp" && TT_METAL_CACHE="$tmp/cache/" TMPDIR="$tmp" "$py_abs" -c '
import importlib.metadata as m, numpy, ttnn, ttbundle.blockfloat
print("[setup_tt] ok: ttnn", m.version("ttnn"), "numpy", numpy.__version__, "ttbundle", m.version("ttbundle"))
' >"$tmp/log" 2>&1); then
  cat "$tmp/log" >&2
  exit 1
fi
grep '^\[setup_tt\]' "$tmp/log"
