"""Builders and runners shared by the test modules (a test module never imports another):
the backends that run here, strided inputs and leaves, the norm / MLP / attention cases and their
float64-reference runs under the 2x-stock rule (_checks.py)."""

import contextlib

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

import remat
from remat import backend as backend_mod
from remat.autograd.common import draw_rng_state
from remat.memory import saved_bytes
from remat.reference import (
    attention_dropout_keep,
    attention_reference,
    layer_norm_reference,
    rms_norm_reference,
    stock_layer_norm,
    stock_rms_norm,
)

from _checks import assert_within_2x_of_stock

DTYPES = [torch.float32, torch.float16, torch.bfloat16]


def cpu_backends():
    names = ["torch"]
    if backend_mod.unavailable_reason("cpp", torch.device("cpu")) is None:
        names.append("cpp")
    if backend_mod.unavailable_reason("triton", torch.device("cpu")) is None:
        names.append("triton")
    return names


def gpu_backends():
    device = torch.device("cuda")
    return [b for b in ("cuda", "triton") if backend_mod.unavailable_reason(b, device) is None] if \
        torch.cuda.is_available() else ["cuda", "triton"]


def leaf(t):
    """A fresh leaf with t's values and t's strides (clone() would make strided views contiguous)."""
    if t is None:
        return None
    leaf = torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device=t.device)
    with torch.no_grad():
        leaf.copy_(t)
    return leaf.requires_grad_(True)


def grads(fn, tensors, dy):
    """Output and gradients of every tensor; the leaves keep the inputs' strides."""
    leaves = [leaf(t) for t in tensors]
    out = fn(*leaves)
    present = [t for t in leaves if t is not None]
    grads = torch.autograd.grad(out, present, dy)
    return [out.detach()] + list(grads)


def assert_grads_within_2x_of_stock(fn, reference, tensors, dy, dtype):
    """``fn``'s output and input gradients (:func:`grads`) against ``reference`` run in float64,
    each within twice ``reference``'s own error in ``dtype`` (the 2x rule); returns (got, stock,
    want), the three :func:`grads` lists."""
    got = grads(fn, tensors, dy)
    stock = grads(reference, tensors, dy)
    want = grads(reference, [None if t is None else t.double() for t in tensors], dy.double())
    for i, (g, s, w) in enumerate(zip(got, stock, want, strict=True)):
        assert_within_2x_of_stock(f"output {i}", g, s, w, dtype)
    return got, stock, want


def strided(shape, dtype, device, generator, mode):
    """A tensor of `shape` whose layout is: contiguous, row-strided (a column slice of a wider
    tensor) or column-strided (every other column)."""
    *lead, n = shape
    if mode == "row_strided":
        base = torch.randn(*lead, n + 3, generator=generator, device=device).to(dtype)
        return base[..., :n]
    if mode == "col_strided":
        base = torch.randn(*lead, 2 * n, generator=generator, device=device).to(dtype)
        return base[..., ::2]
    return torch.randn(*shape, generator=generator, device=device).to(dtype)


def make_case(kind, lead, n, dtype, variant, device="cpu", seed=0):
    """Inputs (x, weight, bias, residual) and upstream gradients (dy, dh) for one test case."""
    g = torch.Generator(device=device).manual_seed(seed)
    shape = (*lead, n)
    noncontig = variant == "noncontiguous"
    x_layout = {"noncontiguous": "row_strided", "col_strided": "col_strided"}.get(variant, "contiguous")
    x = strided(shape, dtype, device, g, x_layout)
    affine = variant != "no_affine"
    weight = (1 + 0.5 * torch.randn(n, generator=g, device=device)).to(dtype) if affine else None
    bias = (0.5 * torch.randn(n, generator=g, device=device)).to(dtype) if affine and kind == "layer" else None
    use_residual = variant in ("residual", "noncontiguous")
    residual = strided(shape, dtype, device, g, "col_strided" if noncontig else "contiguous") if use_residual else None
    dy = strided(shape, dtype, device, g, "col_strided" if noncontig else "contiguous")
    dh = torch.randn(shape, generator=g, device=device).to(dtype) if use_residual else None
    return x, weight, bias, residual, dy, dh


def run_norm(fn, kind, x, weight, bias, residual, dy, dh, eps, **kwargs):
    """Forward and backward of one implementation; returns outputs and gradients by name."""
    leaves = {"x": leaf(x), "weight": leaf(weight), "bias": leaf(bias), "residual": leaf(residual)}
    args = (leaves["x"], leaves["weight"]) + ((leaves["bias"],) if kind == "layer" else ())
    out = fn(*args, eps, residual=leaves["residual"], **kwargs)
    outputs = {"y": out[0], "h": out[1]} if residual is not None else {"y": out}
    grads_out = [dy] + ([dh] if residual is not None else [])
    inputs = [(k, v) for k, v in leaves.items() if v is not None]
    grads = torch.autograd.grad(list(outputs.values()), [v for _, v in inputs], grads_out)
    result = {k: v.detach() for k, v in outputs.items()}
    result.update({f"d{k}": gr for (k, _), gr in zip(inputs, grads)})
    return result


def check_against_reference(kind, lead, n, dtype, variant, backend, device="cpu"):
    x, weight, bias, residual, dy, dh = make_case(kind, lead, n, dtype, variant, device)
    eps = 1e-6 if kind == "rms" else 1e-5
    remat_fn = remat.rms_norm if kind == "rms" else remat.layer_norm
    stock_fn = stock_rms_norm if kind == "rms" else stock_layer_norm
    ref_fn = rms_norm_reference if kind == "rms" else layer_norm_reference

    def to64(t):
        return None if t is None else t.detach().cpu().double()

    got = run_norm(remat_fn, kind, x, weight, bias, residual, dy, dh, eps, backend=backend)
    stock = run_norm(stock_fn, kind, x, weight, bias, residual, dy, dh, eps)
    ref = run_norm(ref_fn, kind, to64(x), to64(weight), to64(bias), to64(residual), to64(dy), to64(dh), eps)
    assert set(got) == set(ref)
    for name in ref:
        assert got[name].dtype == dtype, f"{name} has dtype {got[name].dtype}"
        assert_within_2x_of_stock(name, got[name].cpu(), stock[name].cpu(), ref[name], dtype)


def eager_gated(x, wg, wu, wd, bg, bu, bd, activation):
    act = {"silu": F.silu, "gelu": F.gelu, "gelu_tanh": lambda t: F.gelu(t, approximate="tanh")}[activation]
    return F.linear(act(F.linear(x, wg, bg)) * F.linear(x, wu, bu), wd, bd)


def eager_gelu(x, wfc, bfc, wproj, bproj, activation):
    approximate = "none" if activation == "gelu" else "tanh"
    return F.linear(F.gelu(F.linear(x, wfc, bfc), approximate=approximate), wproj, bproj)


def case(name, b, n, m, hq, hkv, d, **options):
    return pytest.param(dict(b=b, n=n, m=m, hq=hq, hkv=hkv, d=d, **options), id=name)


def random_rope_tables(batch, length, d, kind, g):
    angles = torch.rand(batch if kind == "per_batch" else 1, length, d // 2, generator=g) * 6.0
    if kind == "shared":
        angles = angles[0]
    return angles.cos(), angles.sin()


def make_inputs(spec, dtype, seed=0, device="cpu"):
    """q, k, v (in the case's layout, possibly non-contiguous), dout, and the rope tables, drawn
    on the CPU and moved to ``device``."""
    g = torch.Generator().manual_seed(seed)
    b, n, m, hq, hkv, d = (spec[key] for key in ("b", "n", "m", "hq", "hkv", "d"))
    scale_up = 3.0 if spec.get("softcap") else 1.0

    def rnd(length, heads):
        if spec.get("layout") == "bhnd":
            return (torch.randn(b, heads, length, d, generator=g) * scale_up).to(dtype)
        if spec.get("noncontiguous"):
            return (torch.randn(b, length, heads, d + 8, generator=g) * scale_up).to(dtype)[..., 3 : 3 + d]
        return (torch.randn(b, length, heads, d, generator=g) * scale_up).to(dtype)

    q, k, v = rnd(n, hq), rnd(m, hkv), rnd(m, hkv)
    dout = rnd(n, hq)
    rope = random_rope_tables(b, m + 5, d, spec["rope"], g) if spec.get("rope") else None
    if device != "cpu":
        q, k, v, dout = (t.to(device) for t in (q, k, v, dout))
        rope = tuple(t.to(device) for t in rope) if rope is not None else None
    return q, k, v, dout, rope


def attention_eager(q, k, v, dout, rope, spec, keep, dtype):
    """o, dq, dk, dv of eager attention in ``dtype`` (float64 for the reference), in [B, N, H, D],
    computed on q's device (on a GPU: cuBLAS in the dtype, fast float64; the CPU would take seconds
    per case at the GPU tests' sizes) and returned on the CPU."""
    device = q.device
    leaves = [t.detach().to(dtype).requires_grad_() for t in (q, k, v)]
    rope_d = tuple(t.to(device, dtype) for t in rope) if rope is not None else None
    keep = keep.to(device) if keep is not None else None
    o = attention_reference(*leaves, causal=spec.get("causal", False), keep=keep, dropout_p=spec.get("dropout", 0.0),
                            rope=rope_d, window=spec.get("window"), softcap=spec.get("softcap"))
    o.backward(dout.to(device, dtype))
    return [t.cpu() for t in [o.detach()] + [t.grad for t in leaves]]


def run_and_check(spec, dtype, backend, deterministic=True, device="cpu"):
    """Runs remat.attention on the case and checks o, dq, dk, dv against the float64 reference
    under the 2x-stock rule (stock: the same eager computation in ``dtype``), both computed on
    ``device``. Returns remat's outputs (on the CPU)."""
    q, k, v, dout, rope = make_inputs(spec, dtype, device=device)
    layout = spec.get("layout", "bnhd")
    leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    dropout = spec.get("dropout", 0.0)
    torch.manual_seed(1234)
    rng = draw_rng_state(device).cpu()
    torch.manual_seed(1234)
    with contextlib.nullcontext() if deterministic else deterministic_mode(False):
        o = remat.attention(*leaves, causal=spec.get("causal", False), dropout_p=dropout, rope=rope,
                            window=spec.get("window"), softcap=spec.get("softcap"), deterministic=deterministic,
                            layout=layout, backend=backend)
        o.backward(dout)
    got = [o.detach().cpu()] + [t.grad.cpu() for t in leaves]
    if layout == "bhnd":
        q, k, v, dout = (t.transpose(1, 2) for t in (q, k, v, dout))
        got = [t.transpose(1, 2) for t in got]
    keep = None
    if dropout:
        keep = attention_dropout_keep(rng[0], rng[1], (spec["b"], spec["hq"], spec["n"], spec["m"]), dropout)
    reference = attention_eager(q, k, v, dout, rope, spec, keep, torch.float64)
    stock = attention_eager(q, k, v, dout, rope, spec, keep, dtype)
    for name, value, stock_value, ref in zip(("o", "dq", "dk", "dv"), got, stock, reference):
        assert value.dtype == dtype
        assert_within_2x_of_stock(name, value, stock_value, ref, dtype)
    return got


def mask_from_output(backend, b, hq, n, m, p, seed, device="cpu", dtype=torch.float32):
    """The dropout mask a backend applied, read back from its output: with q = 0 every visible
    probability is 1/M, and with v = I (M = D) row i of o is keep[i, :] / (M (1 - p))."""
    q = torch.zeros(b, n, hq, m, device=device, dtype=dtype)
    v = torch.eye(m, device=device, dtype=dtype)[None, :, None, :].expand(b, m, 1, m).contiguous()
    k = torch.randn(b, m, 1, m, device=device, dtype=dtype)
    torch.manual_seed(seed)
    o = remat.attention(q, k, v, dropout_p=p, backend=backend)
    return ((o.float() * m * (1 - p)).transpose(1, 2) > 0.5).cpu()


@contextlib.contextmanager
def deterministic_mode(enabled):
    """torch.use_deterministic_algorithms(enabled) inside the block, restored after. The suite runs
    with it on (tests/conftest.py: NaN-filled empty tensors); the atomic attention backward
    (deterministic=False) refuses to run under it, as PyTorch's nondeterministic ops do, so the
    tests of that path turn it off (and lose the NaN fill there)."""
    previous = (torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled())
    torch.use_deterministic_algorithms(enabled)
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(previous[0], warn_only=previous[1])


class OpCalls(TorchDispatchMode):
    """A dispatch spy: records every call of the operators ``ops`` (OpOverloads) made inside it as
    (operator, args, kwargs, output), in order, in ``calls``; ``ops`` is kept as ``OPS``."""

    def __init__(self, ops):
        super().__init__()
        self.OPS = tuple(ops)
        self.calls = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func in self.OPS:
            self.calls.append((func, args, kwargs or {}, out))
        return out


class CompileCounter:
    """A torch.compile backend that counts the frames (graphs) it is given and runs them eagerly:
    one frame means no graph break."""

    def __init__(self):
        self.frames = 0

    def __call__(self, gm, example_inputs):
        self.frames += 1
        return gm.forward


def _transformers():
    """transformers, imported when a model is built (the modules that build models skip without it)."""
    import transformers

    return transformers


# Tiny Hugging Face models built from configs (no downloads), for the model-family and patching tests.
HIDDEN, INTER, HEADS, KV_HEADS, HEAD_DIM = 64, 160, 4, 2, 16
BATCH, LENGTH = 2, 11


def llama_config(kind="llama", **overrides):
    common = dict(vocab_size=96, hidden_size=HIDDEN, intermediate_size=INTER, num_hidden_layers=2,
                  num_attention_heads=HEADS, num_key_value_heads=KV_HEADS, max_position_embeddings=64,
                  use_cache=False, attn_implementation="eager")
    common.update(overrides)
    if kind == "llama":
        return _transformers().LlamaConfig(**common)
    if kind == "mistral":
        return _transformers().MistralConfig(sliding_window=4, **common)
    return _transformers().Qwen2Config(**common)


def causal_lm(kind, dtype=torch.float32, seed=0, **overrides):
    torch.manual_seed(seed)
    config = llama_config(kind, **overrides)
    model = {"llama": _transformers().LlamaForCausalLM, "mistral": _transformers().MistralForCausalLM,
             "qwen2": _transformers().Qwen2ForCausalLM}[kind](config)
    if kind == "qwen2":
        assert model.model.layers[0].self_attn.q_proj.bias is not None
    return model.to(dtype)


def batch(vocab=96, seed=1):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, (BATCH, LENGTH), generator=g)
    mask = torch.ones(BATCH, LENGTH, dtype=torch.long)
    # Right padding, 3 pads: fewer than Mistral's window of 4, since a pad query whose window holds
    # only pads makes the stock eager model produce NaN (a fully masked softmax row), which then
    # reaches real tokens through 0 * NaN in the next layer.
    mask[1, 8:] = 0
    labels = ids.masked_fill(mask == 0, -100)
    return ids, mask, labels


def logits_and_grads(model, ids, mask, labels):
    """(logits, loss, {parameter name: gradient}) of one step. The loss and gradients come from a
    forward with labels (a patched causal LM in training mode computes that loss fused, without
    logits); the logits from a second forward without labels."""
    model.zero_grad(set_to_none=True)
    out = model(input_ids=ids, attention_mask=mask, labels=labels)
    out.loss.backward()
    grads = {name: p.grad.detach().clone() for name, p in model.named_parameters()}
    with torch.no_grad():
        logits = model(input_ids=ids, attention_mask=mask).logits
    return logits.detach(), out.loss.detach(), grads


def loss_and_grads(model, ids):
    """(loss, {parameter name: gradient}) of one training step of a causal LM on ``ids`` (labels =
    ids), gradients set to None first; parameters without a gradient left out."""
    model.zero_grad(set_to_none=True)
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def gpt2_model(dtype=torch.float32, seed=0, dropout=0.0):
    torch.manual_seed(seed)
    config = _transformers().GPT2Config(n_embd=HIDDEN, n_head=HEADS, n_layer=2, vocab_size=96, n_positions=32,
                                     attn_pdrop=dropout, resid_pdrop=dropout, embd_pdrop=0.0, use_cache=False,
                                     attn_implementation="eager")
    return _transformers().GPT2LMHeadModel(config).to(dtype)


# Tiny sparse mixture-of-experts models (tests/models/test_mixtral.py, test_qwen3_moe.py).
MOE_TOP_K, MOE_EXPERT_INTER = 2, 40


def starve_an_expert(model, starved, free_layer, norm_suffixes=("layernorm.weight",)):
    """Random norm weights (names ending in ``norm_suffixes``) and routers, then layer 0's router
    never picks expert ``starved``: every embedding gets a large feature 0 (so the normalized input's
    feature 0 is large and positive for every token), on which that router's row ``starved`` has a
    large negative weight and the other rows a positive one; layer ``free_layer``'s router ignores
    feature 0. Call on the fp32 model, before any cast."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(norm_suffixes):
                p.normal_(1.0, 0.2)
            elif name.endswith("mlp.gate.weight"):
                p.normal_(0.0, 0.5)
        model.model.embed_tokens.weight[:, 0] = 3.0
        for layer in model.model.layers:
            layer.post_attention_layernorm.weight[0] = 1.0
        router = model.model.layers[0].mlp.gate.weight
        router[:, 0] = 0.1
        router[starved, 0] = -1.0
        model.model.layers[free_layer].mlp.gate.weight[:, 0] = 0.0


def moe_step(model, ids, mask, labels):
    """(logits, loss, aux_loss, router logits per layer, {parameter: gradient}) of one training step
    with output_router_logits (the loss includes the load-balancing loss); logits from a second
    forward without labels."""
    model.zero_grad(set_to_none=True)
    out = model(input_ids=ids, attention_mask=mask, labels=labels, output_router_logits=True)
    out.loss.backward()
    grads = {name: p.grad.detach().clone() for name, p in model.named_parameters()}
    with torch.no_grad():
        logits = model(input_ids=ids, attention_mask=mask).logits
    return logits, out.loss.detach(), out.aux_loss.detach(), [r.detach() for r in out.router_logits], grads


def moe_layer_bytes_per_token(policy, element, weight_element):
    """Bytes per token a remat MoE decoder layer keeps (remat.nn.moe.MoELayerMixin) at the tiny
    sizes above, with routing weights of ``weight_element`` bytes."""
    q_width, kv_width = HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM
    memory = element * (2 * HIDDEN + q_width) + 4 * HEADS + 8 + MOE_TOP_K * (8 + weight_element)
    balanced = memory + element * (q_width + 2 * kv_width)
    speed = balanced + 2 * MOE_EXPERT_INTER * MOE_TOP_K * element
    return {"memory": memory, "balanced": balanced, "speed": speed}[policy]


def check_moe_model_against_stock(reference, stock, patched, dtype, chosen):
    """One training step (:func:`moe_step`) of ``patched`` against the float64 ``reference`` within 2x
    of ``stock``: logits, loss, aux loss, router logits (real rows) and every gradient; the experts
    the reference's routers pick per sparse layer are ``chosen``. Returns the patched step."""
    ids, mask, labels = batch()
    real = mask.bool()
    want, base, got = (moe_step(m, ids, mask, labels) for m in (reference, stock, patched))
    assert [logits.topk(MOE_TOP_K, dim=-1).indices.unique().tolist() for logits in want[3]] == chosen
    assert_within_2x_of_stock("logits", got[0][real], base[0][real], want[0][real], dtype)
    for i, name in ((1, "loss"), (2, "aux_loss")):
        assert_within_2x_of_stock(name, got[i].reshape(1), base[i].reshape(1), want[i].reshape(1), dtype)
    assert len(got[3]) == len(want[3]) == len(chosen)
    rows = real.flatten()
    for layer, (value, stock_value, ref) in enumerate(zip(got[3], base[3], want[3])):
        # [B N, E] rows as stock; pad rows (which the aux loss masks out) are not compared: a layer that
        # runs a padded batch packed routes real tokens only, and its pad rows are zeros.
        assert value.dtype == dtype and value.shape == ref.shape
        assert_within_2x_of_stock(f"router_logits[{layer}]", value[rows], stock_value[rows], ref[rows], dtype)
    assert set(got[4]) == set(want[4])
    for name in want[4]:
        assert_within_2x_of_stock(name, got[4][name], base[4][name], want[4][name], dtype)
    return got


def moe_layer_inputs(model, dtype):
    """(x [BATCH, LENGTH, HIDDEN] requiring grad, positions, the model's rope tables)."""
    x = torch.randn(BATCH, LENGTH, HIDDEN, dtype=dtype, requires_grad=True)
    positions = torch.arange(LENGTH)[None].expand(BATCH, LENGTH)
    return x, positions, model.model.rotary_emb(x, positions)


def check_moe_policies_against_stock_layer(model, stock, layer_class, weight_element, dtype):
    """The stock decoder layer ``stock`` keeps more than every policy of ``layer_class`` built from
    it; each policy keeps exactly :func:`moe_layer_bytes_per_token` (plus the rope tables the model
    passes), as measured and as its saved_bytes_per_token says."""
    x, positions, rope = moe_layer_inputs(model, dtype)
    mask = torch.full((LENGTH, LENGTH), float("-inf")).triu(1).to(dtype)[None, None]
    eager = saved_bytes(stock, x, attention_mask=mask, position_embeddings=rope, position_ids=positions)
    saved = {p: saved_bytes(layer_class.from_module(stock, policy=p, backend="torch"), x, position_embeddings=rope)
             for p in ("speed", "balanced", "memory")}
    assert eager > saved["speed"] > saved["balanced"] > saved["memory"]
    tables = 2 * rope[0].numel() * rope[0].element_size()
    for policy, value in saved.items():
        formula = moe_layer_bytes_per_token(policy, x.element_size(), weight_element)
        assert layer_class.from_module(stock, policy=policy).saved_bytes_per_token(x.element_size()) == formula
        assert value == BATCH * LENGTH * formula + tables, policy


def compiled_and_eager_steps(model, ids, mask, labels):
    """One step of ``model`` compiled (fullgraph, counting frames) and one eager, on the same batch:
    (graph frames, compiled output, eager output, {name: compiled grad}, {name: eager grad})."""
    torch._dynamo.reset()
    counter = CompileCounter()
    compiled = torch.compile(model, backend=counter, fullgraph=True)
    out = compiled(input_ids=ids, attention_mask=mask, labels=labels)
    out.loss.backward()
    compiled_grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    eager = model(input_ids=ids, attention_mask=mask, labels=labels)
    eager.loss.backward()
    eager_grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    return counter.frames, out, eager, compiled_grads, eager_grads


def real_shaped_per_token(layer, head_dim, n=64):
    """Saved bytes per token of a layer built on the meta device, with bf16 rope tables passed as
    the model passes them (Parameters here, so left out like the model's shared tables)."""
    with torch.device("meta"):
        x = torch.randn(1, n, layer.input_layernorm.weight.shape[0], dtype=torch.bfloat16, requires_grad=True)
        rope = tuple(torch.nn.Parameter(torch.randn(1, n, head_dim, dtype=torch.bfloat16), requires_grad=False)
                     for _ in range(2))
    return saved_bytes(layer, x, position_embeddings=rope) / n


def triton_bwd_sample(label, name, args, cos_index):
    """A sample as the Triton backward op takes it: without rope tables (remat.ops.attention rotates q
    and k once per pass outside the Triton kernels before a backward; its backward launchers
    refuse tables). Other ops' samples unchanged."""
    if label != "triton" or not name.endswith("_bwd"):
        return args
    return (*args[:cos_index], None, None, *args[cos_index + 2:])
