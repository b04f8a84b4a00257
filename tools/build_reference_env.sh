#!/usr/bin/env bash
# Builds the transformers reference environment once (torch CPU + transformers: independent ports of every
# architecture the engine implements) into a cache directory later runs reuse; never a project dependency.
# tests/engine/test_vl_parity.py runs transformers' own reader on our exports in it.
# Usage: tools/build_reference_env.sh [PREFIX]. Prints the environment's python on its last line.
set -euo pipefail
TORCH="${REFERENCE_TORCH:-2.13.0}"
TRANSFORMERS="${REFERENCE_TRANSFORMERS:-5.24.*}"
PREFIX="${1:-${ERNIE_STUDIO_REFERENCE_HOME:-$HOME/.cache/ernie-studio/reference}}"
DEST="$PREFIX/torch-$TORCH-transformers-${TRANSFORMERS//\*/x}"
PY="$DEST/bin/python"
if [ -x "$PY" ] && [ -f "$DEST/.complete" ]; then echo "$PY"; exit 0; fi
rm -rf "$DEST"
"${PYTHON:-python3.11}" -m venv "$DEST" >&2
# torch==2.13.0 is the CPU build this machine keeps on disk (pip takes it from there; uv would download a
# CUDA build); transformers and safetensors come from PyPI.
"$PY" -m pip install -q --disable-pip-version-check "torch==$TORCH" "transformers==$TRANSFORMERS" safetensors >&2
"$PY" -c "import torch, transformers; print('reference env: torch', torch.__version__, 'transformers', transformers.__version__)" >&2
touch "$DEST/.complete"
echo "$PY"
