# NGC's PyTorch image: torch, Transformer Engine and flash-attn built together for the image's CUDA, so the TE layer
# spec is picked up automatically. That torch must stay: `pip install -e .` would resolve this package's own pins
# (requirements/torch.txt, the torch set CI tests on the package index's wheels) and replace it, and with it break
# every extension built against it. So this follows docs/install.md's "With your own torch": the rest of the stack, then this
# package with --no-deps. Not built in CI (no Docker engine there); tests/test_dockerfile.py checks that no install
# line below can resolve torch.
FROM nvcr.io/nvidia/pytorch:25.10-py3

WORKDIR /opt/llamafactory-mca
COPY . .
# 1. torchaudio, which LLaMA-Factory imports at start-up and NGC's image does not ship: the version CI tests (built for
#    CUDA 13.0, as this image's torch is), with --no-deps so that it cannot bring a torch of its own.
# 2. The image's torch builds written down as constraints. requirements/stack.txt names no torch package, but its
#    packages ask for them: llamafactory (torch, torchvision, torchaudio, torchdata), megatron-core, accelerate and
#    peft (torch). Under these constraints pip keeps the installed builds, or stops with a conflict; it never swaps
#    one in from the index. (NGC's own /etc/pip/constraint.txt, where the image has one, applies as well.)
# 3. The stack at the versions CI tests, under those constraints; this package with --no-deps (its pins name torch).
# 4. `llamafactory-mca version` imports what a run imports: the build fails, naming the package, if torchaudio or
#    anything else does not load beside the image's torch.
RUN (pip show torchaudio > /dev/null 2>&1 \
      || pip install --no-cache-dir --no-deps "$(grep '^torchaudio==' requirements/torch.txt)") \
    && pip list --format=freeze | grep -iE '^(torch|torchvision|torchaudio)==' > /tmp/image-torch.txt \
    && pip install --no-cache-dir -c /tmp/image-torch.txt -r requirements/stack.txt \
    && pip install --no-cache-dir --no-deps -e . \
    && llamafactory-mca version

# Every `llamafactory-cli train` in this image uses the Megatron-Core backend.
ENV USE_MCA=1
CMD ["llamafactory-mca", "demo"]
