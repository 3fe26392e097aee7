"""remat.estimate: the predicted peak of a training step against the measured one (CPU), the graph
walk against the autograd engine, and estimates for fake CUDA models on this machine (no GPU)."""

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

import remat
from remat.planning.estimator import GraphWalk, estimate, is_fake

transformers = pytest.importorskip("transformers")
from torch.profiler._memory_profiler import Action, MemoryProfile  # noqa: E402


def llama(seed=0, dtype=torch.float32, **overrides):
    torch.manual_seed(seed)
    config = dict(vocab_size=256, hidden_size=64, intermediate_size=160, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=1024, attn_implementation="sdpa")
    config.update(overrides)
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(**config)).to(dtype)


def gpt2(seed=0):
    torch.manual_seed(seed)
    config = transformers.GPT2Config(n_embd=64, n_head=4, n_layer=2, vocab_size=256, n_positions=1024,
                                     attn_implementation="sdpa", resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    return transformers.GPT2LMHeadModel(config)


def set_up(model, setup):
    if setup == "patched":
        remat.patch(model)
    elif setup == "checkpointing":
        model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
        model.train()
    return model


SETUPS = ["stock", "patched", "checkpointing"]


def measured_peak(model, batch_size, seq_len):
    """The peak of live CPU tensor bytes over one real step, from the profiler's allocator records
    (every allocation and free of the CPU allocator, tensors existing before the step included):
    a measurement independent of the estimator's dispatch-mode count."""
    ids = torch.zeros(batch_size, seq_len, dtype=torch.long)
    model.zero_grad(set_to_none=True)

    def step():
        loss = model(input_ids=ids, labels=ids, use_cache=False).loss
        loss.backward()

    peak = profiled_peak(step)
    model.zero_grad(set_to_none=True)
    return peak


def profiled_peak(step):
    """The most CPU tensor bytes alive at once while ``step()`` runs, from the profiler's allocator
    records (tensors existing before it included)."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True,
                                record_shapes=True, with_stack=True) as prof:
        step()
    current = peak = 0
    for _, action, _, nbytes in MemoryProfile(prof.profiler.kineto_results).timeline:
        if action in (Action.PREEXISTING, Action.CREATE):
            current += nbytes
        elif action == Action.DESTROY:
            current -= nbytes
        peak = max(peak, current)
    return peak


@pytest.mark.parametrize("build", [llama, gpt2], ids=["llama", "gpt2"])
@pytest.mark.parametrize("setup", SETUPS)
@pytest.mark.parametrize("shape", [(2, 96), (1, 300)], ids=["2x96", "1x300"])
def test_estimate_equals_the_measured_peak_of_a_real_cpu_step(build, setup, shape):
    model = set_up(build(), setup)
    before = {name: p.detach().clone() for name, p in model.named_parameters()}
    predicted = estimate(model, batch_size=shape[0], seq_len=shape[1])
    # The model is not touched: no gradients, the same weights.
    assert all(p.grad is None for p in model.parameters())
    assert all(torch.equal(before[name], p) for name, p in model.named_parameters())
    actual = measured_peak(model, *shape)
    assert abs(predicted.peak_bytes - actual) <= 0.01 * actual, (predicted, actual)
    assert predicted.host_bytes == 0
    assert predicted.breakdown["parameters"] == sum(p.numel() * p.element_size() for p in model.parameters()) + sum(
        b.numel() * b.element_size() for b in model.buffers())
    assert sum(predicted.breakdown.values()) == predicted.peak_bytes
    assert predicted.peak_bytes == max(predicted.phases.values())


@pytest.mark.parametrize("options", [{"tile_tokens": 32}, {"policy": "memory", "tile_tokens": 32}],
                         ids=["tiled", "memory+tiled"])
@pytest.mark.parametrize("shape", [(2, 96), (1, 300)], ids=["2x96", "1x300"])
def test_a_tiled_step_estimate_equals_the_measured_peak(options, shape):
    """A tiled step's peak is inside the CPU flash attention backward of one query tile (its
    per-thread blocks of probabilities: 2-7% of this model's peak), which the estimate counts
    (remat.planning.estimator.cpu_flash_attention_scratch_bytes): within 1% of the real CPU step."""
    model = llama()
    remat.patch(model, **options)
    predicted = estimate(model, batch_size=shape[0], seq_len=shape[1])
    actual = measured_peak(model, *shape)
    assert abs(predicted.peak_bytes - actual) <= 0.01 * actual, (predicted, actual)


def _profiled_call(call):
    """(outputs, the most bytes the call's allocations reach above what existed before it) of
    ``call()`` on real CPU tensors, from the profiler's allocator records."""
    from torch._C._profiler import _EventType
    from torch.profiler._memory_profiler import OpTree

    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True) as prof:
        outputs = call()
    sizes = sorted((e.start_time_ns, e.typed[1].alloc_size) for e in OpTree(prof.profiler.kineto_results).dfs()
                   if e.typed[0] == _EventType.Allocation)
    current = peak = 0
    for _, nbytes in sizes:
        current += nbytes
        peak = max(peak, current)
    return outputs, peak


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("grad_layout", ["tokens-major", "heads-major"])
@pytest.mark.parametrize("sizes", [(1, 32, 64, 4, 2, 16), (2, 96, 96, 4, 2, 16), (1, 300, 300, 4, 4, 32)],
                         ids=["tile", "2x96", "1x300"])
def test_cpu_flash_attention_scratch_is_counted_for_the_call(sizes, grad_layout, threads):
    """PyTorch's CPU flash attention kernels allocate per-thread buffers inside the call (and the
    backward a contiguous grad_out where it is not one): in fp32, the profiler's peak of a real
    call is its outputs plus remat.planning.estimator.cpu_flash_attention_scratch_bytes, less the dsum rows
    of the threads other than the caller (the profiler records the calling thread's allocations)."""
    from remat.planning.estimator import cpu_flash_attention_scratch_bytes

    batch, n, m, heads, kv_heads, dim = sizes
    forward = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default
    backward = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward.default
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        torch.manual_seed(0)
        q = torch.randn(batch, n, heads, dim).transpose(1, 2)  # remat's layout: [B, N, H, D] storage
        k, v = (torch.randn(batch, m, kv_heads, dim).transpose(1, 2) for _ in range(2))
        (o, lse), peak = _profiled_call(lambda: forward(q, k, v, 0.0, n == m, scale=0.25)[:2])
        outputs = o.untyped_storage().nbytes() + lse.untyped_storage().nbytes()
        assert peak == outputs + cpu_flash_attention_scratch_bytes(forward, (q, k, v, 0.0, n == m))
        dout = torch.randn(batch, n, heads, dim)
        dout = dout.transpose(1, 2) if grad_layout == "tokens-major" else dout.transpose(1, 2).contiguous()
        args = (dout, q, k, v, o, lse, 0.0, n == m)
        grads, peak = _profiled_call(lambda: backward(*args, scale=0.25))
        outputs = sum(g.untyped_storage().nbytes() for g in grads)
        q_split = min(n, 64 if n >= 192 else 32)
        unseen = (min(threads, batch * heads) - 1) * q_split * 4
        scratch = cpu_flash_attention_scratch_bytes(backward, args)
        assert peak == outputs + scratch - unseen
        copy = dout.numel() * 4 if grad_layout == "heads-major" else 0
        assert scratch == threads * 2 * q_split * min(m, 512) * 4 + min(threads, batch * heads) * q_split * 4 + copy
    finally:
        torch.set_num_threads(before)
    assert cpu_flash_attention_scratch_bytes(torch.ops.aten.mm.default, (q, k)) == 0


def test_patched_llama_peaks_lower_than_stock_and_the_estimate_grows_with_the_sequence():
    stock, patched = llama(), llama()
    remat.patch(patched)
    stock_short, patched_short = (estimate(m, seq_len=128) for m in (stock, patched))
    stock_long, patched_long = (estimate(m, seq_len=512) for m in (stock, patched))
    assert patched_long.peak_bytes < stock_long.peak_bytes
    assert stock_short.peak_bytes < stock_long.peak_bytes
    assert patched_short.peak_bytes < patched_long.peak_bytes
    assert patched_long.breakdown["saved"] < stock_long.breakdown["saved"]


def test_adam_states_add_two_fp32_copies_of_the_trainable_parameters():
    model = llama()
    model.model.embed_tokens.weight.requires_grad_(False)
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    without = estimate(model, seq_len=64)
    with_adam = estimate(model, seq_len=64, optimizer="adam")
    assert with_adam.breakdown["optimizer"] == 8 * trainable
    assert with_adam.peak_bytes == without.peak_bytes + 8 * trainable
    # ZeRO-1/2: each of 8 ranks holds an eighth of every state (rounded up per parameter).
    sharded = estimate(model, seq_len=64, optimizer="adam", optimizer_shards=8)
    per_rank = sum(8 * -(-p.numel() // 8) for p in model.parameters() if p.requires_grad)
    assert sharded.breakdown["optimizer"] == per_rank < 8 * trainable / 7
    assert sharded.peak_bytes == without.peak_bytes + per_rank


def _walk_and_engine_grads(model, ids):
    model.zero_grad(set_to_none=True)
    model(input_ids=ids, labels=ids, use_cache=False).loss.backward()
    engine = {name: p.grad.clone() for name, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    walk = GraphWalk()
    with walk.saving():
        loss = model(input_ids=ids, labels=ids, use_cache=False).loss
    walk.backward(loss)
    walked = {name: p.grad.clone() for name, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    return engine, walked




@pytest.mark.parametrize("setup", SETUPS)
def test_graph_walk_computes_the_engines_gradients_bitwise(setup):
    model = set_up(llama(), setup)
    ids = torch.randint(0, 256, (2, 40), generator=torch.Generator().manual_seed(3))
    engine, walked = _walk_and_engine_grads(model, ids)
    assert engine.keys() == walked.keys()
    for name in engine:
        assert torch.equal(engine[name], walked[name]), name


@pytest.mark.parametrize("setup", SETUPS)
def test_graph_walk_reaches_the_engines_peak(setup):
    model = set_up(llama(), setup)
    engine = estimate(model, batch_size=2, seq_len=200, walk=False)
    walked = estimate(model, batch_size=2, seq_len=200, walk=True)
    assert walked.peak_bytes == engine.peak_bytes
    assert walked.phases == engine.phases


def test_graph_walk_refuses_a_root_without_a_graph():
    with pytest.raises(RuntimeError, match="does not require grad"):
        GraphWalk().backward(torch.ones(()))
    x = torch.ones(3, requires_grad=True)
    with pytest.raises(RuntimeError, match="scalar"):
        GraphWalk().backward(x * 2)


def fake_cuda_llama(**overrides):
    """A bfloat16 Llama on fake CUDA tensors, built in its dtype (``.to`` cannot swap fake
    parameters: module._apply's swap_tensors refuses them)."""
    config = dict(vocab_size=256, hidden_size=64, intermediate_size=160, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=1024, attn_implementation="sdpa")
    config.update(overrides)
    with FakeTensorMode(), torch.device("cuda"):
        return transformers.AutoModelForCausalLM.from_config(transformers.LlamaConfig(**config), dtype=torch.bfloat16)


@pytest.mark.parametrize("patched", [False, True], ids=["stock", "patched"])
def test_a_fake_cuda_model_is_estimated_without_a_gpu(patched):
    model = fake_cuda_llama()
    assert is_fake(next(model.parameters())) and next(model.parameters()).device.type == "cuda"
    if patched:
        remat.patch(model)
    peaks = [estimate(model, seq_len=n).peak_bytes for n in (256, 512, 768)]
    # Linear in the sequence: SDPA runs as the fused kernels would (a math kernel's [N, N] scores
    # would make the second step larger than the first).
    assert peaks[0] < peaks[1] < peaks[2]
    assert abs((peaks[2] - peaks[1]) - (peaks[1] - peaks[0])) <= 0.02 * (peaks[1] - peaks[0])
    # The CUDA caching allocator's 512-byte blocks.
    assert estimate(model, seq_len=256).breakdown["parameters"] % 512 == 0


def test_a_patched_fake_cuda_model_peaks_lower_than_stock():
    stock, patched = fake_cuda_llama(), fake_cuda_llama()
    remat.patch(patched)
    assert estimate(patched, seq_len=1024).peak_bytes < estimate(stock, seq_len=1024).peak_bytes


def test_bad_arguments_raise_before_any_step():
    model = llama()
    with pytest.raises(TypeError, match="nn.Module"):
        estimate(object(), seq_len=8)
    for bad in (0, -1, 2.5, True):
        with pytest.raises(ValueError, match="seq_len"):
            estimate(model, seq_len=bad)
        with pytest.raises(ValueError, match="batch_size"):
            estimate(model, seq_len=8, batch_size=bad)
    with pytest.raises(ValueError, match="optimizer"):
        estimate(model, seq_len=8, optimizer="sgd")
    with pytest.raises(TypeError, match="inputs"):
        estimate(model, seq_len=8, inputs=[1])
    with pytest.raises(ValueError, match="no parameters"):
        estimate(torch.nn.ReLU(), seq_len=8)


class TwoLayerLoss(torch.nn.Module):
    """Not a Hugging Face model: its forward takes x and returns a scalar loss."""

    def __init__(self):
        super().__init__()
        self.first, self.second = torch.nn.Linear(64, 256), torch.nn.Linear(256, 64)

    def forward(self, x):
        return self.second(torch.nn.functional.gelu(self.first(x))).square().mean()


def test_any_module_with_given_inputs_is_estimated_as_measured():
    torch.manual_seed(0)
    model = TwoLayerLoss()
    x = torch.randn(512, 64)
    predicted = estimate(model, seq_len=1, inputs={"x": x})
    assert x.grad is None and all(p.grad is None for p in model.parameters())  # the model is not touched
    peak = profiled_peak(lambda: model(x).backward())
    # The input existed before the step in the real run (the profiler sees it as preexisting); the
    # estimate counts the parameters and what the step makes, the fake copy of x included as made.
    assert abs(predicted.peak_bytes - peak) <= 0.01 * peak


@pytest.mark.gpu
@pytest.mark.parametrize("setup", SETUPS)
def test_gpu_estimate_of_a_fake_cuda_model_against_the_real_peak(setup):
    # The CUDA target's stand-ins (allocator blocks, SDPA's kernels, remat's kernel choice) against
    # torch.cuda.max_memory_allocated of the same step on the GPU: within 5% (kernels' own
    # workspaces are not counted).
    config = dict(vocab_size=256, hidden_size=256, intermediate_size=640, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=8192, attn_implementation="sdpa")
    torch.manual_seed(0)
    real = set_up(transformers.LlamaForCausalLM(transformers.LlamaConfig(**config)).to("cuda", torch.bfloat16), setup)
    with torch.device("meta"):
        fake = transformers.LlamaForCausalLM(transformers.LlamaConfig(**config)).to(torch.bfloat16)
    from remat.planning.estimator import on_fake_device

    fake = set_up(on_fake_device(fake), setup)
    predicted = estimate(fake, seq_len=4096, cuda_capability=torch.cuda.get_device_capability())
    ids = torch.zeros(1, 4096, dtype=torch.long, device="cuda")
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    real(input_ids=ids, labels=ids, use_cache=False).loss.backward()
    torch.cuda.synchronize()
    # Less the ids: the estimate counts what the step makes, not its inputs.
    actual = torch.cuda.max_memory_allocated() - 4096 * 8
    assert abs(predicted.peak_bytes - actual) <= 0.05 * actual, (predicted.peak_bytes, actual)


def test_cuda_attention_backward_scratch_is_counted_for_the_call():
    from remat.planning.estimator import CUDA_BLOCK_BYTES, LiveBytes, kernel_scratch_bytes

    batch, n, heads, kv_heads, dim = 1, 300, 4, 2, 64
    with FakeTensorMode(allow_non_fake_inputs=True):
        q = torch.empty(batch, n, heads, dim, dtype=torch.bfloat16, device="cuda")
        k, v = (torch.empty(batch, n, kv_heads, dim, dtype=torch.bfloat16, device="cuda") for _ in range(2))
        o, dout = torch.empty_like(q), torch.empty_like(q)
        lse = torch.empty(batch, heads, n, dtype=torch.float32, device="cuda")
        empty = torch.empty(0, dtype=torch.int64, device="cuda")
        flash = (torch.ops.aten._flash_attention_backward.default,
                 (dout, q, k, v, o, lse, empty, empty, n, n, 0.0, True, empty, empty))
        as_heads = [t.transpose(1, 2) for t in (dout, q, k.repeat_interleave(2, 2), v.repeat_interleave(2, 2), o)]
        cudnn = (torch.ops.aten._scaled_dot_product_cudnn_attention_backward.default,
                 (*as_heads, lse.unsqueeze(-1), empty, empty, None, None, None, n, n, 0.0, True))
        # FlashAttention-2: fp32 dq accumulator over 384 rows (300 rounded to 128) and D 64, fp32
        # softmax_d, bf16 dk and dv expanded to the 4 query heads (GQA).
        assert kernel_scratch_bytes(*flash) == 4 * 384 * heads * 64 + 4 * 384 * heads + 2 * n * heads * dim * 2
        assert kernel_scratch_bytes(*cudnn) == 4 * n * heads * (dim + 1)
        assert kernel_scratch_bytes(torch.ops.aten.mm.default, (q, k)) == 0
        for func, args in (flash, cudnn):
            tracker = LiveBytes("cuda", CUDA_BLOCK_BYTES)
            with tracker:
                grads = func(*args)
            outputs = sum(-(-g.untyped_storage().nbytes() // CUDA_BLOCK_BYTES) * CUDA_BLOCK_BYTES for g in grads)
            scratch = -(-kernel_scratch_bytes(func, args) // CUDA_BLOCK_BYTES) * CUDA_BLOCK_BYTES
            assert tracker.current == outputs and tracker.peak == outputs + scratch
            tracker.close()


def qwen3_moe(dtype=torch.bfloat16, seed=0):
    """A tiny Qwen3MoeForCausalLM (8 experts, top-2) with Hugging Face's default experts
    (grouped_mm: static shapes, 16-bit weights)."""
    torch.manual_seed(seed)
    config = transformers.Qwen3MoeConfig(
        vocab_size=256, hidden_size=64, intermediate_size=128, moe_intermediate_size=32, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_experts=8, num_experts_per_tok=2,
        max_position_embeddings=1024, attn_implementation="sdpa")
    return transformers.Qwen3MoeForCausalLM(config).to(dtype)


def test_stock_qwen3_moe_estimate_equals_the_measured_peak():
    """Hugging Face's grouped-GEMM experts have static shapes: no routing assumption, and the
    estimate equals a real CPU step's peak within 1%."""
    model = qwen3_moe()
    assert model.config._experts_implementation == "grouped_mm"
    predicted = estimate(model, batch_size=2, seq_len=96)
    assert predicted.assumptions == ()
    actual = measured_peak(model, 2, 96)
    assert abs(predicted.peak_bytes - actual) <= 0.01 * actual, (predicted, actual)


@pytest.mark.parametrize("options", [{}, {"policy": "memory", "offload": True}, {"tile_tokens": 32, "offload": True}],
                         ids=["balanced", "memory+offload", "tiled+offload"])
def test_patched_qwen3_moe_estimate_assumes_balanced_routing(options, monkeypatch):
    """remat's MoE block counts each expert's rows on the host, which fake tensors cannot: the
    estimate assumes balanced routing and says so. Held against a real CPU step whose per-expert
    row counts are made balanced the same way (the counts are all that sizes the block's
    temporaries), it is within 1%; a dense model's estimate assumes nothing."""
    from remat.autograd import moe

    # fp32: on the CPU the cpp backend's bf16 GEMMs allocate inside the fused loss's call, which the
    # estimate does not see (a CPU-only gap; remat.planning.estimator's docstring).
    model = qwen3_moe(torch.float32)
    remat.patch(model, **options)
    predicted = estimate(model, batch_size=2, seq_len=96)
    assert predicted.assumptions == (moe.BALANCED_ROUTING,)
    assert "assumed: mixture-of-experts routing" in str(predicted)
    monkeypatch.setattr(moe, "routed_counts", lambda flat, experts: moe.balanced_expert_counts(flat.numel(), experts))
    actual = measured_peak(model, 2, 96)
    # Tiled too: the tiled step's peak is inside the CPU flash attention backward of a query tile,
    # whose buffers the estimate counts (test_cpu_flash_attention_scratch_is_counted_for_the_call).
    assert abs(predicted.peak_bytes - actual) <= 0.01 * actual, (predicted, actual)
    assert estimate(llama(), seq_len=32).assumptions == ()


def test_balanced_expert_counts_split_the_pairs_evenly():
    from remat.autograd.moe import balanced_expert_counts

    assert balanced_expert_counts(10, 4) == [3, 3, 2, 2]
    assert balanced_expert_counts(8, 4) == [2, 2, 2, 2]
    assert balanced_expert_counts(3, 8) == [1, 1, 1, 0, 0, 0, 0, 0]


def test_a_fake_cuda_moe_model_is_estimated_without_a_gpu():
    """Qwen3-MoE on fake CUDA tensors: Hugging Face asks torch.cuda.get_device_capability before its
    grouped-GEMM experts, which the estimate answers with the simulated GPU's (no driver here);
    patched, the fused loss and remat's MoE blocks peak lower than stock."""
    from remat.planning.fit import build_model

    config = qwen3_moe().config
    stock = build_model(config, lora_rank=4, lora_targets=["q_proj", "k_proj", "v_proj", "o_proj"])
    patched = build_model(config, lora_rank=4, lora_targets=["q_proj", "k_proj", "v_proj", "o_proj"])
    report = remat.patch(patched)
    assert not report.left_alone or all("Qwen3MoeDecoderLayer" != kind for _, kind, _ in report.left_alone)
    before = torch.cuda.get_device_capability
    results = [estimate(m, seq_len=512) for m in (stock, patched)]
    assert torch.cuda.get_device_capability is before
    assert results[0].device.type == "cuda" and results[0].assumptions == ()
    assert results[1].peak_bytes < results[0].peak_bytes


def test_the_fused_loss_scratch_is_counted(monkeypatch):
    """remat's fused loss allocates inside its op (one chunk of logits, the fp32 dx accumulator),
    which a fake kernel does not: remat.planning.estimator.cross_entropy_scratch_bytes adds it. With a
    vocabulary of 16,384 and 2,048 tokens (two 64 MiB chunks of fp32 logits on the CPU) the step's
    peak is there: the estimate is within 1% of the real step, and without the scratch it would be
    less than half."""
    from remat.planning import estimator

    model = llama(vocab_size=16384)
    remat.patch(model)
    predicted = estimate(model, seq_len=2048)
    actual = measured_peak(model, 1, 2048)
    assert abs(predicted.peak_bytes - actual) <= 0.01 * actual, (predicted, actual)
    monkeypatch.setattr(estimator, "_CROSS_ENTROPY_OPS", {})
    monkeypatch.setattr(estimator, "_cross_entropy_ops", dict)  # no op gets scratch
    assert estimate(model, seq_len=2048).peak_bytes < actual / 2
