# syntax=docker/dockerfile:1
# The GPU image for omni-mpo: NVIDIA's PyTorch container plus megatron-core, mamba-ssm, causal-conv1d and this
# repository's requirements, with the repository at /workspace/omni-mpo.
#
#   docker buildx build --target release -t omni-mpo:latest .
#   enroot import -o omni-mpo.sqsh dockerd://omni-mpo:latest      # then CONTAINER=$PWD/omni-mpo.sqsh for slurm/
#
# Why this base: megatron-core 0.19.2 is released against the NGC PyTorch container of its CI (26.06 was the dev pin
# while 0.19 was cut) and asks for Transformer Engine built for CUDA 13 (its `te` extra is transformer-engine
# [core_cu13]); that container ships torch, CUDA 13 and Transformer Engine built together, so none of them is
# installed here. Override with --build-arg BASE_IMAGE=... only together with a rebuild of mamba-ssm/causal-conv1d.
#
# torch stays the container's: requirements.txt pins torch==2.14.1 (and torchvision) for CPU machines and
# CI; here those two lines are dropped and every other requirement is installed under a constraints file that freezes
# the container's torch, torchvision, triton and transformer-engine at their installed versions, so no transitive
# dependency can replace them (pip fails instead). NGC's own PIP_CONSTRAINT is cleared for these installs: it pins
# unrelated packages and megatron-core's docs install with it unset too. The last RUN imports every GPU dependency.
ARG BASE_IMAGE=nvcr.io/nvidia/pytorch:26.06-py3

FROM ${BASE_IMAGE} AS base
ENV PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PIP_NO_CACHE_DIR=1 \
    PYTHONUNBUFFERED=1
WORKDIR /workspace/omni-mpo

# Freeze the container's GPU stack: any install below that would replace one of these fails the build.
RUN python - <<'PY' > /opt/ngc-frozen.txt && cat /opt/ngc-frozen.txt
import importlib.metadata as md
for name in ("torch", "torchvision", "triton", "transformer_engine", "transformer_engine_torch", "flash_attn"):
    try:
        print(f"{name}=={md.version(name)}")
    except md.PackageNotFoundError:
        pass
PY

FROM base AS deps
# must equal megatron_patches.MEGATRON_CORE_VERSION_CHECKED (the release check below and megatron_patches.apply() refuse others)
ARG MEGATRON_CORE_VERSION=0.19.2
ARG CAUSAL_CONV1D_VERSION=1.7.0
ARG MAMBA_SSM_VERSION=2.3.2.post1
ARG WANDB_VERSION=0.28.1
ARG MAX_JOBS=16
# mamba-ssm and causal-conv1d compile CUDA kernels against the container's torch (their prebuilt wheels target PyPI
# torch builds, whose ABI differs): force the source build, without build isolation so the build sees this torch.
RUN PIP_CONSTRAINT="" MAX_JOBS=${MAX_JOBS} CAUSAL_CONV1D_FORCE_BUILD=TRUE MAMBA_FORCE_BUILD=TRUE \
    pip install --no-build-isolation -c /opt/ngc-frozen.txt \
        "causal-conv1d==${CAUSAL_CONV1D_VERSION}" "mamba-ssm==${MAMBA_SSM_VERSION}"
COPY requirements.txt /tmp/requirements.txt
# wandb is pinned to the version slurm/train.sbatch expects (WANDB_PIN_VERSION), so jobs need no pip at start.
RUN grep -vE '^\s*(torch|torchvision)\s*(==|>=|<|;|$)' /tmp/requirements.txt > /tmp/requirements-gpu.txt \
    && printf 'megatron-core==%s\nwandb==%s\n' "${MEGATRON_CORE_VERSION}" "${WANDB_VERSION}" > /tmp/pins.txt \
    && PIP_CONSTRAINT="" pip install -c /opt/ngc-frozen.txt -c /tmp/pins.txt -r /tmp/requirements-gpu.txt \
        "megatron-core==${MEGATRON_CORE_VERSION}" "wandb==${WANDB_VERSION}" \
    && (pip check || echo "warning: pip check lists conflicts (above); the base image may already carry some")

FROM deps AS release
COPY . /workspace/omni-mpo
# Import check of every GPU dependency (no GPU is needed to import), and proof that torch is still the container's.
RUN python - <<'PY'
import importlib.metadata as md
frozen = dict(line.strip().split("==", 1) for line in open("/opt/ngc-frozen.txt") if line.strip())
for name, version in frozen.items():
    assert md.version(name) == version, f"{name} changed: {md.version(name)} != {version}"
import torch
assert torch.version.cuda is not None, "torch is a CPU build"
import transformer_engine.pytorch
import causal_conv1d
import mamba_ssm
from mamba_ssm.ops.triton.ssd_combined import mamba_chunk_scan_combined
import megatron.core
from megatron.core.extensions.transformer_engine import TELayerNormColumnParallelLinear
from megatron.core.ssm.mamba_mixer import MambaMixer
import transformers, safetensors, torchvision, wandb, PIL
import megatron_patches
megatron_patches.check_megatron_core_version()  # MEGATRON_CORE_VERSION must be the release megatron_patches was checked on
import omni_model  # megatron-core imports at the top of the model file, before any shim is applied
print("torch", torch.__version__, "CUDA", torch.version.cuda, "| transformer-engine", md.version("transformer_engine"),
      "| megatron-core", megatron.core.__version__, "| mamba-ssm", md.version("mamba_ssm"),
      "| causal-conv1d", md.version("causal_conv1d"), "| transformers", transformers.__version__,
      "| wandb", wandb.__version__)
PY
CMD ["bash"]
