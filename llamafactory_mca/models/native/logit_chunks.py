"""When the loss runs the output layer a chunk of rows at a time (``chunked_cross_entropy``), and how big a chunk
is: read by the loss (``cross_entropy.py``) and by the planner's memory estimate alike. Imports nothing heavy."""

CHUNK_ROWS = 4096  # 4,096 x 151,936 bf16 logits: 1.2 GB per chunk
AUTO_LOGITS_BYTES = 4 << 30


def native_loss(config: object) -> bool:
    """Whether the language-model loss is ours (``cross_entropy.py``) rather than Megatron's: ``native_cross_entropy:
    false`` in the recipe, or Megatron's fused kernels (``cross_entropy_loss_fusion``), give it back to Megatron."""
    return getattr(config, "native_cross_entropy", True) is not False and \
        not getattr(config, "cross_entropy_loss_fusion", False)


def chunks_logits(tokens: int, local_vocab: int, setting: bool | None) -> bool:
    """As the recipe says, else when a micro-batch's bf16 logits on this rank would pass 4 GiB (32k tokens of a
    151,936 vocabulary: 9.3 GiB, with their gradient as much again). Below that, one GEMM for the logits beats
    recomputing each chunk's in the backward (a third more output-layer FLOPs)."""
    return setting if setting is not None else tokens * local_vocab * 2 > AUTO_LOGITS_BYTES


def logit_rows(tokens: int, local_vocab: int, setting: bool | None) -> int:
    """Rows of logits held at once."""
    return min(tokens, CHUNK_ROWS) if chunks_logits(tokens, local_vocab, setting) else tokens


def describe(tokens: int, local_vocab: int, native: bool, setting: bool | None) -> str:
    """The startup summary's word on the loss, for a micro-batch of ``tokens`` per rank."""
    if not native:
        return "loss: Megatron's cross-entropy (fp32 logits)"
    if chunks_logits(tokens, local_vocab, setting):
        return (f"loss: output layer and cross-entropy fused, {CHUNK_ROWS:,} tokens with a target at a time (no full "
                "logits; chunked_cross_entropy: false turns it off)")
    return "loss: cross-entropy over the bf16 logits of the tokens with a target (no others are computed)"
