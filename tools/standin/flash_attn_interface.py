# SDPA stand-in for FlashAttention-3 (not available on the device): put this folder on PYTHONPATH, for fetched
# reference scripts and for tests of our FA3 calls. Never beside train_gpt.py or a tool: ATTN_BACKEND=auto would pick
# it as fa3. It checks its inputs as FA3's kernels do (layout, dtypes, cu_seqlens) and returns FA3's tuple.
import torch
import torch.nn.functional as F

CALLS = []  # each varlen call's arguments, for tests


def flash_attn_func(q, k, v, causal=True):
    """(B,T,H,D) in and out, causal, GQA through SDPA's enable_gqa; the reference pins SDPA to flash."""
    y = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=causal,
                                       enable_gqa=True)
    return y.transpose(1, 2)


def flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale=None,
                           causal=False, window_size=(-1, -1)):
    """FA3's packed call: q (total, H, D), k and v (total, Hkv, D) with H % Hkv == 0 (GQA, K/V not repeated), int32
    cu_seqlens of the sequences (empty ones allowed), each attended alone. Returns (out, softmax_lse (H, total))."""
    CALLS.append(dict(q=q, k=k, v=v, cu_q=cu_seqlens_q, cu_k=cu_seqlens_k, max_q=max_seqlen_q, max_k=max_seqlen_k,
                      causal=causal))
    assert q.dim() == k.dim() == v.dim() == 3 and q.dtype == k.dtype == v.dtype, "q, k, v: (total, heads, dim)"
    assert q.stride(-1) == k.stride(-1) == v.stride(-1) == 1, "the last dimension must be contiguous"
    assert k.shape == v.shape and q.shape[2] == k.shape[2] and q.shape[1] % k.shape[1] == 0, "GQA: H % Hkv == 0"
    for cu, x, max_len in ((cu_seqlens_q, q, max_seqlen_q), (cu_seqlens_k, k, max_seqlen_k)):
        assert cu.dtype == torch.int32 and cu.dim() == 1 and cu.is_contiguous() and cu.device == x.device
        lengths = cu[1:] - cu[:-1]
        assert int(cu[0]) == 0 and int(cu[-1]) == x.shape[0] and bool((lengths >= 0).all())
        assert int(lengths.max()) <= max_len, "max_seqlen below a sequence's length"
    out = torch.zeros_like(q)
    lse = torch.zeros(q.shape[1], q.shape[0], dtype=torch.float32, device=q.device)
    for a, b in zip(cu_seqlens_q.tolist(), cu_seqlens_q[1:].tolist()):
        if b > a:
            t = [x[a:b].transpose(0, 1)[None] for x in (q, k, v)]
            out[a:b] = F.scaled_dot_product_attention(*t, is_causal=causal, scale=softmax_scale,
                                                      enable_gqa=True)[0].transpose(0, 1)
    return out, lse
