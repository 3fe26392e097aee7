"""Host offload of what patched decoder layers keep (remat.patch(offload=True), remat.offload):
bitwise the same gradients, host bytes accounted, device bytes after the forward reduced by what
went to the host (fake CUDA, the estimator), nothing kept once backward ran."""

import copy
import pickle

import pytest
import torch

import remat
from remat.offload import MIN_BYTES, HostOffload
from remat.planning.estimator import estimate, on_fake_device

transformers = pytest.importorskip("transformers")

CONFIG = dict(vocab_size=256, hidden_size=256, intermediate_size=640, num_hidden_layers=3, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=4096)
# Long enough that a layer's saved [tokens, hidden] tensors pass MIN_BYTES (2 x 1024 x 256 x 4 = 2 MiB).
SHAPE = (2, 1024)


def llama(seed=0):
    torch.manual_seed(seed)
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(**CONFIG))


def step(model, ids, position_ids=None, report=None):
    """(loss, {name: grad}, host bytes after the forward)."""
    model.zero_grad(set_to_none=True)
    loss = model(input_ids=ids, labels=ids, position_ids=position_ids).loss
    host = report.offload.host_bytes if report is not None and report.offload is not None else None
    loss.backward()
    grads = {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}
    return loss.detach(), grads, host


def ids(seed=1):
    return torch.randint(0, 256, SHAPE, generator=torch.Generator().manual_seed(seed))


def assert_same(a, b):
    (loss_a, grads_a, _), (loss_b, grads_b, _) = a, b
    assert torch.equal(loss_a, loss_b)
    assert grads_a.keys() == grads_b.keys() and grads_a
    for name in grads_a:
        assert torch.equal(grads_a[name], grads_b[name]), name


@pytest.mark.parametrize("policy", ["speed", "balanced", "memory"])
def test_offload_gives_bitwise_the_same_gradients(policy):
    plain, offloaded = llama(), llama()
    remat.patch(plain, policy=policy)
    report = remat.patch(offloaded, policy=policy, offload=True)
    batch = ids()
    reference = step(plain, batch)
    result = step(offloaded, batch, report=report)
    assert_same(reference, result)
    # What went to the host during the forward came back (and was freed) in the backward.
    assert result[2] > 0
    assert report.offload.host_bytes == 0
    assert report.offload.copied_bytes >= result[2]


def test_offload_under_torch_compile_copies_what_eager_copies():
    # The offload's saved-tensor hooks are a context dynamo does not trace: the graph breaks around
    # each layer, whose compiled body's saved tensors still pass through the hooks. The same bytes
    # go to the host as in eager, and the gradients are eager's (up to the compiled kernels' rounding).
    torch._dynamo.reset()
    eager, compiled = llama(), llama()
    reports = [remat.patch(model, policy="memory", offload=True) for model in (eager, compiled)]
    batch = ids()
    want = step(eager, batch, report=reports[0])
    got = step(torch.compile(compiled), batch, report=reports[1])
    assert reports[1].offload.copied_bytes == reports[0].offload.copied_bytes > 0
    assert got[2] == want[2] > 0 and reports[1].offload.host_bytes == 0
    torch.testing.assert_close(got[0], want[0], rtol=1e-5, atol=1e-6)
    for name, grad in want[1].items():
        torch.testing.assert_close(got[1][f"_orig_mod.{name}"], grad, rtol=1e-4, atol=1e-6, msg=name)


def test_offload_of_packed_rows_and_under_gradient_checkpointing():
    positions = torch.cat([torch.arange(600), torch.arange(424)])[None].expand(2, -1)
    for checkpointing in (False, True):
        plain, offloaded = llama(), llama()
        remat.patch(plain, policy="memory")
        report = remat.patch(offloaded, policy="memory", offload=True)
        if checkpointing:
            for model in (plain, offloaded):
                model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
                model.train()
        batch = ids()
        reference = step(plain, batch, positions)
        result = step(offloaded, batch, positions, report)
        assert_same(reference, result)
        assert result[2] > 0


def test_offload_with_peft_lora():
    peft = pytest.importorskip("peft")
    models = []
    for offload in (False, True):
        model = peft.get_peft_model(llama(), peft.LoraConfig(r=8, lora_alpha=16, target_modules="all-linear",
                                                             lora_dropout=0.1))
        model.train()
        report = remat.patch(model, policy="memory", offload=offload)
        models.append((model, report))
    batch = ids()
    torch.manual_seed(5)
    reference = step(models[0][0], batch)
    torch.manual_seed(5)
    result = step(models[1][0], batch, report=models[1][1])
    assert_same(reference, result)
    assert result[2] > 0


def test_host_bytes_are_what_the_layers_save_from_min_bytes_up():
    # What each layer saves, recorded without offload by a pack hook around each layer's forward:
    # the offload copies the storage spans of the non-parameter views of MIN_BYTES or more, each
    # span once per layer (a tensor and its reshape share one copy).
    plain = llama()
    remat.patch(plain, policy="memory")
    spans, small = [], []

    def pack(t):
        nbytes = t.numel() * t.element_size()
        if not isinstance(t, torch.nn.Parameter) and not isinstance(t._base, torch.nn.Parameter):
            (spans if nbytes >= MIN_BYTES else small)[-1].add(
                (t.untyped_storage()._cdata, t.storage_offset() * t.element_size(), nbytes))
        return t

    hooks = []

    def enter(module, args):
        spans.append(set())
        small.append(set())
        hooks.append(torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t))
        hooks[-1].__enter__()

    def leave(module, args, output):
        hooks.pop().__exit__(None, None, None)

    handles = [layer.register_forward_pre_hook(enter) for layer in plain.model.layers]
    handles += [layer.register_forward_hook(leave) for layer in plain.model.layers]
    batch = ids()
    plain(input_ids=batch, labels=batch).loss.backward()
    for handle in handles:
        handle.remove()
    # Distinct (storage, offset, size) spans per layer; the memory policy's views of one storage
    # cover the same span (a reshape) or disjoint ones.
    expected = sum(nbytes for layer in spans for _, _, nbytes in layer)
    assert expected > 0 and any(small)  # both kinds occur

    offloaded = llama()
    report = remat.patch(offloaded, policy="memory", offload=True)
    loss = offloaded(input_ids=batch, labels=batch).loss
    assert report.offload.host_bytes == expected
    assert report.offload.peak_host_bytes == expected
    loss.backward()
    assert report.offload.host_bytes == 0
    with torch.no_grad():
        offloaded(input_ids=batch)
    assert report.offload.copied_bytes == expected  # no graph: nothing saved, nothing copied


def test_an_abandoned_graph_frees_its_host_copies():
    model = llama()
    report = remat.patch(model, policy="memory", offload=True)
    batch = ids()
    loss = model(input_ids=batch, labels=batch).loss
    assert report.offload.host_bytes > 0
    del loss
    import gc

    gc.collect()
    assert report.offload.host_bytes == 0


def test_on_fake_cuda_the_host_takes_what_the_device_kept():
    config = transformers.LlamaConfig(**CONFIG)
    with torch.device("meta"):
        plain, offloaded = (transformers.LlamaForCausalLM(config).to(torch.bfloat16) for _ in range(2))
    for model in (plain, offloaded):
        on_fake_device(model)
    remat.patch(plain, policy="memory")
    report = remat.patch(offloaded, policy="memory", offload=True)
    without = estimate(plain, seq_len=8192)
    with_offload = estimate(offloaded, seq_len=8192)
    assert without.host_bytes == 0 and with_offload.host_bytes > 0
    # After the forward the device holds less by at least what went to the host, less the last
    # layer's (its backward comes first: it is fetched back at once) and a prefetched layer.
    per_layer = with_offload.host_bytes / CONFIG["num_hidden_layers"]
    saved_on_device = without.after_forward_bytes - with_offload.after_forward_bytes
    assert saved_on_device >= with_offload.host_bytes - 2 * per_layer
    assert with_offload.breakdown["saved"] < without.breakdown["saved"]
    assert report.offload.host_bytes == 0  # fake copies are accounted and gone after the estimate


@pytest.mark.parametrize("checkpointing", [False, True])
def test_without_prefetch_the_gradients_are_the_same_and_one_layer_less_is_on_the_device(checkpointing):
    from remat.replacement import set_layer_options

    batch = ids()
    reference = step(llama(), batch)
    peaks = {}
    for prefetch in (True, False):
        model = llama()
        report = remat.patch(model, policy="memory")
        set_layer_options(model, report, offload=True, checkpointing=checkpointing, prefetch=prefetch)
        assert report.offload.prefetch is prefetch
        got = step(model, batch)
        assert torch.equal(got[0], reference[0])
        for name, grad in got[1].items():
            torch.testing.assert_close(grad, reference[1][name], rtol=1e-4, atol=2e-6)
        if prefetch:
            with_prefetch = got
        else:
            assert_same(got, with_prefetch)  # fetching later moves no value
        config = transformers.LlamaConfig(**CONFIG)
        with torch.device("meta"):
            fake = transformers.LlamaForCausalLM(config).to(torch.bfloat16)
        on_fake_device(fake)
        fake_report = remat.patch(fake, policy="memory")
        set_layer_options(fake, fake_report, offload=True, checkpointing=checkpointing, prefetch=prefetch)
        peaks[prefetch] = estimate(fake, seq_len=8192)
    # Without prefetch the device peak drops (by at most the prefetched layer: another moment of
    # the step may then hold the peak).
    assert peaks[False].host_bytes == peaks[True].host_bytes
    assert peaks[False].peak_bytes < peaks[True].peak_bytes


def test_a_patched_model_with_offload_pickles_and_copies():
    model = llama()
    remat.patch(model, policy="memory", offload=True)
    batch = ids()
    reference = step(model, batch)
    for clone in (copy.deepcopy(model), pickle.loads(pickle.dumps(model))):
        assert_same(reference, step(clone, batch))


def test_bad_offload_arguments():
    with pytest.raises(TypeError, match="offload must be a bool"):
        remat.patch(llama(), offload="yes")
    with pytest.raises(ValueError, match="policy='auto'"):
        remat.patch(llama(), policy="auto", offload=True, budget_bytes=10**6,
                    example_inputs={"input_ids": ids(), "labels": ids()})
    with pytest.raises(ValueError, match="min_bytes"):
        HostOffload(min_bytes=-1)
    with pytest.raises(TypeError, match="prefetch"):
        HostOffload(prefetch=1)
    assert MIN_BYTES == 1 << 20


@pytest.mark.gpu
@pytest.mark.parametrize("checkpointing", [False, True])
def test_gpu_offload_gives_bitwise_the_same_gradients_and_moves_bytes_off_the_device(checkpointing):
    # The CUDA path: side stream, pinned host memory, events, record_stream.
    results = []
    for offload in (False, True):
        model = llama().to("cuda", torch.bfloat16)
        report = remat.patch(model, policy="memory", offload=offload)
        if checkpointing:
            model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
            model.train()
        batch = ids().cuda()
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated()
        loss = model(input_ids=batch, labels=batch).loss
        torch.cuda.synchronize()
        kept = torch.cuda.memory_allocated() - before
        loss.backward()
        torch.cuda.synchronize()
        results.append((loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}, kept,
                        report.offload.host_bytes if offload else 0))
    (loss_a, grads_a, kept_a, _), (loss_b, grads_b, kept_b, host_after) = results
    assert torch.equal(loss_a, loss_b)
    for name in grads_a:
        assert torch.equal(grads_a[name], grads_b[name]), name
    assert kept_b < kept_a and host_after == 0


def test_host_pieces_are_powers_of_two_but_the_last_and_cover_the_bytes():
    from remat.offload import PIECE_MIN_BYTES, host_pieces

    for nbytes in (1, 2 << 20, (2 << 20) + 1, 3 * 2**20 + 100, int(8.5 * 2**30), 2**33 + 12345):
        pieces = host_pieces(nbytes)
        assert pieces[0][0] == 0 and sum(size for _, size in pieces) == nbytes
        assert all(a + sa == b for (a, sa), (b, _) in zip(pieces, pieces[1:]))  # contiguous, in order
        assert all(size & (size - 1) == 0 and size >= PIECE_MIN_BYTES for _, size in pieces[:-1])
    assert host_pieces(int(8.5 * 2**30)) == [(0, 2**33), (2**33, 2**29)]


def test_the_host_copy_in_pieces_gives_bitwise_the_same_gradients_past_several_pieces():
    """A layer's kept span of 3 MiB + 100 elements' bytes is copied as 2 MiB + the rest and gathered
    back exactly (the CPU path of the pinned pieces)."""
    from remat.offload import host_pieces

    plain, offloaded = llama(), llama()
    remat.patch(plain, policy="memory")
    report = remat.patch(offloaded, policy="memory", offload=True)
    batch = torch.randint(0, 256, (3, 1100), generator=torch.Generator().manual_seed(3))  # 3 x 1100 x 256 x 4 bytes
    assert len(host_pieces(3 * 1100 * 256 * 4)) == 2
    reference, result = step(plain, batch), step(offloaded, batch, report=report)
    assert_same(reference, result)
    assert result[2] > 0 and report.offload.host_bytes == 0


def test_the_estimates_host_bytes_are_the_pieces_as_the_pinned_allocator_holds_them():
    """On fake CUDA a [N, H] bf16 input of 8.5 x 2^20 bytes per layer (checkpointed, offloaded)
    holds 8 + 0.5 MiB of pinned pieces per layer, where one block of it would hold 16 MiB."""
    from remat.offload import host_pieces
    from remat.planning.estimator import pinned_host_bytes

    with torch.device("meta"):
        model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**CONFIG)).to(torch.bfloat16)
    on_fake_device(model)
    report = remat.patch(model, policy="memory", offload=True)
    model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
    tokens = 17 * 1024  # 17 x 1024 x 256 x 2 bytes = 8.5 MiB per layer input
    result = estimate(model, seq_len=tokens)
    per_layer = sum(pinned_host_bytes(size) for _, size in host_pieces(tokens * 256 * 2))
    assert per_layer == int(8.5 * 2**20) < pinned_host_bytes(tokens * 256 * 2) == 16 * 2**20
    assert result.host_bytes == CONFIG["num_hidden_layers"] * per_layer
    assert report.offload is not None
