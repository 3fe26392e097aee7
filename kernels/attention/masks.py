"""Which scores the attention kernels see and which rows a program owns: the window band, the
tiles it covers, the query block, the dropout mask.

Query i sits at position i + M - N (bottom-right alignment) and sees key j iff (left < 0 or
j >= pos - left) and (right < 0 or j <= pos + right); causal is right = 0.

Work per program only covers the visible band: a query block visits the key range
[max(0, first_pos - left), min(M, last_pos + right + 1)), its start rounded down to a multiple
of BLOCK_N, and a key block the matching query range (`_key_range`, `_query_range`). One loop
walks those tiles; a scalar per tile says whether it straddles an edge of the band (the causal
diagonal, a window edge, the end of the keys or queries), and only those tiles run the mask
arithmetic, two compares per score on key - position offsets (`_visible`), under a branch
uniform across the program. Three loops (masked lead,
unmasked interior, masked tail) cost 56-120 bytes of register spills per thread in the sm_80
build of the forward at D 64, where this single loop has none.

Dropout: element (b, h, i, j) of the [B, Hq, N, M] probabilities (h the query head) takes word
j % 4 of Philox4x32-10 (key seed) at the int64 counter offset + r * ceil(M / 4) + j // 4,
r = (b * Hq + h) * N + i, and is kept iff that word's uniform (tl.random's
uint_to_uniform_float) is >= dropout_p (`_dropout_keep`): one Philox call (tl.randint4x) gives
four consecutive keys of a row. remat.reference.attention_dropout_keep (philox_stream_words) and
csrc/common/philox.h produce the same mask. Key tiles start at multiples of BLOCK_N (a multiple
of 4; `_key_range` aligns the first tile down), so a tile's keys are whole groups of four. The
seed and offset are read on the device from rng = int64 [seed, offset].

Packed (variable-length) sequences (VARLEN): grid axis 2 runs over the S sequences instead of the
batch, the kernels' N, M are the max_seqlen bounds, and `_sequence` reads each sequence's first
rows and lengths from the int32 offsets cu_seqlens_q / cu_seqlens_k; masks, positions and tile
ranges use the sequence's own lengths, while the dropout counter keeps N, M: sequence s draws the
counters of batch entry s of the zero-padded [S, max_seqlen_q] x [S, max_seqlen_k] batch.
"""

import triton
import triton.language as tl

# Window offsets are clamped to _FAR (the launchers clamp left/right), and masked-off rows and
# keys get positions _OUT away, so one offset test covers the window and both bounds. Exact for
# N, M < 2^28, which the launchers check; 2 * _OUT stays inside int32.
_FAR = tl.constexpr(1 << 28)
_OUT = tl.constexpr(1 << 29)


@triton.jit
def _offset_bounds(left, right):
    """(lo, hi): key j is inside the window of the query at position pos iff
    lo <= j - pos <= hi (left/right < 0: unbounded, as -_FAR / _FAR)."""
    return tl.where(left >= 0, -left, -_FAR), tl.where(right >= 0, right, _FAR)


@triton.jit
def _visible(row_pos, key_pos, lo, hi):
    """The visibility mask of broadcast row_pos (query positions, -_OUT for rows past N) and
    key_pos (key indices, _OUT for keys past M): two compares per element."""
    offset = key_pos - row_pos
    return (offset >= lo) & (offset <= hi)


@triton.jit
def _interior(lo, lo_full, hi_full, BLOCK: tl.constexpr):
    """[int_start, int_end): the tiles lo + k * BLOCK that lie inside [lo_full, hi_full), i.e.
    need no mask; empty when the bounds cross."""
    int_start = lo + tl.cdiv(tl.maximum(lo_full - lo, 0), BLOCK) * BLOCK
    int_end = int_start + (tl.maximum(hi_full - int_start, 0) // BLOCK) * BLOCK
    return int_start, int_end


@triton.jit
def _key_range(start_m, N, M, left, right, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """Key tiles of the query block [start_m, start_m + BLOCK_M): (lo, hi, int_start, int_end),
    [lo, hi) the keys some row of the block sees with lo rounded down to a multiple of BLOCK_N,
    and its unmasked tiles (`_interior`)."""
    shift = M - N
    first_pos = start_m + shift
    last_pos = tl.minimum(start_m + BLOCK_M, N) - 1 + shift
    # The first tile starts at a multiple of BLOCK_N (the dropout words come in groups of four
    # keys); its keys before the band are masked like any straddling tile's.
    lo = tl.where(left >= 0, (tl.maximum(first_pos - left, 0) // BLOCK_N) * BLOCK_N, 0)
    hi = tl.where(right >= 0, tl.minimum(last_pos + right + 1, M), M)
    # Keys >= lo_full are inside every row's left edge, keys < hi_full inside every right edge.
    lo_full = tl.where(left >= 0, tl.maximum(last_pos - left, lo), lo)
    hi_full = tl.where(right >= 0, tl.minimum(first_pos + right + 1, hi), hi)
    int_start, int_end = _interior(lo, lo_full, hi_full, BLOCK_N)
    return lo, hi, int_start, int_end


@triton.jit
def _query_range(start_n, N, M, left, right, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """Query tiles that see some key of the block [start_n, start_n + BLOCK_N): (lo, hi,
    int_start, int_end) as in `_key_range`. Row i sees key j iff
    j - shift - right <= i <= j - shift + left. A block that runs past M has no interior."""
    shift = M - N
    end_n = start_n + BLOCK_N
    last_key = tl.minimum(end_n, M) - 1
    lo = tl.where(right >= 0, tl.maximum(start_n - shift - right, 0), 0)
    hi = tl.where(left >= 0, tl.minimum(last_key - shift + left + 1, N), N)
    lo_full = tl.where(right >= 0, tl.maximum(end_n - 1 - shift - right, lo), lo)
    hi_full = tl.where(left >= 0, tl.minimum(start_n - shift + left + 1, hi), hi)
    hi_full = tl.where(end_n <= M, hi_full, lo)
    int_start, int_end = _interior(lo, lo_full, hi_full, BLOCK_M)
    return lo, hi, int_start, int_end


@triton.jit
def _query_block(N, M, GROUP, BLOCK_M: tl.constexpr):
    """The query block of a program of the grid (query blocks, Hq, B), the last block first (so
    under a causal mask the longest rows start first): (start_m, rows, row_mask, positions, h,
    kv_head, b, num_heads), positions = rows + M - N, the heads and the batch index int64."""
    start_m = (tl.num_programs(0) - 1 - tl.program_id(0)) * BLOCK_M
    h = tl.program_id(1)
    b = tl.program_id(2).to(tl.int64)
    num_heads = tl.num_programs(1)
    kv_head = (h // GROUP).to(tl.int64)
    h = h.to(tl.int64)
    rows = start_m + tl.arange(0, BLOCK_M)
    row_mask = rows < N
    positions = rows + (M - N)
    return start_m, rows, row_mask, positions, h, kv_head, b, num_heads


@triton.jit
def _dropout_keep(seed, row_counters, start_n, dropout_p, BLOCK_N: tl.constexpr):
    """Keep mask [rows, BLOCK_N] of the keys start_n .. start_n + BLOCK_N - 1 (start_n a multiple
    of 4) of the rows whose key-0 counters are row_counters (int64 [rows], `_dropout_rows`): key j
    takes word j % 4 of the Philox call at row_counter + j // 4 and is kept iff its uniform is
    >= dropout_p. One tl.randint4x per four keys; tl.join(tl.join(w0, w2), tl.join(w1, w3)) is
    [rows, BLOCK_N / 4, 2, 2] with word 2 * a + b at [.., a, b], so the row-major reshape puts
    key 4 * g + w at word w of group g."""
    tl.static_assert(BLOCK_N % 4 == 0, "dropout key tiles hold whole groups of four keys")
    groups = start_n // 4 + tl.arange(0, BLOCK_N // 4)
    w0, w1, w2, w3 = tl.randint4x(seed, row_counters[:, None] + groups[None, :])
    words = tl.reshape(tl.join(tl.join(w0, w2), tl.join(w1, w3)), [row_counters.shape[0], BLOCK_N])
    return tl.random.uint_to_uniform_float(words) >= dropout_p


@triton.jit
def _dropout_rows(rng_ptr, row_ids, M, DROPOUT: tl.constexpr):
    """(seed, key-0 counters) of the rows `row_ids` (int64 indices into [B, Hq, N]): row r's
    counters start at offset + r * ceil(M / 4), four keys per counter. Without DROPOUT,
    placeholders."""
    if DROPOUT:
        seed = tl.load(rng_ptr)
        rng_rows = tl.load(rng_ptr + 1) + row_ids * tl.cdiv(M, 4)
    else:
        seed = 0
        rng_rows = row_ids
    return seed, rng_rows


@triton.jit
def _sequence(cu_q_ptr, cu_k_ptr, b, N, M, VARLEN: tl.constexpr):
    """Batch entry b's rows: (q_row0, k_row0, n, m, total_q). q_row0 / k_row0 (int64): its first
    row in the [B * N] / [B * M] rows of the contiguous outputs; n, m (int32): its lengths;
    total_q: the query rows of all entries. VARLEN: sequence b of the packed rows (offsets
    cu_q_ptr[b], cu_k_ptr[b], lengths their differences, total_q = cu_q_ptr[S], S the grid's
    axis 2); else b * N, b * M, N, M and B * N."""
    if VARLEN:
        q_start = tl.load(cu_q_ptr + b)
        k_start = tl.load(cu_k_ptr + b)
        n = tl.load(cu_q_ptr + b + 1) - q_start
        m = tl.load(cu_k_ptr + b + 1) - k_start
        total_q = tl.load(cu_q_ptr + tl.num_programs(2)).to(tl.int64)
        q_row0 = q_start.to(tl.int64)
        k_row0 = k_start.to(tl.int64)
    else:
        q_row0 = b * N
        k_row0 = b * M
        n = N
        m = M
        total_q = tl.num_programs(2).to(tl.int64) * N
    return q_row0, k_row0, n, m, total_q


@triton.jit
def _operand_base(b, row0, stride_b, stride_n, head, stride_h, VARLEN: tl.constexpr):
    """Element offset of row 0 of batch entry b, head `head`, in a strided q/k/v/o/dout operand:
    b * stride_b (batched), or row0 * stride_n (VARLEN: a packed [total, H, D] operand)."""
    if VARLEN:
        base = row0 * stride_n + head * stride_h
    else:
        base = b * stride_b + head * stride_h
    return base


@triton.jit
def _stats_base(b, h, num_heads, N, q_row0, total_q, VARLEN: tl.constexpr):
    """Index of row 0 of (b, h) in lse / Delta: fp32 [B, Hq, N], or [Hq, total_q] (VARLEN)."""
    if VARLEN:
        base = h * total_q + q_row0
    else:
        base = (b * num_heads + h) * N
    return base


@triton.jit
def _rope_base(b, k_row0, cs_stride, VARLEN: tl.constexpr):
    """Element offset of row 0 of the rotary tables for batch entry b: b * cs_stride (cs_stride
    the tables' batch stride, 0 for shared tables), or with VARLEN k_row0 * cs_stride (cs_stride
    D/2 for per-token tables [1, T, D/2], whose rows follow the packed keys; 0 for tables that
    restart at every sequence)."""
    if VARLEN:
        base = k_row0 * cs_stride
    else:
        base = b * cs_stride
    return base
