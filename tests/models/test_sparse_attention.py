"""The lightning indexer's choice among keys of equal score (GLM-5's sparse attention): the earlier keys, however long
the tensor it ranks (a padded row or a packed document), where torch.topk's choice among ties depends on that length.
The rest of the sparse attention is held against transformers in test_bridge (logits in every layout), test_lora
and test_training (sft packed and padded against LLaMA-Factory)."""

from types import SimpleNamespace

import torch


def test_equal_scores_choose_the_earlier_keys():
    from llamafactory_mca.models.native.sparse_attention import LightningIndexer

    config = SimpleNamespace(dsa_indexer_n_heads=4, dsa_indexer_head_dim=8, qk_pos_emb_head_dim=4, dsa_indexer_topk=3,
                             rotary_base=10000.0, q_lora_rank=12, hidden_size=16, use_cpu_initialization=True,
                             params_dtype=torch.float32)
    indexer = LightningIndexer(config)
    assert not any(p.requires_grad for p in indexer.parameters())  # frozen, as transformers runs it
    with torch.no_grad():
        for p in indexer.parameters():
            p.zero_()  # every key scores 0
    for length in (7, 40):
        x, qr = torch.randn(length, 16), torch.randn(length, 12)
        q, k, weights = indexer.queries_keys(x, qr, torch.arange(length))
        chosen = indexer.select(q, k, weights, slice(4, length))
        assert chosen.tolist() == [[0, 1, 2]] * (length - 4), chosen


def test_long_sequences_in_recomputed_chunks_give_the_same_output_and_gradients(monkeypatch):
    """Queries in chunks (each recomputed in the backward) where the scores of a whole sequence would be too large:
    the same output and gradients as one pass, padded and packed; and the first ``index_topk`` queries of a sequence
    (dense attention) are those of attention under the causal mask alone."""
    from megatron.core.packed_seq_params import PackedSeqParams
    from megatron.core.transformer.enums import AttnMaskType
    from megatron.core.transformer.transformer_config import MLATransformerConfig

    from llamafactory_mca.models.native import sparse_attention

    config = MLATransformerConfig(num_layers=1, hidden_size=16, num_attention_heads=3, q_lora_rank=12, kv_lora_rank=8,
                                  qk_head_dim=6, qk_pos_emb_head_dim=4, v_head_dim=6,
                                  experimental_attention_variant="dsa", dsa_indexer_n_heads=4, dsa_indexer_head_dim=8,
                                  dsa_indexer_topk=5, rotary_base=10000.0, use_cpu_initialization=True,
                                  attention_dropout=0.0)
    torch.manual_seed(0)
    attention = sparse_attention.NativeSparseAttention(config, 1, AttnMaskType.causal, "self", softmax_scale=0.3,
                                                       pg_collection=SimpleNamespace(tp=None, cp=None))
    with torch.no_grad():
        for p in attention.parameters():
            p.normal_()
    cu = torch.tensor([0, 19, 30], dtype=torch.int32)
    packed = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=19, max_seqlen_kv=19)
    cases = {"padded": ((30, 2, 3), (30, 2, 16), (30, 2, 12), None),  # 2 rows of 30 tokens, 3 heads
             "packed": ((30, 3), (30, 1, 16), (30, 12), packed)}  # sequences of 19 and 11 tokens
    for name, (heads_shape, x_shape, qr_shape, params) in cases.items():
        q, k, v = (torch.randn(*heads_shape, d, requires_grad=True) for d in (10, 10, 6))
        x, qr = torch.randn(x_shape), torch.randn(qr_shape)
        runs = []
        # one pass; 3 query rows per chunk; attention chunks of 8 rows (as on a GPU) over indexer chunks of 3
        for budget, fused in ((sparse_attention._SCORE_BYTES, False), (4 * 30 * 4 * 3, False), (4 * 30 * 4 * 3, True)):
            monkeypatch.setattr(sparse_attention, "_SCORE_BYTES", budget)
            monkeypatch.setattr(sparse_attention, "_MASK_BYTES", 2 * 30 * 8)
            monkeypatch.setattr(sparse_attention, "_fused_sdpa", lambda q: fused)
            out = attention(q, k, v, None, x, qr, packed_seq_params=params)
            grads = torch.autograd.grad((out * torch.linspace(-1, 1, out.numel()).view_as(out)).sum(), (q, k, v))
            runs.append((out, *grads))
        for one, *chunked in zip(*runs):
            assert all(torch.allclose(one, other, atol=1e-6) for other in chunked), name
        causal = torch.nn.functional.scaled_dot_product_attention(
            *(t[:5].transpose(0, 1) if params else t[:5, 0].transpose(0, 1) for t in (q, k, v)), is_causal=True,
            scale=0.3).transpose(0, 1).flatten(1)
        assert torch.allclose(runs[0][0][:5] if params else runs[0][0][:5, 0], causal, atol=1e-6), name
