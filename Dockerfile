# NGC's PyTorch image brings Transformer Engine and flash-attn, so the TE layer spec is picked up automatically.
# Not built in CI (no Docker engine there); the pip install line is the same one CI runs.
FROM nvcr.io/nvidia/pytorch:25.10-py3

WORKDIR /opt/llamafactory-mca
COPY . .
RUN pip install --no-cache-dir -e . \
    && llamafactory-mca version

# Every `llamafactory-cli train` in this image uses the Megatron-Core backend.
ENV USE_MCA=1
CMD ["llamafactory-mca", "demo"]
