#!/usr/bin/env bash
# Wheels the GPU machine lacks (it reaches no package registry), for its Python 3.12, into .whl/
# (git-ignored; carry it with the device call). tests/gpu/session.sh installs them from there.
# The versions are the ones the dev venv resolves (pyproject pins fastapi/uvicorn/httptools/uvloop; fastapi
# imports opentelemetry-api for its telemetry hooks; openai 3.x speaks through httpx2; llguidance
# 1.9.1 is built for manylinux_2_31 only; jsonschema and its dependencies validate structured
# outputs in the tests; prometheus-client: /metrics; compressed-tensors and loguru: the golden gate's
# HF side of compressed-tensors checkpoints, tests/quant_definitions.py; peft, accelerate and psutil:
# the LoRA golden gate's HF + PEFT side, tests/gpu/test_lora_gpu.py; transformers 5.23: the
# deepseek_v4 golden gate's HF side, tests/gpu/gpu_families.py, which the GPU machine's 5.17 lacks,
# and huggingface-hub 1.33: 5.23 needs >= 1.31 where 5.17 needed >= 1.5, < 2; its 1.x keeps the
# httpx / typer dependencies 5.17's stack has, where 2.x moves to httpx2 and click >= 8.4.2;
# tokenizers, safetensors and regex: 5.23 asks for the same minimums as 5.17, so none is carried).
# Only some: tools/gpu_wheels.sh transformers==5.23.0 huggingface-hub==1.33.0
# NCCL is not carried (the nvidia-nccl-cu13 wheel is ~300 MB): the GPU machine's torch installed
# the nvidia-nccl wheel of its CUDA, whose site-packages/nvidia/nccl/lib/libnccl.so.2
# runtime/cuda/nccl.py finds on sys.path (INFC_NCCL_LIB names another).
set -euo pipefail
cd "$(dirname "$0")/.."
mkdir -p .whl
pkgs="fastapi==0.165.0 starlette==1.10.0 pydantic==2.14.4 pydantic-core==2.50.5 uvicorn==0.54.0 httptools==0.9.0 uvloop==0.23.0
      annotated-types==0.8.0 typing-inspection==0.4.5 openai==3.54.0 jiter==0.19.0 distro sniffio==1.3.1
      annotated-doc opentelemetry-api==1.45.2 httpx2==2.16.2 httpcore2==2.16.2 truststore==0.10.5
      llguidance==1.9.1 jsonschema==4.26.0 jsonschema-specifications==2025.9.1 referencing==0.37.0
      rpds-py==2026.9.1 attrs==26.1.0 prometheus-client==0.26.0 compressed-tensors==0.20.1 loguru==0.7.3
      peft==0.21.2 accelerate==1.15.0 psutil==7.2.2 transformers==5.23.0 huggingface-hub==1.33.0"
plat="--platform manylinux_2_31_x86_64 --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64
      --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform manylinux1_x86_64"
[ $# -gt 0 ] && pkgs="$*"          # only the named ones (a wheel added to the list)
for p in $pkgs; do
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    $plat -d .whl "$p"
done
ls .whl
