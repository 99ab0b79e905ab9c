# loraplex: the OpenAI-compatible multi-tenant server (`loraplex serve`), embedded model included.
#
#   docker build -t loraplex .                                   # CPU image (default)
#   docker build -t loraplex:cuda --build-arg VARIANT=cuda .     # CUDA image (bf16 on the GPU)
#   docker run -p 8000:8000 -v loraplex-data:/data loraplex      # add --gpus all for CUDA
#
# The first start prints the admin token once (`docker logs`), or set LORAPLEX_ADMIN_TOKEN.
# Every `loraplex serve` flag is also an environment variable (LORAPLEX_<FLAG>); arguments
# after the image name replace the default ones, e.g. `docker run ... loraplex --demo`.
# docker/install.sh is the install step; tests/test_docker_install.py runs it and the start
# command below in a clean virtual environment.

ARG VARIANT=cpu

FROM python:3.11-slim-bookworm AS base-cpu
# gcc builds the native CPU kernels (again at the first start if the CPU differs from the
# builder's: they are compiled for the CPU they run on).
RUN apt-get update && apt-get install -y --no-install-recommends gcc libc6-dev \
    && rm -rf /var/lib/apt/lists/*
ENV LORAPLEX_TORCH_INDEX=https://download.pytorch.org/whl/cpu

FROM nvidia/cuda:12.8.1-runtime-ubuntu24.04 AS base-cuda
RUN apt-get update && apt-get install -y --no-install-recommends \
        python3 python3-venv gcc libc6-dev \
    && rm -rf /var/lib/apt/lists/*
# PyPI's torch wheels are CUDA builds.
ENV LORAPLEX_TORCH_INDEX=

FROM base-${VARIANT}
ARG LORAPLEX_TORCH=torch==2.13.0
ENV LORAPLEX_TORCH=${LORAPLEX_TORCH} \
    PIP_NO_CACHE_DIR=1 \
    LORAPLEX_CACHE_DIR=/var/cache/loraplex \
    LORAPLEX_DATA_DIR=/data \
    PATH=/opt/loraplex/bin:$PATH \
    PYTHONUNBUFFERED=1 \
    HF_HUB_OFFLINE=1

COPY . /src
RUN sh /src/docker/install.sh /src /opt/loraplex && rm -rf /src
# KServe's LLMInferenceServiceConfig template runs `vllm --version` and `vllm serve ...`: the
# image answers as loraplex, which takes vLLM's serve flags (docs/kubernetes-inference-stack.md).
RUN ln -s loraplex /opt/loraplex/bin/vllm

# The embedded model is converted now (about 40 s), not at the first start; so are the kernels.
RUN loraplex prepare

RUN useradd --system --uid 10001 --home-dir /home/loraplex --create-home loraplex \
    && mkdir -p /data \
    && chown -R loraplex:loraplex /data /var/cache/loraplex \
    && chmod 0700 /data
USER loraplex
VOLUME ["/data"]
EXPOSE 8000

HEALTHCHECK --interval=30s --timeout=5s --start-period=120s --retries=3 \
    CMD ["python3", "-c", "import urllib.request; urllib.request.urlopen('http://127.0.0.1:8000/health', timeout=4)"]

ENTRYPOINT ["loraplex", "serve", "--host", "0.0.0.0"]
CMD []
