"""References that do not come from remat (issue #11 B).

- Rotary tables: ``remat.nn.Attention``'s built-in (cos, sin) against the formula evaluated here
  in float64 and against Hugging Face's ``LlamaRotaryEmbedding``; a doubled rope_theta fails.
- Philox4x32-10: a Philox written here from the published algorithm (Salmon et al., SC'11,
  Random123), checked against Random123's known-answer vectors; then remat.reference's Philox
  against it, and the dropout masks of every CPU backend against it (not against remat's own
  reference), with the keep share in a binomial 5-sigma band and the kept values x / (1 - p).
- Activations: the torch backend's silu / gelu / gelu_tanh and their derivatives against
  torch.nn.functional and autograd, in float64.
"""

import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from test_rounding import EPS32, find_internal, require_backend

import remat
import remat.reference

# ------------------------------------------------------------------------------------------------
# Rotary embedding tables

ROPE_CASES = [(10000.0, 64), (10000.0, 128), (500000.0, 64), (500000.0, 128), (10000.0, 6), (500000.0, 80)]


def rope_formula64(positions, theta, head_dim):
    """(cos, sin) float64 [..., N, D/2]: angle = pos / theta^(2d/D), d = 0 .. D/2 - 1."""
    d = torch.arange(head_dim // 2, dtype=torch.float64)
    angle = positions.double()[..., None] / theta ** (2 * d / head_dim)
    return angle.cos(), angle.sin(), angle


def assert_rope_tables(name, cos, sin, positions, theta, head_dim):
    """cos/sin (fp32) within the error of an fp32 evaluation of the angle: the exponent 2d/D, the
    power and the product are each rounded, so the angle is off by about (3 + ln theta) fp32
    roundoffs of itself; checked at 2x that, plus 2 roundoffs for cos/sin themselves."""
    cos64, sin64, angle = rope_formula64(positions, theta, head_dim)
    bound = 2 * (3 + math.log(theta)) * EPS32 * angle.abs() + 2 * EPS32
    for label, value, ref in (("cos", cos, cos64), ("sin", sin, sin64)):
        assert value.shape == ref.shape, f"{name} {label}: shape {tuple(value.shape)} != {tuple(ref.shape)}"
        assert value.dtype == torch.float32, f"{name} {label}: {value.dtype}"
        excess = ((value.double() - ref).abs() / bound).max().item()
        assert excess <= 1.0, f"{name} {label}: error {excess:.2f} x the fp32 evaluation bound"


def _attention(theta, head_dim):
    heads = 2
    return remat.nn.Attention(heads * head_dim, heads, head_dim=head_dim, rope_theta=theta)


def _positions():
    g = torch.Generator().manual_seed(0)
    return torch.stack([torch.arange(300), torch.randint(0, 8192, (300,), generator=g)])  # [B=2, N]


@pytest.mark.parametrize("theta,head_dim", ROPE_CASES, ids=[f"theta{int(t)}-D{d}" for t, d in ROPE_CASES])
def test_rope_tables_match_the_formula(theta, head_dim):
    attention = _attention(theta, head_dim)
    cos, sin = attention.rope_for(300, torch.device("cpu"))  # default positions 0 .. N - 1
    assert_rope_tables("rope_for", cos, sin, torch.arange(300)[None], theta, head_dim)
    positions = _positions()
    cos, sin = attention.rope_tables(positions, torch.device("cpu"))
    assert_rope_tables("rope_tables", cos, sin, positions, theta, head_dim)


@pytest.mark.parametrize("theta,head_dim", ROPE_CASES, ids=[f"theta{int(t)}-D{d}" for t, d in ROPE_CASES])
def test_rope_tables_match_hugging_face_llama(theta, head_dim):
    """Hugging Face's tables are [B, N, D] with equal halves; remat keeps one half."""
    transformers = pytest.importorskip("transformers")
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    heads = 2
    config = transformers.LlamaConfig(hidden_size=heads * head_dim, num_attention_heads=heads, head_dim=head_dim,
                                      num_key_value_heads=heads, max_position_embeddings=8192,
                                      rope_parameters={"rope_type": "default", "rope_theta": theta})
    positions = _positions()
    hf_cos, hf_sin = LlamaRotaryEmbedding(config)(torch.zeros(1), positions)
    half = head_dim // 2
    assert hf_cos.shape == (2, 300, head_dim)
    assert torch.equal(hf_cos[..., :half], hf_cos[..., half:]) and torch.equal(hf_sin[..., :half], hf_sin[..., half:])
    assert_rope_tables("Hugging Face", hf_cos[..., :half], hf_sin[..., :half], positions, theta, head_dim)
    cos, sin = _attention(theta, head_dim).rope_tables(positions, torch.device("cpu"))
    # Both evaluate 1 / theta ** (arange(0, D, 2) / D), pos * inv_freq and cos/sin in fp32: the
    # same operations, so the same bits.
    assert torch.equal(cos.expand_as(hf_cos[..., :half]), hf_cos[..., :half])
    assert torch.equal(sin.expand_as(hf_sin[..., :half]), hf_sin[..., :half])


@pytest.mark.parametrize("theta", [10000.0, 500000.0])
def test_doubled_rope_theta_fails_the_rope_checks(monkeypatch, theta):
    """The checks above have teeth: the module with its rope_theta doubled fails them."""
    head_dim = 64
    attention = _attention(theta, head_dim)
    positions = _positions()
    cos, sin = attention.rope_tables(positions, torch.device("cpu"))
    assert_rope_tables("unmutated", cos, sin, positions, theta, head_dim)
    monkeypatch.setattr(attention, "rope_theta", 2 * theta)
    cos, sin = attention.rope_tables(positions, torch.device("cpu"))
    with pytest.raises(AssertionError, match="fp32 evaluation bound"):
        assert_rope_tables("doubled theta", cos, sin, positions, theta, head_dim)


# ------------------------------------------------------------------------------------------------
# Philox4x32-10, written here from the published algorithm

MASK32 = 0xFFFFFFFF
PHILOX_M0, PHILOX_M1 = 0xD2511F53, 0xCD9E8D57  # round multipliers
PHILOX_W0, PHILOX_W1 = 0x9E3779B9, 0xBB67AE85  # Weyl key increments (golden ratio, sqrt(3) - 1)


def philox4x32_10(counter, key):
    """Random123's philox4x32_R(10, ctr, key) on plain ints: counter 4 words, key 2 words."""
    c0, c1, c2, c3 = counter
    k0, k1 = key
    for round_index in range(10):
        if round_index:  # the key is bumped before every round but the first
            k0, k1 = (k0 + PHILOX_W0) & MASK32, (k1 + PHILOX_W1) & MASK32
        p0, p1 = PHILOX_M0 * c0, PHILOX_M1 * c2
        c0, c1, c2, c3 = (p1 >> 32) ^ c1 ^ k0, p1 & MASK32, (p0 >> 32) ^ c3 ^ k1, p0 & MASK32
    return c0, c1, c2, c3


# tests/kat_vectors of the Random123 distribution (github.com/DEShawResearch/random123), the
# three "philox4x32 10" lines: counter (4 words), key (2 words) -> output (4 words).
RANDOM123_KAT = [
    ((0x00000000, 0x00000000, 0x00000000, 0x00000000), (0x00000000, 0x00000000),
     (0x6627E8D5, 0xE169C58D, 0xBC57AC4C, 0x9B00DBD8)),
    ((0xFFFFFFFF, 0xFFFFFFFF, 0xFFFFFFFF, 0xFFFFFFFF), (0xFFFFFFFF, 0xFFFFFFFF),
     (0x408F276D, 0x41C83B0E, 0xA20BC7C6, 0x6D5451FD)),
    ((0x243F6A88, 0x85A308D3, 0x13198A2E, 0x03707344), (0xA4093822, 0x299F31D0),
     (0xD16CFE09, 0x94FDCCEB, 0x5001E420, 0x24126EA1)),
]


def philox_words(seed, counters):
    """Vectorised (numpy uint64) four output words ([..., 4]) for 64-bit counters [lo, hi, 0, 0]
    under the 64-bit key [seed lo, seed hi]: what Triton's tl.randint4x(seed, offset) draws."""
    counters = np.asarray(counters, dtype=np.uint64)
    m32 = np.uint64(MASK32)
    c0, c1 = counters & m32, counters >> np.uint64(32)
    c2 = np.zeros_like(c0)
    c3 = np.zeros_like(c0)
    k0, k1 = np.uint64(seed & MASK32), np.uint64((seed >> 32) & MASK32)
    for round_index in range(10):
        if round_index:
            k0, k1 = (k0 + np.uint64(PHILOX_W0)) & m32, (k1 + np.uint64(PHILOX_W1)) & m32
        p0, p1 = np.uint64(PHILOX_M0) * c0, np.uint64(PHILOX_M1) * c2  # < 2^64: no wrap
        c0, c1, c2, c3 = (p1 >> np.uint64(32)) ^ c1 ^ k0, p1 & m32, (p0 >> np.uint64(32)) ^ c3 ^ k1, p0 & m32
    return np.stack([c0, c1, c2, c3], axis=-1)


def uniform_from_word(words):
    """Triton's uint_to_uniform_float for 32-bit words: as int32, negatives mirrored to -x - 1,
    times the fp32 constant 4.6566127342e-10, in fp32."""
    as_int = np.asarray(words, dtype=np.uint64).astype(np.uint32).view(np.int32).astype(np.int64)
    as_int = np.where(as_int < 0, -as_int - 1, as_int)
    return as_int.astype(np.float32) * np.float32(4.6566127342e-10)


def keep_mask(seed, offset, numel, p):
    """Flat dropout's stream, four elements per Philox call: element i takes word i % 4 of the
    call at counter offset + i // 4."""
    index = np.arange(numel, dtype=np.uint64)
    words = philox_words(seed, index // np.uint64(4) + np.uint64(offset))
    word = words[np.arange(numel), (index % np.uint64(4)).astype(np.int64)]
    return torch.from_numpy(uniform_from_word(word) >= np.float32(p))


@pytest.mark.parametrize("counter,key,expected", RANDOM123_KAT, ids=["zeros", "ones", "pi"])
def test_local_philox_matches_random123_known_answers(counter, key, expected):
    assert philox4x32_10(counter, key) == expected


def test_vectorised_philox_matches_the_scalar_one():
    rng = np.random.default_rng(0)
    counters = [int(c) for c in rng.integers(0, 2**63, 40, dtype=np.uint64)] + [0, 1, MASK32, 2**32, 2**64 - 1]
    for seed in (0, 1, 0x1234_5678_9ABC, 2**62 - 1, 2**64 - 1):
        words = philox_words(seed, counters)
        for counter, four in zip(counters, words.tolist()):
            expected = philox4x32_10((counter & MASK32, counter >> 32, 0, 0), (seed & MASK32, seed >> 32))
            assert tuple(four) == expected


def test_remat_reference_philox_matches_the_local_one():
    """remat.reference.philox_words(seed, counters) are the four words for counter [lo, hi, 0, 0]
    and key [seed lo, seed hi] (csrc/common/philox.h), philox_randint the first; the uniform
    conversion is Triton's."""
    # Random123's all-zero known answer, through remat's own reference.
    assert remat.reference.philox_words(0, torch.zeros(1, dtype=torch.int64))[0].tolist() == list(RANDOM123_KAT[0][2])
    rng = np.random.default_rng(1)
    counters = np.concatenate([np.arange(100, dtype=np.int64), rng.integers(0, 2**62, 400, dtype=np.int64)])
    for seed in (0, 7, 2**33 + 5, int(rng.integers(0, 2**62))):
        mine = philox_words(seed, counters.astype(np.uint64)).astype(np.int64)
        theirs = remat.reference.philox_words(seed, torch.from_numpy(counters))
        assert torch.equal(theirs, torch.from_numpy(mine)), f"seed {seed}"
        assert torch.equal(remat.reference.philox_randint(seed, torch.from_numpy(counters)), theirs[:, 0])
        uniform = remat.reference.philox_uniform(theirs)
        assert torch.equal(uniform, torch.from_numpy(uniform_from_word(mine)))
        assert 0.0 <= uniform.min().item() and uniform.max().item() < 1.0


def test_remat_attention_stream_reads_four_keys_per_call():
    """remat.reference.attention_dropout_keep: row r = (b*Hq + h)*N + i of the [B, Hq, N, M]
    probabilities takes, for key j, word j % 4 of the call at counter offset + r*ceil(M/4) + j // 4
    (M = 7 leaves a partial group at each row's end)."""
    seed, offset, p = 99, 2**40 + 3, 0.4
    b, hq, n, m = 2, 3, 5, 7
    theirs = remat.reference.attention_dropout_keep(seed, offset, (b, hq, n, m), p)
    row = np.arange(b * hq * n, dtype=np.uint64)[:, None]
    key = np.arange(m, dtype=np.uint64)[None, :]
    words = philox_words(seed, row * np.uint64((m + 3) // 4) + key // np.uint64(4) + np.uint64(offset))
    word = np.take_along_axis(words, (key % np.uint64(4)).astype(np.int64)[..., None].repeat(b * hq * n, 0), -1)[..., 0]
    mine = torch.from_numpy(uniform_from_word(word) >= np.float32(p)).view(b, hq, n, m)
    assert torch.equal(theirs, mine)
    assert 0 < int(mine.sum()) < mine.numel()


def run_dropout(x, p, backend):
    """y = remat.dropout(x, p) and the (seed, offset) it drew: the 16-byte int64 pair that
    remat.dropout keeps for backward (README), taken from what autograd saves."""
    saved = []

    def pack(t):
        saved.append(t)
        return t

    x = x.detach().requires_grad_()
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        y = remat.dropout(x, p, backend=backend)
    pairs = [t for t in saved if t.dtype == torch.int64 and t.shape == (2,)]
    assert len(pairs) == 1, f"expected one saved int64 (seed, offset) pair, saw {[(t.dtype, t.shape) for t in saved]}"
    seed, offset = (int(v) for v in pairs[0])
    return y.detach(), seed, offset


DROPOUT_BACKENDS = ("cpp", "torch", "triton")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("p", [0.1, 0.5, 0.9])
@pytest.mark.parametrize("backend", DROPOUT_BACKENDS)
def test_dropout_mask_is_the_local_philox_stream(backend, p, dtype):
    """Element i of the contiguous input is kept iff the uniform of word i % 4 of Philox(seed,
    offset + i // 4) is >= p; kept
    values are x / (1 - p) divided in fp32 and rounded once; the keep share is 1 - p within a
    binomial 5-sigma band."""
    require_backend(backend)
    g = torch.Generator().manual_seed(int(p * 10))
    x = torch.randn(3, 97, 211, generator=g).to(dtype)  # 61,401 elements, no power of two
    x = torch.where(x == 0, torch.ones((), dtype=dtype), x)
    torch.manual_seed(1234)
    y, seed, offset = run_dropout(x, p, backend)
    keep = keep_mask(seed, offset, x.numel(), p).view(x.shape)
    kept = y != 0
    mismatches = int((kept != keep).sum())
    assert mismatches == 0, f"{backend}: {mismatches} of {x.numel()} elements disagree with the local Philox stream"
    expected = torch.where(keep, x.float() / torch.tensor(1 - p, dtype=torch.float32), 0.0).to(dtype)
    assert torch.equal(y, expected), f"{backend}: kept values are not x / (1 - p) rounded once"
    n = x.numel()
    share = keep.double().mean().item()
    sigma = math.sqrt(p * (1 - p) / n)
    assert abs(share - (1 - p)) <= 5 * sigma, f"keep share {share:.5f}, expected {1 - p} +- {5 * sigma:.5f}"


def test_dropout_masks_differ_between_draws_and_replay_under_manual_seed():
    x = torch.randn(4096)
    torch.manual_seed(5)
    y1, seed1, offset1 = run_dropout(x, 0.5, "torch")
    y2, seed2, offset2 = run_dropout(x, 0.5, "torch")
    torch.manual_seed(5)
    y3, seed3, offset3 = run_dropout(x, 0.5, "torch")
    assert (seed1, offset1) != (seed2, offset2) and not torch.equal(y1 != 0, y2 != 0)
    assert (seed3, offset3) == (seed1, offset1) and torch.equal(y3, y1)


# ------------------------------------------------------------------------------------------------
# Activation formulas of the torch backend

STOCK_ACTIVATIONS = {
    "silu": F.silu,
    "gelu": lambda g: F.gelu(g, approximate="none"),
    "gelu_tanh": lambda g: F.gelu(g, approximate="tanh"),
}


def _gates64():
    g = torch.Generator().manual_seed(2)
    return torch.cat([torch.linspace(-12, 12, 2001, dtype=torch.float64),
                      torch.randn(2000, generator=g, dtype=torch.float64) * 3,
                      torch.tensor([0.0, -0.0, 1e-30, -1e-30], dtype=torch.float64)])


EPS64 = 2.0**-53
_TANH_INNER = math.sqrt(2 / math.pi)


def formula_terms(activation, g, derivative):
    """Per element, the magnitude the float64 formula's error scales with where it cancels: 1 + erf
    and 1 + tanh for negative g (error ~ eps * |g| in the value, ~ eps in the derivative), 1 - s in
    silu' and 1 - tanh^2 in gelu_tanh' for large |g|."""
    a = g.abs()
    if not derivative:
        return a
    if activation == "silu":
        return 1 + a
    if activation == "gelu":
        return torch.ones_like(g)
    return 1 + a * _TANH_INNER * (1 + 3 * 0.044715 * g * g)


def assert_formula_close(name, value, expected, terms, rtol=1e-13):
    """|value - expected| <= rtol * |expected| + 16 eps64 * terms (+ 1e-300), element by element."""
    bound = rtol * expected.abs() + 16 * EPS64 * terms + 1e-300
    excess = ((value - expected).abs() / bound).max().item()
    assert excess <= 1.0, f"{name}: error {excess:.3g} x the per-element float64 bound"


@pytest.mark.parametrize("activation", sorted(STOCK_ACTIVATIONS))
def test_torch_backend_activation_matches_stock_in_float64(activation):
    _, activate = find_internal("activate")
    g = _gates64()
    value = activate(g, activation)
    assert value.dtype == torch.float64
    assert_formula_close(activation, value, STOCK_ACTIVATIONS[activation](g), formula_terms(activation, g, False))


@pytest.mark.parametrize("activation", sorted(STOCK_ACTIVATIONS))
def test_torch_backend_activation_derivative_matches_autograd_in_float64(activation):
    _, activate_grad = find_internal("activate_grad")
    g = _gates64().requires_grad_()
    (expected,) = torch.autograd.grad(STOCK_ACTIVATIONS[activation](g).sum(), g)
    g = g.detach()
    assert_formula_close(f"{activation}'", activate_grad(g, activation), expected, formula_terms(activation, g, True))


def test_activation_checks_tell_the_variants_apart():
    """The bounds above have teeth: erf gelu vs its tanh approximation, and a derivative off by
    one part in 10^9, fail them."""
    _, activate = find_internal("activate")
    _, activate_grad = find_internal("activate_grad")
    g = _gates64()
    with pytest.raises(AssertionError, match="float64 bound"):
        assert_formula_close("swapped", activate(g, "gelu_tanh"), STOCK_ACTIVATIONS["gelu"](g),
                             formula_terms("gelu", g, False))
    grad = activate_grad(g, "silu")
    with pytest.raises(AssertionError, match="float64 bound"):
        assert_formula_close("scaled", grad * (1 + 1e-9), grad, formula_terms("silu", g, True))
