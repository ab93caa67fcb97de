# dflash-trt serving image: Triton Inference Server with the TensorRT-LLM Python backend, serving a
# model repository built by `dflash-trt build` (build/<name>/triton_repo, self-contained: the
# engine directory and its checkpoints live inside it).
#
# Base: NGC Triton with TensorRT-LLM (the `-trtllm-python-py3` flavour), pinned by tag. The image
# build checks that its tensorrt_llm has DFlashDecodingConfig (TensorRT-LLM >= 1.3.0rc27) and stops
# if not: pick a newer Triton tag then (TRITON_TAG).
#
#   docker build -f docker/serve.Dockerfile \
#       --build-arg MODEL_REPO=build/qwen3-8b-nvfp4-b200/triton_repo -t dflash-trt-serve:0.1.0 .
#   docker run --gpus all --shm-size=2g -p 8000:8000 -p 8001:8001 -p 8002:8002 dflash-trt-serve:0.1.0
#
# On Kubernetes the same image serves the repository the build Job wrote to the shared volume,
# mounted over /models (docker/k8s/deployment.yaml), so a rebuild needs no new image.
ARG TRITON_TAG=26.10-trtllm-python-py3
FROM nvcr.io/nvidia/tritonserver:${TRITON_TAG}

ARG MODEL_REPO=build/qwen3-8b-nvfp4-b200/triton_repo

RUN python3 -c "from tensorrt_llm.llmapi import DFlashDecodingConfig"

WORKDIR /opt/dflash-trt
COPY pyproject.toml README.md ./
COPY toolkit/ toolkit/
COPY plugins/ plugins/
COPY triton_repo/ triton_repo/
# Core package only: the Triton model needs dflash_trt's engine adapter, not torch extras.
RUN pip install --no-cache-dir .

COPY --chown=1000:1000 ${MODEL_REPO} /models

# The NGC Triton images ship the unprivileged user triton-server (uid 1000).
USER 1000
EXPOSE 8000 8001 8002
HEALTHCHECK --interval=30s --timeout=5s --start-period=600s --retries=3 \
    CMD ["python3", "-c", "import urllib.request; urllib.request.urlopen('http://127.0.0.1:8000/v2/health/ready', timeout=4)"]
ENTRYPOINT ["tritonserver"]
CMD ["--model-repository=/models", "--http-port=8000", "--grpc-port=8001", "--metrics-port=8002", "--exit-timeout-secs=60"]
