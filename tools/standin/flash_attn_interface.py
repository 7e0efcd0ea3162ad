# SDPA stand-in for FlashAttention-3 (not available on the device), for fetched reference scripts: put this
# folder on PYTHONPATH. Never beside train_gpt.py or a tool: ATTN_BACKEND=auto would pick it as fa3.
# (B,T,H,D) in and out, causal, GQA through SDPA's enable_gqa; the reference pins SDPA to flash.
import torch.nn.functional as F
def flash_attn_func(q, k, v, causal=True):
    y = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=causal, enable_gqa=True)
    return y.transpose(1, 2)
