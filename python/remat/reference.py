"""Plain-PyTorch references, shared by the tests and the benchmarks. Tests run them in float64
on the CPU (DESIGN.md section 7)."""

import torch


def rms_norm_reference(x, weight=None, eps=1e-6, residual=None):
    """RMSNorm over the last dim in x's dtype; returns y, or (y, h) with a residual."""
    h = x + residual if residual is not None else x
    y = h * torch.rsqrt(h.square().mean(dim=-1, keepdim=True) + eps)
    if weight is not None:
        y = y * weight
    return (y, h) if residual is not None else y


def layer_norm_reference(x, weight=None, bias=None, eps=1e-5, residual=None):
    """LayerNorm over the last dim (biased variance) in x's dtype; returns y, or (y, h)."""
    h = x + residual if residual is not None else x
    centered = h - h.mean(dim=-1, keepdim=True)
    y = centered * torch.rsqrt(centered.square().mean(dim=-1, keepdim=True) + eps)
    if weight is not None:
        y = y * weight
    if bias is not None:
        y = y + bias
    return (y, h) if residual is not None else y


def stock_rms_norm(x, weight=None, eps=1e-6, residual=None):
    """What a user runs today: torch.nn.functional.rms_norm in x's dtype."""
    h = x + residual if residual is not None else x
    y = torch.nn.functional.rms_norm(h, (h.shape[-1],), weight, eps)
    return (y, h) if residual is not None else y


def stock_layer_norm(x, weight=None, bias=None, eps=1e-5, residual=None):
    """What a user runs today: torch.nn.functional.layer_norm in x's dtype."""
    h = x + residual if residual is not None else x
    y = torch.nn.functional.layer_norm(h, (h.shape[-1],), weight, bias, eps)
    return (y, h) if residual is not None else y


_PHILOX_ROUND_A, _PHILOX_ROUND_B = 0xD2511F53, 0xCD9E8D57
_PHILOX_KEY_A, _PHILOX_KEY_B = 0x9E3779B9, 0xBB67AE85
_LOW32 = 0xFFFFFFFF


def _mul_u32(a, b):
    """(high, low) 32-bit words of a * b for uint32 values held in int64 tensors, without int64
    overflow: b is split into 16-bit halves, so every partial product stays below 2^48."""
    low_product = a * (b & 0xFFFF)
    high_product = a * (b >> 16)
    high = (high_product + (low_product >> 16)) >> 16
    low = (((high_product & 0xFFFF) << 16) + low_product) & _LOW32
    return high, low


def philox_words(seed, counters):
    """The four output words of Philox4x32-10 for each 64-bit counter under the 64-bit key
    ``seed``: the stream of Triton's ``tl.randint4x(seed, offset)`` with int64 offsets and of
    csrc/common/philox.h (key = (seed low, seed high), counter = (counter low, counter high, 0,
    0)). seed: int or int64 tensor (0-dim); counters: int64 tensor (on any device). Returns int64
    values in [0, 2^32), shape counters.shape + (4,)."""
    c0, c1 = counters & _LOW32, (counters >> 32) & _LOW32
    c2 = torch.zeros_like(c0)
    c3 = torch.zeros_like(c0)
    k0, k1 = seed & _LOW32, (seed >> 32) & _LOW32
    for _ in range(10):
        high_b, low_b = _mul_u32(c2, _PHILOX_ROUND_B)
        high_a, low_a = _mul_u32(c0, _PHILOX_ROUND_A)
        c0, c1, c2, c3 = high_b ^ c1 ^ k0, low_b, high_a ^ c3 ^ k1, low_a
        k0 = (k0 + _PHILOX_KEY_A) & _LOW32
        k1 = (k1 + _PHILOX_KEY_B) & _LOW32
    return torch.stack((c0, c1, c2, c3), dim=-1)


def philox_randint(seed, counters):
    """First word of Philox4x32-10 for each 64-bit counter (``tl.randint``): philox_words(...)[..., 0]."""
    return philox_words(seed, counters)[..., 0]


def philox_uniform(words):
    """Triton's uint_to_uniform_float: uint32 words (int64 tensor) to fp32 uniforms in [0, 1)."""
    x = torch.where(words >= 2**31, words - 2**32, words)
    x = torch.where(x < 0, -x - 1, x)
    return x.to(torch.float32) * torch.tensor(4.6566127342e-10, dtype=torch.float32, device=words.device)


def philox_stream_words(seed, offset, rows, cols, row_length):
    """The uint32 word (int64 tensor) that remat's dropout stream gives element (row, col).

    The stream keyed by (seed, offset) is read in rows of ``row_length`` elements, four elements
    per Philox call: element (r, j) takes word j % 4 of Philox4x32-10 at counter
    offset + r * ceil(row_length / 4) + j // 4. Every backend draws one call per four elements of
    a row (all four words) and gets the same bits. Flat dropout of n elements is one row of
    length n (counter offset + i // 4, word i % 4); attention row (b, h, i) of the [B, Hq, N, M]
    probabilities is row (b * Hq + h) * N + i of length M. seed, offset: ints or int64 0-dim
    tensors; rows, cols: int64 tensors that broadcast together."""
    groups = (row_length + 3) // 4
    words = philox_words(seed, offset + rows * groups + cols // 4)
    return torch.gather(words, -1, (cols % 4).expand(words.shape[:-1]).unsqueeze(-1)).squeeze(-1)


def dropout_keep(seed, offset, n, p, device="cpu"):
    """Keep mask (bool [n]) of flat Philox dropout with probability p over n elements: element i
    is kept when the uniform of its stream word (one row of length n, philox_stream_words) is at
    least p."""
    index = torch.arange(n, dtype=torch.int64, device=torch.device(device))
    return philox_uniform(philox_stream_words(seed, offset, torch.zeros_like(index), index, n)) >= p


def attention_dropout_keep(seed, offset, shape, p, device="cpu", rows=None):
    """The keep mask (bool [B, Hq, N, M] for ``shape`` = (B, Hq, N, M)) of attention dropout with
    probability p: element (b, h, i, j) is kept when the uniform of stream word (row
    (b*Hq + h)*N + i, column j) of rows of length M (philox_stream_words) is at least p.
    ``rows=(i0, i1)`` returns only query rows i0 .. i1 - 1. seed and offset: ints or int64 0-dim
    tensors (read on their device)."""
    batch, heads, n, m = shape
    i0, i1 = rows if rows is not None else (0, n)
    device = torch.device(device)
    row = torch.arange(batch * heads, dtype=torch.int64, device=device)[:, None, None] * n
    row = row + torch.arange(i0, i1, dtype=torch.int64, device=device)[None, :, None]
    col = torch.arange(m, dtype=torch.int64, device=device)[None, None, :]
    keep = philox_uniform(philox_stream_words(seed, offset, row, col, m)) >= p
    return keep.reshape(batch, heads, i1 - i0, m)


def _rope_reference(x, cos, sin, first_position):
    """Rotate-half rotary embedding of x [B, L, H, D] with cos/sin [S, D/2] or [B, S, D/2] at
    positions first_position .. first_position + L - 1, in x's dtype."""
    length, half = x.shape[1], x.shape[-1] // 2
    cos = cos.to(x.dtype)[..., first_position : first_position + length, :half]
    sin = sin.to(x.dtype)[..., first_position : first_position + length, :half]
    if cos.dim() == 2:
        cos, sin = cos[None], sin[None]
    cos, sin = cos[:, :, None, :], sin[:, :, None, :]
    x1, x2 = x[..., :half], x[..., half:]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)


def attention_reference(q, k, v, *, causal=False, scale=None, keep=None, dropout_p=0.0, rope=None,
                        window=None, softcap=None):
    """Eager attention in q's dtype, materialising the [B, Hq, N, M] probabilities: the float64
    reference of the tests and, in a low-precision dtype, the stock computation a user runs today
    (softmax in fp32 then cast, as Hugging Face's eager attention does).

    q [B, N, Hq, D]; k, v [B, M, Hkv, D]; Hq a multiple of Hkv. Query i sits at position
    i + M - N (bottom-right alignment); ``causal`` and ``window=(left, right)`` (None = unbounded)
    restrict the keys it sees. ``keep`` is the dropout keep mask [B, Hq, N, M] (kept values are
    scaled by 1 / (1 - dropout_p)). ``rope=(cos, sin)`` rotates q at positions M - N .. M - 1 and k
    at 0 .. M - 1. Rows that see no key give 0. Returns o [B, N, Hq, D].
    """
    batch, n, hq, d = q.shape
    m, hkv = k.shape[1], k.shape[2]
    scale = d**-0.5 if scale is None else scale
    if rope is not None:
        q = _rope_reference(q, rope[0], rope[1], m - n)
        k = _rope_reference(k, rope[0], rope[1], 0)
    group = hq // hkv
    qh = q.transpose(1, 2)
    kh = k.transpose(1, 2).repeat_interleave(group, dim=1)
    vh = v.transpose(1, 2).repeat_interleave(group, dim=1)
    logits = torch.matmul(qh, kh.transpose(-1, -2)) * scale
    if softcap:
        logits = softcap * torch.tanh(logits / softcap)
    rows = torch.arange(n, device=q.device)[:, None] + (m - n)
    cols = torch.arange(m, device=q.device)[None, :]
    visible = torch.ones(n, m, dtype=torch.bool, device=q.device)
    left, right = window if window is not None else (None, None)
    if causal:
        right = 0 if right is None else min(right, 0)
    if left is not None:
        visible &= cols >= rows - left
    if right is not None:
        visible &= cols <= rows + right
    logits = logits.masked_fill(~visible, float("-inf"))
    probs = torch.softmax(logits, dim=-1, dtype=torch.float32 if q.dtype != torch.float64 else None)
    probs = torch.nan_to_num(probs, nan=0.0).to(q.dtype)
    if keep is not None:
        probs = probs * keep.to(q.dtype) / (1.0 - dropout_p)
    return torch.matmul(probs, vh).transpose(1, 2)


def attention_varlen_reference(q, k, v, cu_seqlens_q, cu_seqlens_k, *, causal=False, scale=None, keeps=None,
                               dropout_p=0.0, rope=None, window=None, softcap=None):
    """Packed attention as :func:`attention_reference` on each sequence alone, in q's dtype.

    q [total_q, Hq, D], k, v [total_k, Hkv, D]; cu_seqlens_q / cu_seqlens_k: the [S + 1] offsets
    (any integer tensors or lists). rope: 2-D tables [S_rows, D/2|D] restart positions per
    sequence; per-token tables [1, T, D/2|D] give sequence s the rows from cu_seqlens_k[s] on.
    keeps: None or one dropout keep mask [1, Hq, N_s, M_s] per sequence. Zero-length sequences
    give nothing (a query with no key gives 0). Returns o [total_q, Hq, D]."""
    offsets_q, offsets_k = [int(x) for x in cu_seqlens_q], [int(x) for x in cu_seqlens_k]
    outputs = []
    for s in range(len(offsets_q) - 1):
        q0, q1, k0, k1 = offsets_q[s], offsets_q[s + 1], offsets_k[s], offsets_k[s + 1]
        if q1 == q0:
            continue
        if k1 == k0:
            outputs.append(torch.zeros_like(q[q0:q1]))
            continue
        sequence_rope = None
        if rope is not None:
            sequence_rope = rope if rope[0].dim() == 2 else tuple(t[0, k0:] for t in rope)
        o = attention_reference(q[None, q0:q1], k[None, k0:k1], v[None, k0:k1], causal=causal, scale=scale,
                                keep=None if keeps is None else keeps[s], dropout_p=dropout_p, rope=sequence_rope,
                                window=window, softcap=softcap)
        outputs.append(o[0])
    return torch.cat(outputs) if outputs else torch.zeros_like(q)
