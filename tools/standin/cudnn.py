# SDPA stand-in for nvidia-cudnn-frontend's torch op `cudnn.sdpa_torch` (ATTN_BACKEND=cudnn_fe), for tests of our
# call. It checks its inputs as the op's varlen path takes them (packed (T, H, D), int32 cu_seqlens, GQA unrepeated)
# and returns (out, lse) as it does with return_lse=True.
import torch
import torch.nn.functional as F

CALLS = []  # each call's arguments, for tests


def sdpa_torch(q, k, v, *, is_causal=False, cu_seqlens_q=None, cu_seqlens_kv=None, max_seqlen_q=None,
               max_seqlen_kv=None, return_lse=False):
    CALLS.append(dict(q=q, k=k, v=v, causal=is_causal, cu_q=cu_seqlens_q, cu_k=cu_seqlens_kv, max_q=max_seqlen_q,
                      max_k=max_seqlen_kv, return_lse=return_lse))
    assert q.dim() == k.dim() == v.dim() == 3 and q.dtype == k.dtype == v.dtype, "q, k, v: (total, heads, dim)"
    assert q.is_contiguous() and k.is_contiguous() and v.is_contiguous(), "packed: ragged offsets are cu_seqlens x H x D"
    assert k.shape == v.shape and q.shape[2] == k.shape[2] and q.shape[1] % k.shape[1] == 0, "GQA: H % Hkv == 0"
    for cu, x, max_len in ((cu_seqlens_q, q, max_seqlen_q), (cu_seqlens_kv, k, max_seqlen_kv)):
        assert cu.dtype == torch.int32 and cu.dim() == 1 and cu.device == x.device
        lengths = cu[1:] - cu[:-1]
        assert int(cu[0]) == 0 and int(cu[-1]) == x.shape[0] and bool((lengths >= 0).all())
        assert int(lengths.max()) <= max_len, "max_seqlen below a sequence's length"
    out = torch.zeros_like(q)
    for a, b in zip(cu_seqlens_q.tolist(), cu_seqlens_q[1:].tolist()):
        if b > a:
            t = [x[a:b].transpose(0, 1)[None] for x in (q, k, v)]
            out[a:b] = F.scaled_dot_product_attention(*t, is_causal=is_causal, enable_gqa=True)[0].transpose(0, 1)
    lse = torch.zeros(q.shape[0], q.shape[1], 1, dtype=torch.float32, device=q.device)
    return (out, lse) if return_lse else out
