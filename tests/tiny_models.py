"""A tiny config.json of every model family fourfold implements (two layers; MoE: 4 experts, top-2),
for the sweeps that run each family on every grid form the rules accept."""

COMMON = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, vocab_size=64,
              max_position_embeddings=64, tie_word_embeddings=False)
MIXTURE = dict(num_experts_per_tok=2, output_router_logits=True, router_aux_loss_coef=0.02)
TINY = {
    "llama": dict(COMMON, model_type="llama", intermediate_size=48),
    "gpt2": dict(model_type="gpt2", n_embd=32, n_layer=2, n_head=4, vocab_size=64, n_positions=64),  # tied
    "qwen3": dict(COMMON, model_type="qwen3", head_dim=8, intermediate_size=48),
    "gemma3": dict(COMMON, model_type="gemma3_text", head_dim=8, intermediate_size=48, sliding_window=3,
                   layer_types=["sliding_attention", "full_attention"], tie_word_embeddings=True),
    "mixtral": dict(COMMON, **MIXTURE, model_type="mixtral", num_local_experts=4, intermediate_size=16),
    "qwen2_moe": dict(COMMON, **MIXTURE, model_type="qwen2_moe", num_experts=4, moe_intermediate_size=16,
                      shared_expert_intermediate_size=24, intermediate_size=48),
    "qwen3_moe": dict(COMMON, **MIXTURE, model_type="qwen3_moe", head_dim=8, num_experts=4, moe_intermediate_size=16,
                      norm_topk_prob=True),
    "olmoe": dict(COMMON, **MIXTURE, model_type="olmoe", intermediate_size=16, num_experts=4),
    "gpt_oss": dict(COMMON, **MIXTURE, model_type="gpt_oss", head_dim=8, intermediate_size=16, num_local_experts=4,
                    sliding_window=3),
    "deepseek_v3": dict(COMMON, model_type="deepseek_v3", num_key_value_heads=4, intermediate_size=48,
                        moe_intermediate_size=16, n_routed_experts=4, n_shared_experts=1, num_experts_per_tok=2,
                        n_group=2, topk_group=1, first_k_dense_replace=1, q_lora_rank=24, kv_lora_rank=16,
                        qk_nope_head_dim=8, qk_rope_head_dim=8, v_head_dim=8),
}
