"""Public attention functions: flash attention and the pre-norm attention sub-block. Argument
checks and layout, then the autograd Function."""


import torch

from remat import checks
from remat.autograd.attention import AttentionFunction, VarlenAttentionFunction
from remat.autograd.norm_attention import NormAttentionFunction
from remat.autograd.norm_attention_parallel import ParallelNormAttentionFunction
from remat.backend import default_backend
from remat.functional.lora import check_lora
from remat.ops.attention import cpu_flash_attention
from remat.ops.attention_core import choose_core
from remat.options import AttentionOptions, NormAttentionOptions
from remat.sequence_parallel import check_group, check_heads
from remat.tiles import resolve_tile_tokens


def attention(q, k, v, *, causal=False, scale=None, dropout_p=0.0, rope=None, window=None, softcap=None,
              deterministic=None, layout="bnhd", backend=None, cu_seqlens_q=None, cu_seqlens_k=None,
              max_seqlen_q=None, max_seqlen_k=None, empty_queries=None):
    """Flash attention: ``softmax(q k^T * scale) v`` without storing the attention matrix.

    Args:
        q: ``[B, N, Hq, D]`` (``layout="bnhd"``, the default, as flash_attn) or ``[B, Hq, N, D]``
            (``layout="bhnd"``, as ``scaled_dot_product_attention``); float32, float16 or
            bfloat16; any strides (a tensor whose last dim is strided is copied once).
        k, v: ``[B, M, Hkv, D]`` (or ``[B, Hkv, M, D]``) in q's dtype and device; Hq a multiple of
            Hkv (GQA; Hkv = 1 is MQA). N, M >= 0 any length (with N, M or B = 0 no kernel runs: o is
            empty, or 0 without keys, as stock's); D in 1..256 (the cuda backend takes float16/bfloat16
            only).
        causal: mask keys after the query. With N != M the last query is aligned with the last
            key (bottom-right, as FlashAttention >= 2.1): query i sits at position i + M - N.
        scale: logit scale; default ``1 / sqrt(D)``.
        dropout_p: dropout on the probabilities, in [0, 1). Applied whenever > 0 (pass 0.0 in
            eval). The mask is a Philox stream keyed by a (seed, offset) drawn from PyTorch's
            generator, so ``torch.manual_seed`` reproduces it; backward regenerates it. remat's
            kernels (cpp, cuda, triton, torch) all draw remat's stream
            (``remat.reference.attention_dropout_keep``); the aten core on CUDA draws
            FlashAttention-2's own (the mask of ``scaled_dot_product_attention``'s flash backend
            for the same generator state), whose keep probability is quantised to 1/256 while
            kept values are scaled by 1 / (1 - dropout_p) (at 0.1 it keeps 230/256 = 0.898).
        rope: ``(cos, sin)`` rotary tables, ``[S, D/2]`` or ``[B, S, D/2]``, or Hugging Face's
            ``[S, D]`` / ``[B, S, D]`` with equal halves, S >= M; rotate-half convention. k at
            position j uses row j, q row i uses row i + M - N (needs N <= M). Applied inside the
            kernels (the C++ and CUDA ones in forward and again in the backward recompute; the
            Triton forward when no backward can follow) or to q and k once per pass before them
            (the aten and cudnn cores; Triton when a backward can follow); rotated copies are never
            saved.
        window: ``(left, right)`` sliding window: query at position p sees keys p - left .. p +
            right; None on a side is unbounded. Combines with ``causal``.
        softcap: Gemma-2 logit capping, ``softcap * tanh(logits / softcap)``; None (default) off.
        deterministic: True asks for a GPU backward without atomics (bitwise reproducible run to
            run on one GPU); False allows atomics (remat's kernels accumulate dq with fp32
            atomics; FlashAttention-2 likewise), which is faster. None (default): as PyTorch's own
            ops, deterministic exactly when ``torch.use_deterministic_algorithms(True)`` is on.
            The CPU backends are always deterministic.
        layout: ``"bnhd"`` or ``"bhnd"``, for q, k, v and the output.
        backend: ``"aten"``, ``"cudnn"``, ``"cuda"``, ``"cpp"``, ``"triton"``, ``"torch"`` or None:
            the fastest that takes the call (on the CPU the aten core (PyTorch's flash kernel),
            else remat's C++ kernels; on CUDA the cudnn core (cuDNN) where stock PyTorch tries it
            first (sm_90/sm_10x), else the aten core (FlashAttention-2), else remat's Triton
            kernels, else its CUDA kernels; README "Default backends"). See remat.backend.
        cu_seqlens_q, cu_seqlens_k: packed (variable-length) attention, FlashAttention's
            ``flash_attn_varlen_func`` convention: None (default, dense), or both given as int32
            ``[S + 1]`` offsets on q's device, starting at 0, non-decreasing (zero-length sequences
            allowed) and ending at total_q / total_k. q is then ``[total_q, Hq, D]`` and k, v
            ``[total_k, Hkv, D]`` (layout "bnhd" only): sequence s is queries cu_seqlens_q[s] ..
            cu_seqlens_q[s+1] - 1 and keys likewise, and attends only within itself, with
            everything above applied per sequence (causal bottom-right: query i of a sequence of N_s
            queries and M_s keys sits at key position i + M_s - N_s). The offsets are read on the
            host to check them (one sync; under torch.compile an in-graph assert instead).
            rope with offsets: ``[S, D/2]`` / ``[S, D]`` tables restart positions in every
            sequence (key j uses row j, query i row i + M_s - N_s; S >= max_seqlen_k), while
            per-token tables ``[1, total_k, D/2]`` / ``[1, total_k, D]`` give key token t row t and
            query i of sequence s row cu_seqlens_k[s] + i + M_s - N_s; either needs N_s <= M_s.
            Dropout (remat's kernels) draws the Philox stream of the dense call on the zero-padded
            batch ``[S, max_seqlen_q]`` x ``[S, max_seqlen_k]``, so the mask depends on those
            bounds (the aten core: FlashAttention-2's own mask).
        max_seqlen_q, max_seqlen_k: with offsets, upper bounds of the sequence lengths (the
            kernels' grids); None computes them from the offsets (required under torch.compile).
        empty_queries: None (default), or bool ``[B, N]`` (``[total_q]`` with offsets): queries
            that attend to nothing whatever their keys (pads of a padded batch): their output is 0
            and no gradient flows back from it, as PyTorch's SDPA gives a query whose keys are all
            masked. They still run through the kernels (their rows are zeroed after).

    Returns:
        o in q's layout, shape and dtype (a new tensor); ``[total_q, Hq, D]`` with offsets. Rows
        that see no key give 0.

    Saved for backward: q, k, v, o, fp32 logsumexp [B, Hq, N] (``[Hq, total_q]`` with offsets,
    plus the two offset tensors) (and 16 bytes of RNG state with dropout, the cos/sin tables with
    rope); the probabilities are recomputed.
    """
    varlen = (cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k)
    if any(a is not None for a in varlen):
        return _varlen_attention(q, k, v, *varlen, causal=causal, scale=scale, dropout_p=dropout_p, rope=rope,
                                 window=window, softcap=softcap, deterministic=deterministic, layout=layout,
                                 backend=backend, empty_queries=empty_queries)
    checks.check_choice(layout, "layout", checks.ATTENTION_LAYOUTS)
    checks.check_qkv_types(q, k, v, layout)
    if layout == "bhnd":
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))
    checks.check_qkv_shapes(q, k, v, layout)
    checks.check_rope(rope, q.shape[0], q.shape[1], k.shape[1], q.shape[-1], q.device)
    empty = checks.check_empty_queries(empty_queries, q.shape[:2], q.device)
    options = _attention_options(q.shape[-1], causal, scale, softcap, window, dropout_p, deterministic)
    cos, sin = rope if rope is not None else (None, None)
    (q, k, v), autocast_off = checks.autocast_cast(q, k, v)
    batch, n, hq, head_dim = q.shape
    core = choose_core(backend, q, batch, (n, k.shape[1], hq, k.shape[2], head_dim), options, rope=cos is not None,
                       backward_can_follow=_backward_can_follow(q, k, v, cos, sin))
    q, k, v = (t if t.stride(-1) == 1 else t.contiguous() for t in (q, k, v))
    with autocast_off:
        if 0 in (batch, n, k.shape[1]):
            o = _attention_without_work(q, k, v)
            o = o if empty is None else o.masked_fill(empty[..., None, None], 0)
        elif core.name == "aten" and q.device.type == "cpu" and cos is None and empty is None:
            # The same kernels and saved tensors as AttentionFunction's aten core, through PyTorch's
            # own autograd node (faster than a Python Function; see cpu_flash_attention).
            o = cpu_flash_attention(q, k, v, core.options)
        else:
            o = AttentionFunction.apply(q, k, v, cos, sin, core.options, core.name, core.rotate_once, empty)
    return o.transpose(1, 2) if layout == "bhnd" else o


def _attention_without_work(q, k, v):
    """Attention of a call with no queries, no keys or no batch entries (q [B, N, Hq, D], k, v
    [B, M, Hkv, D]), as stock's: o is empty, or 0 where queries have no key to see, and its backward
    gives dq, dk, dv of the inputs' shapes (0 where not empty), whatever the inputs hold. No kernel
    runs (their grids would be empty): two products over an empty dimension."""
    group = q.shape[2] // k.shape[2]
    k, v = (t.transpose(1, 2).repeat_interleave(group, dim=1) for t in (k, v))
    return torch.matmul(torch.matmul(q.transpose(1, 2), k.transpose(-1, -2)), v).transpose(1, 2).contiguous()


def _backward_can_follow(*tensors):
    """Whether autograd will record the call: grad mode on and some tensor argument requiring grad
    (an autograd.Function's forward cannot tell: it runs with grad mode off)."""
    return torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors)


def _varlen_attention(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, *, causal, scale, dropout_p,
                      rope, window, softcap, deterministic, layout, backend, empty_queries):
    """remat.attention with cumulative sequence lengths (packed sequences)."""
    if cu_seqlens_q is None or cu_seqlens_k is None:
        raise ValueError("packed attention needs both cu_seqlens_q and cu_seqlens_k")
    if layout != "bnhd":
        raise ValueError(f"packed attention (cu_seqlens) takes layout 'bnhd' only ([total, heads, D]), got {layout!r}")
    checks.check_varlen_qkv(q, k, v)
    max_seqlen_q, max_seqlen_k = checks.check_varlen_offsets(cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                                                             q.shape[0], k.shape[0], q.device,
                                                             keys_cover_queries=rope is not None)
    checks.check_varlen_rope(rope, k.shape[0], max_seqlen_k, q.shape[-1], q.device)
    empty = checks.check_empty_queries(empty_queries, q.shape[:1], q.device)
    options = _attention_options(q.shape[-1], causal, scale, softcap, window, dropout_p, deterministic)
    cos, sin = rope if rope is not None else (None, None)
    (q, k, v), autocast_off = checks.autocast_cast(q, k, v)
    core = choose_core(backend, q, 1, (max_seqlen_q, max_seqlen_k, q.shape[1], k.shape[1], q.shape[2]), options,
                       varlen=True, rope=cos is not None, backward_can_follow=_backward_can_follow(q, k, v, cos, sin))
    q, k, v = (t if t.stride(-1) == 1 else t.contiguous() for t in (q, k, v))
    # One offsets tensor for both (self-attention) is passed once: see VarlenAttentionFunction.
    distinct_k = None if cu_seqlens_k is cu_seqlens_q else cu_seqlens_k
    with autocast_off:
        return VarlenAttentionFunction.apply(q, k, v, cu_seqlens_q, distinct_k, max_seqlen_q, max_seqlen_k, cos, sin,
                                             core.options, core.name, core.rotate_once, empty)


def _attention_options(head_dim, causal, scale, softcap, window, dropout_p, deterministic):
    """Checks the scalar attention arguments; returns the kernels' AttentionOptions."""
    checks.check_positive(scale, "scale")
    checks.check_positive(softcap, "softcap")
    checks.check_probability(dropout_p, "dropout_p")
    if not isinstance(causal, bool) or not (deterministic is None or isinstance(deterministic, bool)):
        raise TypeError("causal must be a bool and deterministic a bool or None")
    if deterministic is None:
        deterministic = torch.are_deterministic_algorithms_enabled()
    left, right = checks.window_bounds(window, causal)
    scale = float(scale) if scale is not None else head_dim**-0.5
    return AttentionOptions(scale, float(softcap or 0.0), left, right, float(dropout_p), deterministic)


def norm_attention(x, norm_weight, w_q, w_k, w_v, *, num_heads, num_kv_heads=None, norm_bias=None, b_q=None,
                   b_k=None, b_v=None, norm="rms", eps=None, qk_norm=None, q_norm_weight=None, k_norm_weight=None,
                   qk_eps=None, causal=True, scale=None, rope=None, window=None, softcap=None, dropout_p=0.0,
                   deterministic=None, keep_qkv=True, lora=None, backend=None, cu_seqlens=None, max_seqlen=None,
                   empty_queries=None, tile_tokens=None, sequence_parallel=None, w_o=None, b_o=None):
    """The pre-norm attention sub-block of a transformer layer in one fused Function: the norm, the
    q/k/v projections, rotary embedding and flash attention, up to the attention output (the
    output projection and residual add are the caller's; under sequence_parallel with keep_qkv=False
    the output projection can be fused in: ``w_o``).

    ``o = attention(rope(qn(norm(x) w_q^T + b_q)), rope(kn(norm(x) w_k^T + b_k)), norm(x) w_v^T + b_v)``

    with ``qn``, ``kn`` the optional per-head norms (``qk_norm``; identity by default).

    Args:
        x: ``[B, N, H]`` float32, float16 or bfloat16 (a last dim that is strided is copied once).
        norm_weight: ``[H]`` or None; norm_bias: ``[H]`` or None (``norm="layer"`` only).
        w_q: ``[Hq * D, H]``; w_k, w_v: ``[Hkv * D, H]`` (``nn.Linear`` layout, any strides), in x's
            dtype (under autocast any float dtype: all are cast to the autocast dtype).
        num_heads: Hq; num_kv_heads: Hkv (default Hq), Hq a multiple of Hkv. D = rows of w_q / Hq.
        b_q, b_k, b_v: optional projection biases.
        norm: ``"rms"`` (default), ``"layer"`` or ``"gemma"`` (Gemma's RMSNorm: ``x_hat * (1 + w)``
            with ``1 + w`` in fp32 and one rounding to x's dtype, as Hugging Face computes it); eps:
            default 1e-6 (rms, gemma) or 1e-5 (layer).
        qk_norm: None (default), ``"rms"`` (Qwen3) or ``"gemma"`` (Gemma 3): a norm of each head of
            q and of k over D, after the projections and before rope, with the weights
            q_norm_weight, k_norm_weight (``[D]`` in x's dtype, or None for none) and epsilon
            qk_eps (default 1e-6). It is recomputed in backward with the projections' outputs,
            never saved: with keep_qkv the saved q, k are the projections before these norms.
        causal, scale, rope, window, softcap, dropout_p, deterministic: as for :func:`attention`
            (self-attention: M = N).
        keep_qkv: True keeps q, k, v for backward; False recomputes them there with the three
            projection GEMMs (what a "memory" layer policy does).
        lora: None, or ``(q_adapters, k_adapters, v_adapters)`` (and ``o_adapters`` with ``w_o``:
            four), each None or a sequence of
            :class:`remat.autograd.lora.LoRAAdapter` (``a`` ``[r, H]``, ``b`` ``[width, r]``,
            optional ``bias``, ``scaling``, ``dropout_p``): LoRA branches
            ``scaling * b(a(dropout(norm(x))))`` added to that projection with PEFT's arithmetic
            (see remat.autograd.lora). They are part of q, k, v (kept or recomputed with them);
            their rank-r intermediates and dropout masks are recomputed in backward, never saved.
        backend: as for :func:`attention`; the projection GEMMs are PyTorch's.
        cu_seqlens: packed sequences (padding-free batches): None (default), or int32 ``[S + 1]``
            offsets on x's device as :func:`attention`'s cu_seqlens_q (from 0, non-decreasing,
            zero-length sequences allowed, ending at T). x is then one packed row ``[1, T, H]``
            (B must be 1) and each sequence attends only within itself (self-attention over the
            offsets). rope tables: ``[S, D/2|D]`` restart positions in every sequence; per-token
            ``[1, T, D/2|D]`` (e.g. Hugging Face's tables from restarting position_ids) give token t
            row t.
        max_seqlen: with cu_seqlens, an upper bound of the sequence lengths; None computes it
            (required under torch.compile).
        empty_queries: None (default), or bool ``[B, N]`` of x's tokens (``[1, T]`` packed): queries
            whose attention output is 0 and from which no gradient flows (pads), as for
            :func:`attention`.
        tile_tokens: None (default), an int >= 1 or ``"auto"`` (from the free memory:
            remat.tiles): the norm and projections run over tiles of that many tokens in forward,
            and the whole backward over query tiles, so that nothing of q's width exists beyond one
            tile in backward (remat.autograd.norm_attention_tiled). Needs
            causal attention (a left sliding window too; dense rows, or packed rows outside
            torch.compile, whose traced offsets would make a tile's shapes data) and no attention
            dropout (ValueError otherwise); with LoRA dropout, a multiple of 4. The results equal
            the untiled call's up to rounding (fp32 sums over tiles); what is saved is unchanged.
        sequence_parallel: None (default), or a ``torch.distributed`` ProcessGroup of P ranks that
            share one sequence (Ulysses; remat.sequence_parallel): x is this rank's shard, its n
            tokens being ``[r n, (r + 1) n)`` of the whole sequence of P n tokens for rank r; every
            rank calls with the same shapes and arguments. The rope tables are the shard's, per
            token (``[1 or B, n, D/2|D]``, or ``[n, D/2|D]``); cu_seqlens and max_seqlen, if
            given, describe the whole sequence (offsets from 0 to P n). Hq must be a multiple of
            P, and Hkv a multiple of P or P a multiple of Hkv. Not with attention dropout,
            empty_queries or tile_tokens (ValueError). Results equal one process running the
            whole sequence (up to rounding); the backward's all-to-alls run inside this call's
            backward, which every rank must run. With keep_qkv=False the projections run one head
            chunk at a time too (remat.autograd.norm_attention_parallel): q, k, v and their
            gradients never exist whole on the rank.
        w_o, b_o: None (default), or the attention output projection ``[out, Hq * D]`` (and its
            bias ``[out]``) fused into the call: returns ``o W_o^T + b_o`` (plus its LoRA branches,
            the fourth entry of ``lora``) ``[B, N, out]`` instead of o. Only with sequence_parallel
            and keep_qkv=False (ValueError otherwise), where it saves memory: the gradient of o is
            then made one head chunk at a time from the output's gradient, never whole (8 GiB at a
            million tokens per rank and 4096 features). Nothing more is saved (the projection's
            input is the saved o).

    Returns:
        o ``[B, N, Hq, D]`` in x's dtype (the autocast dtype under autocast); ``[1, T, Hq, D]``
        with cu_seqlens; with w_o the projected ``[B, N, out]`` (``[1, T, out]``).

    Saved for backward: x, the fp32 norm statistics, o, fp32 lse ``[B, Hq, N]``, with keep_qkv
    also q, k, v (16 bytes of RNG state with dropout; the caller's rope tables). The normalized
    input, the per-head normalized q/k and their statistics, rotated q/k and the probabilities are
    recomputed (remat.autograd.norm_attention). With cu_seqlens the offsets are saved too and lse
    is ``[Hq, T]``. Under sequence_parallel the same for the shard's tokens, lse head-sharded
    (``[B, Hq / P, P n]`` or ``[Hq / P, T]``).
    """
    checks.check_hidden_states(x)
    checks.check_input(x)
    batch, n, hidden = x.shape
    num_kv_heads = num_heads if num_kv_heads is None else num_kv_heads
    for name, value in (("num_heads", num_heads), ("num_kv_heads", num_kv_heads)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be a positive int, got {value!r}")
    if num_heads % num_kv_heads:
        raise ValueError(f"num_heads ({num_heads}) must be a multiple of num_kv_heads ({num_kv_heads})")
    checks.check_matrix(w_q, "w_q")
    if w_q.shape[0] % num_heads:
        raise ValueError(f"w_q's rows ({w_q.shape[0]}) must be num_heads ({num_heads}) x head dim")
    head_dim = w_q.shape[0] // num_heads
    if not 1 <= head_dim <= checks.MAX_HEAD_DIM:
        raise ValueError(f"head dim must be in 1..{checks.MAX_HEAD_DIM}, got {head_dim}")
    q_width, kv_width = num_heads * head_dim, num_kv_heads * head_dim
    for name, w, width in (("w_q", w_q, q_width), ("w_k", w_k, kv_width), ("w_v", w_v, kv_width)):
        checks.check_weight(w, name, (width, hidden), x)
    for name, b, width in (("b_q", b_q, q_width), ("b_k", b_k, kv_width), ("b_v", b_v, kv_width)):
        checks.check_weight(b, name, (width,), x, optional=True)
    eps = checks.check_norm(norm, norm_weight, norm_bias, eps, x)
    qk_eps = _check_qk_norm(qk_norm, q_norm_weight, k_norm_weight, qk_eps, head_dim, x)
    out_width = _check_out_projection(w_o, b_o, q_width, keep_qkv, sequence_parallel, x)
    if out_width is None:
        lora_layout, lora_tensors = check_lora(lora, (hidden,) * 3, (q_width, kv_width, kv_width), x, ("q", "k", "v"))
    else:
        lora_layout, lora_tensors = check_lora(lora, (hidden,) * 3 + (q_width,),
                                               (q_width, kv_width, kv_width, out_width), x, ("q", "k", "v", "o"))
    if cu_seqlens is None and max_seqlen is not None:
        raise ValueError("max_seqlen needs cu_seqlens")
    ranks = _check_sequence_parallel(sequence_parallel, num_heads, num_kv_heads, dropout_p, empty_queries,
                                     tile_tokens)
    # A group given, even of one rank, runs the sequence-parallel paths (their rope and offset rules).
    sharded = sequence_parallel is not None
    if cu_seqlens is None or sharded:
        checks.check_rope(rope, batch, n, n, head_dim, x.device)  # sequence parallel: the shard's tokens
    if cu_seqlens is not None:
        if batch != 1:
            raise ValueError(f"with cu_seqlens, x must be one packed row [1, T, hidden], got shape {tuple(x.shape)}")
        total = ranks * n  # offsets of the whole sequence under sequence parallelism
        max_seqlen, _ = checks.check_varlen_offsets(cu_seqlens, cu_seqlens, max_seqlen, max_seqlen, total, total,
                                                    x.device)
        if not sharded:
            checks.check_varlen_rope(rope, n, max_seqlen, head_dim, x.device)
    if not isinstance(keep_qkv, bool):
        raise TypeError("keep_qkv must be a bool")
    empty = checks.check_empty_queries(empty_queries, (batch, n), x.device)
    attention_options = _attention_options(head_dim, causal, scale, softcap, window, dropout_p, deterministic)
    # A query tile's working set: q, its rotated copy and its gradient in x's dtype, the core's fp32
    # dq accumulator (Hq D each), and the tile's normalized rows and their gradient (2 H).
    tile_bytes = (3 * x.element_size() + 4) * num_heads * head_dim + 2 * x.element_size() * x.shape[-1]
    tile = resolve_tile_tokens(checks.check_tile_tokens(tile_tokens), n, tile_bytes, x.device)
    _check_attention_tile(tile, attention_options, cu_seqlens is not None, lora_layout)
    if batch == 1 and tile >= n:
        tile = 0  # one tile over the one row is the untiled call, without the tiled backward's extra work
    if x.stride(-1) != 1:
        x = x.contiguous()
    cos, sin = rope if rope is not None else (None, None)
    (_, *lora_tensors), _ = checks.autocast_cast(x, *lora_tensors)
    (x, *params, w_o, b_o), autocast_off = checks.autocast_cast(x, norm_weight, norm_bias, w_q, w_k, w_v, b_q, b_k,
                                                                b_v, q_norm_weight, k_norm_weight, w_o, b_o)
    # The core's call: under sequence parallelism every token of the group's shards, Hq / P query
    # heads and their KV heads, rope rotated before (remat.autograd.norm_attention).
    sizes = ((ranks * n if cu_seqlens is None else max_seqlen,) * 2
             + (num_heads // ranks, max(num_kv_heads // ranks, 1), head_dim))
    recorded = _backward_can_follow(x, *params, cos, sin, *lora_tensors)
    core = choose_core(backend, x, batch, sizes, attention_options, varlen=cu_seqlens is not None,
                       rope=cos is not None and not sharded, backward_can_follow=recorded)
    # The PyTorch cores are attention only: the norm kernels then take the device's default backend.
    norm_name = default_backend(x.device) if core.name in ("aten", "cudnn") else core.name
    options = NormAttentionOptions((batch, n, num_heads, num_kv_heads, head_dim), norm, float(eps),
                                   core.options, keep_qkv, norm_name, qk_norm, qk_eps, max_seqlen, tile or None,
                                   (sequence_parallel, ranks) if sharded else None)
    with autocast_off:
        if sharded and not keep_qkv:
            return ParallelNormAttentionFunction.apply(x, *params, w_o, b_o, cos, sin, cu_seqlens, options, core.name,
                                                       lora_layout, *lora_tensors)
        return NormAttentionFunction.apply(x, *params, cos, sin, cu_seqlens, empty, options, core.name,
                                           core.rotate_once, lora_layout, *lora_tensors)


def attention_tile_unsupported_reason(options, packed):
    """Why norm_attention cannot run over query tiles with these :class:`AttentionOptions` (and
    packed rows when ``packed``), or None. Packed rows tile but under torch.compile, where their
    offsets are traced: the tiles' calls take their shapes from the offsets' values."""
    if options.window_right != 0:
        return "only causal attention is tiled"
    if options.dropout_p > 0:
        return "attention dropout is not tiled"
    if packed and torch.compiler.is_compiling():
        return "packed rows are not tiled under torch.compile (a tile's sequences are data)"
    return None


def _check_sequence_parallel(group, num_heads, num_kv_heads, dropout_p, empty_queries, tile_tokens):
    """The number of ranks P sharing the sequence (1 without ``group``), after checking what
    sequence parallelism takes (ValueError / TypeError / RuntimeError before any collective)."""
    if group is None:
        return 1
    ranks = check_group(group)
    check_heads(num_heads, num_kv_heads, ranks, "this call")
    if dropout_p:
        raise ValueError("sequence_parallel does not take attention dropout (each rank would draw its heads' masks "
                         "from its own generator)")
    if empty_queries is not None:
        raise ValueError("sequence_parallel does not take empty_queries (pads): pad the sequence's end instead")
    if tile_tokens is not None:
        raise ValueError("sequence_parallel does not tile the attention sub-block: tile_tokens must be None")
    return ranks


def _check_out_projection(w_o, b_o, q_width, keep_qkv, sequence_parallel, x):
    """The fused output projection's width (None without ``w_o``), after checking it."""
    if w_o is None:
        if b_o is not None:
            raise ValueError("b_o needs w_o")
        return None
    if sequence_parallel is None or keep_qkv is not False:
        raise ValueError("w_o (the fused output projection) is taken only with sequence_parallel and keep_qkv=False, "
                         "where it keeps the gradient of o one head chunk at a time; elsewhere apply the projection "
                         "to the returned o")
    checks.check_matrix(w_o, "w_o")
    checks.check_weight(w_o, "w_o", (w_o.shape[0], q_width), x)
    checks.check_weight(b_o, "b_o", (w_o.shape[0],), x, optional=True)
    return w_o.shape[0]


def _check_attention_tile(tile, options, packed, lora_layout):
    """Raises ValueError when norm_attention cannot run over query tiles of ``tile`` tokens (0:
    untiled, always fine)."""
    if not tile:
        return
    reason = attention_tile_unsupported_reason(options, packed)
    if reason is not None:
        raise ValueError(f"tile_tokens: {reason}")
    if tile % 4 and any(slot.dropout_p > 0 for slot in lora_layout):
        raise ValueError(f"with LoRA dropout, tile_tokens must be a multiple of 4 (a tile's dropout mask starts on "
                         f"a Philox call of four elements), got {tile}")


def _check_qk_norm(qk_norm, q_norm_weight, k_norm_weight, qk_eps, head_dim, x):
    """The per-head q/k norm arguments of norm_attention; returns qk_eps as a float (0.0 without
    the norms)."""
    if qk_norm is None:
        if q_norm_weight is not None or k_norm_weight is not None or qk_eps is not None:
            raise ValueError("q_norm_weight, k_norm_weight and qk_eps need qk_norm='rms' or 'gemma'")
        return 0.0
    checks.check_choice(qk_norm, "qk_norm", ("rms", "gemma"))
    for name, weight in (("q_norm_weight", q_norm_weight), ("k_norm_weight", k_norm_weight)):
        checks.check_weight(weight, name, (head_dim,), x, optional=True)
    qk_eps = 1e-6 if qk_eps is None else qk_eps
    checks.check_eps(qk_eps)
    return float(qk_eps)
