"""Where transformers' own model is not a reference as LLaMA-Factory's default path loads it: the tests' reference
logits and losses and the benchmarks' LLaMA-Factory runs take transformers' eager attention for these model types.
Imports nothing (the benchmarks read it inside LLaMA-Factory's own runs, whose start-up they time)."""

# model_type -> why its default attention does not serve
EAGER_REFERENCE = {
    "gpt_oss": "LLaMA-Factory's default path loads a FlashAttention-3 kernel from the hub (no network on the test "
               "machines, no such kernel on CPUs); eager attention has the sinks",
    "glm_moe_dsa": "transformers' SDPA path drops the causal mask on rows without padding (its sparse-attention mask "
                   "replaces SDPA's is_causal), so a query sees later tokens",
}
