"""A tiny llama GGUF file written from a tiny random transformers model (no hub, no converter), for the GGUF tests.

llama.cpp's llama architecture stores the q/k projections with each head's rotary halves interleaved (the layout of
Meta's original checkpoints); transformers' GGUF loader undoes it, so the writer applies it."""

from __future__ import annotations

import numpy as np


def interleave_heads(w: np.ndarray, n_head: int) -> np.ndarray:
    """[n_head * d, in] in transformers' rotate-half layout -> the interleaved layout llama GGUFs keep: within a
    head, output rows (0, d/2, 1, d/2 + 1, ...)."""
    d = w.shape[0] // n_head
    return w.reshape(n_head, 2, d // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def write_llama_gguf(model, path, name: str = "tiny") -> str:
    """Write `model` (a LlamaForCausalLM) as a float32 GGUF of architecture llama."""
    import gguf

    c = model.config
    arch = "llama"
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    w = gguf.GGUFWriter(str(path), arch)
    w.add_name(name)
    w.add_block_count(c.num_hidden_layers)
    w.add_context_length(c.max_position_embeddings)
    w.add_embedding_length(c.hidden_size)
    w.add_feed_forward_length(c.intermediate_size)
    w.add_head_count(c.num_attention_heads)
    w.add_head_count_kv(c.num_key_value_heads)
    w.add_rope_freq_base(float(c.rope_parameters["rope_theta"]))
    w.add_rope_dimension_count(head_dim)
    w.add_layer_norm_rms_eps(c.rms_norm_eps)
    w.add_vocab_size(c.vocab_size)
    w.add_file_type(gguf.LlamaFileType.ALL_F32)
    sd = {k: v.detach().float().numpy() for k, v in model.state_dict().items()}
    names = {"self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
             "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
             "mlp.down_proj": "ffn_down", "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm"}
    w.add_tensor("token_embd.weight", sd["model.embed_tokens.weight"])
    for i in range(c.num_hidden_layers):
        for hf, gg in names.items():
            t = sd[f"model.layers.{i}.{hf}.weight"]
            if gg == "attn_q":
                t = interleave_heads(t, c.num_attention_heads)
            elif gg == "attn_k":
                t = interleave_heads(t, c.num_key_value_heads)
            w.add_tensor(f"blk.{i}.{gg}.weight", np.ascontiguousarray(t))
    w.add_tensor("output_norm.weight", sd["model.norm.weight"])
    w.add_tensor("output.weight", sd["lm_head.weight"])
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return str(path)
