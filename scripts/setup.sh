#!/usr/bin/env bash
# Set up .venv with everything ttbundle and its tests need, on a fresh machine of this kind
# (Python 3.11, CPU only). Idempotent: a second run only re-installs ttbundle itself.
#
# Order matters (see docs/install.md): torch 2.13.0 CPU first (a wheel on this machine kind's
# disk), then vLLM 0.33.0 from its sdist with no device kernels, then the pinned rest.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3.11}
VENV=${VENV:-.venv}

if [ ! -x "$VENV/bin/python" ]; then
  "$PY" -m venv "$VENV"
fi
pip=("$VENV/bin/python" -m pip --disable-pip-version-check)

if ! "$VENV/bin/python" -c "import torch, vllm; assert torch.__version__.startswith('2.13.0') and vllm.__version__ == '0.33.0'" 2>/dev/null; then
  echo "[setup] torch 2.13.0 (CPU)"
  "${pip[@]}" install -q torch==2.13.0
  echo "[setup] build dependencies for vLLM's sdist"
  "${pip[@]}" install -q -c constraints.txt 'setuptools>=77.0.3,<81' 'setuptools-scm>=8' \
      'setuptools-rust>=1.9.0' wheel jinja2 'packaging>=24.2'
  echo "[setup] vLLM 0.33.0 from source, VLLM_TARGET_DEVICE=empty (a few minutes)"
  # The optional Rust frontend cannot be fetched offline; keep cargo off PATH so it is skipped.
  PATH=$(printf '%s' "$PATH" | tr ':' '\n' | grep -v '\.cargo/bin' | paste -sd: -) \
  VLLM_TARGET_DEVICE=empty VLLM_SKIP_VERSION_SUFFIX=1 \
    "${pip[@]}" install -q --no-build-isolation --no-binary vllm -c constraints.txt vllm==0.33.0 torch==2.13.0
fi
echo "[setup] ttbundle and pinned dependencies"
"${pip[@]}" install -q -c constraints.txt -e '.[torch,serve,test]' torch==2.13.0
# Triton (a GPU kernel compiler xgrammar pulls in for CUDA tensors) is not used on a CPU host:
# vLLM and xgrammar fall back without it, and its bindings print ~30 "nanobind: leaked" lines
# at every exit of every vLLM process (docs/runtime.md, "Stopping").
if "$VENV/bin/python" -c "import importlib.util as u, sys; sys.exit(u.find_spec('triton') is None)" 2>/dev/null; then
  "${pip[@]}" uninstall -q -y triton
fi
"$VENV/bin/python" -c "import ttbundle, torch, vllm, transformers; print('[setup] ok: ttbundle', ttbundle.__version__, 'torch', torch.__version__, 'vllm', vllm.__version__, 'transformers', transformers.__version__)"
