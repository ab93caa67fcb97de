# dflash-trt build image: runs `dflash-trt build` (resolve, quantize, verify, compile, emit) on a
# GPU box or as the Kubernetes build Job (docker/k8s/build-job.yaml).
#
# Base: the NGC TensorRT-LLM release image, pinned by tag. 1.3.0rc27 is the TensorRT-LLM version
# dflash-trt's LLM API option list was taken from (toolkit/dflash_trt/engines/
# trtllm_llm_api_options.yaml, `container:`); its tensorrt_llm has DFlashDecodingConfig and it ships
# torch, transformers and nvidia-modelopt, so dflash-trt is installed without the torch extra (which
# would replace the container's CUDA torch with a pinned CPU-era one).
#
#   docker build -f docker/build.Dockerfile -t dflash-trt-build:0.1.0 .
#   docker run --gpus all --shm-size=16g -v $PWD:/workspace dflash-trt-build:0.1.0 \
#       build /workspace/recipes/qwen3-8b-nvfp4-b200.yaml
FROM nvcr.io/nvidia/tensorrt-llm/release:1.3.0rc27

# Fail the image build, not the first model load, if the base lacks DFlash.
RUN python3 -c "from tensorrt_llm.llmapi import DFlashDecodingConfig"

WORKDIR /opt/dflash-trt
COPY pyproject.toml README.md ./
COPY toolkit/ toolkit/
COPY plugins/ plugins/
COPY triton_repo/ triton_repo/
COPY recipes/ recipes/
RUN pip install --no-cache-dir . "tritonclient[grpc]==2.73.0" "gguf==0.17.1" \
    && useradd --create-home --uid 1000 dflash \
    && mkdir -p /workspace \
    && chown dflash:dflash /workspace

USER 1000
WORKDIR /workspace
ENTRYPOINT ["dflash-trt"]
CMD ["--help"]
