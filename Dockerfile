# GPU image: NGC PyTorch base + vLLM + Transformer Engine + NVIDIA apex + HybridFlow.
# The pins below must agree with setup.py (tests/test_packaging.py checks it; docker cannot run on our CI).
FROM nvcr.io/nvidia/pytorch:25.10-py3

ENV PIP_NO_CACHE_DIR=1 \
    RAY_USAGE_STATS_ENABLED=0 \
    TOKENIZERS_PARALLELISM=false

# vLLM pins torch==2.13.0 and transformers>=5.16.1,<5.20; install it first so the rest resolves against it.
RUN pip install "torch==2.13.0" "vllm==0.32.0" "transformers>=5.16.1,<5.20"

RUN pip install "megatron-core==0.16.1" "ray[default,tune]==2.60.0" prometheus-client safetensors pyarrow pandas omegaconf psutil tqdm \
        tensorboard matplotlib wandb mlflow-skinny

# Transformer Engine (PyTorch flavour) for the TE layer spec; optional on CPU, used when CUDA is present.
RUN pip install --no-build-isolation "transformer-engine[pytorch]"

# NVIDIA apex (fused kernels). The PyPI package named "apex" is unrelated, so build from source.
RUN git clone --depth 1 https://github.com/NVIDIA/apex /opt/apex && cd /opt/apex && \
    pip install -v --no-build-isolation --config-settings "--build-option=--cpp_ext" \
        --config-settings "--build-option=--cuda_ext" . && rm -rf /opt/apex

WORKDIR /opt/hybridflow
COPY . .
RUN pip install --no-deps -e .

CMD ["python", "-m", "hybridflow.trainer.main", "--help"]
