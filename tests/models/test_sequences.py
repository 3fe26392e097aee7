"""Sequences as people feed them to a patched model: padding anywhere in a row (right, left, holes)
and packed rows (documents one after another in one row, positions restarting at 0, with or
without an all-ones attention_mask, or with Hugging Face's cu_seq_lens_q/k arguments), on tiny
Llama, Mistral (sliding window), Qwen2 and GPT-2 models built from configs.

Padding: logits at every real position, the loss and every parameter gradient against the stock
model in the same dtype and a float64 copy (the 2x rule). Labels are -100 at pads and wherever the
token before is a pad (a logit at a pad after a real token predicts it, where stock's SDPA attends
the pad to the real tokens before it and remat gives it attention output 0; left padding with
standard labels, pads included: test_left_padding.py). Packed rows: against running each document
alone. Also torch.compile on a padded batch (one graph), attention-only patching and gradient
checkpointing with padding."""

import warnings

import pytest
import torch

import remat

from _checks import assert_within_2x_of_stock
from helpers import LENGTH, CompileCounter, causal_lm, gpt2_model

transformers = pytest.importorskip("transformers")

KINDS = ("llama", "mistral", "qwen2", "gpt2")
POLICIES = ("speed", "balanced", "memory")
# Documents of the packed row: lengths 4, 1, 6 (a one-token document among them).
DOCUMENTS = (4, 1, 6)


def build(kind, dtype=torch.float32, attn_implementation="sdpa", **overrides):
    """A tiny model; stock references use sdpa, whose fully masked (pad) query rows give 0, where
    eager's give NaN in float64 and spread it through 0 x NaN."""
    if kind == "gpt2":
        model = gpt2_model(dtype)
        model.config._attn_implementation = attn_implementation
        return model
    return causal_lm(kind, dtype, attn_implementation=attn_implementation, **overrides)


def padded_batch(layout, vocab=96):
    """ids, mask [2, 11] with 3 pads in the second row: at its end, at its start, or in its middle.
    Mistral's window (4) is wider than any run of pads (see helpers.batch)."""
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(0, vocab, (2, LENGTH), generator=g)
    mask = torch.ones(2, LENGTH, dtype=torch.long)
    pads = {"right": slice(8, 11), "left": slice(0, 3), "holes": slice(4, 7)}[layout]
    mask[1, pads] = 0
    return ids, mask


def labels_for(ids, mask):
    after_pad = torch.nn.functional.pad(mask[:, :-1], (1, 0), value=1) == 0
    return ids.masked_fill((mask == 0) | after_pad, -100)


def step(model, **inputs):
    """(logits, loss, {name: grad}) of a forward with labels and backward, and a forward without
    labels for the logits (a patched causal LM in training computes its loss fused, without
    logits)."""
    model.zero_grad(set_to_none=True)
    loss = model(**inputs).loss
    loss.backward()
    grads = {name: p.grad.detach().clone() for name, p in model.named_parameters()}
    inputs.pop("labels")
    with torch.no_grad():
        logits = model(**inputs).logits
    return logits, loss.detach(), grads


def check_against_stock(got, base, want, real, dtype):
    assert_within_2x_of_stock("logits", got[0][real], base[0][real], want[0][real], dtype)
    assert_within_2x_of_stock("loss", got[1].reshape(1), base[1].reshape(1), want[1].reshape(1), dtype)
    assert got[2].keys() == want[2].keys()
    for name in want[2]:
        assert_within_2x_of_stock(name, got[2][name], base[2][name], want[2][name], dtype)


CASES = [(kind, layout) for kind in KINDS for layout in ("right", "left", "holes")
         if (kind, layout) != ("mistral", "holes")]  # a window over holes: test_holes_under_a_sliding_window


@pytest.mark.parametrize("kind,layout", CASES, ids=[f"{k}-{lay}" for k, lay in CASES])
def test_padding_anywhere_matches_stock(kind, layout):
    policy = POLICIES[CASES.index((kind, layout)) % 3]
    ids, mask = padded_batch(layout)
    inputs = dict(input_ids=ids, attention_mask=mask, labels=labels_for(ids, mask))
    want = step(build(kind, torch.float64), **inputs)
    base = step(build(kind), **inputs)
    patched = build(kind)
    remat.patch(patched, policy=policy)
    got = step(patched, **inputs)
    check_against_stock(got, base, want, mask.bool(), torch.float32)


@pytest.mark.parametrize("kind", KINDS)
def test_padding_in_bf16_matches_stock(kind):
    layout = {"llama": "left", "mistral": "right", "qwen2": "holes", "gpt2": "left"}[kind]
    ids, mask = padded_batch(layout)
    inputs = dict(input_ids=ids, attention_mask=mask, labels=labels_for(ids, mask))
    want = step(build(kind, torch.float64), **inputs)
    base = step(build(kind, torch.bfloat16), **inputs)
    patched = build(kind, torch.bfloat16)
    remat.patch(patched, policy=POLICIES[KINDS.index(kind) % 3])
    got = step(patched, **inputs)
    check_against_stock(got, base, want, mask.bool(), torch.bfloat16)


def test_holes_under_a_sliding_window():
    """With holes, the real tokens of a row run as one sequence and Mistral's window counts real
    tokens (as FlashAttention-2's unpadding does): each row equals the stock model run on the row
    without its pads, at the same positions."""
    ids, mask = padded_batch("holes")
    model = build("mistral")
    remat.patch(model, policy="memory")
    with torch.no_grad():
        logits = model(input_ids=ids, attention_mask=mask).logits
    stock = build("mistral")
    for row in range(2):
        real = mask[row].bool()
        positions = torch.arange(LENGTH)[real][None]
        ones = torch.ones(1, int(real.sum()), dtype=torch.long)  # no packed-row detection in stock
        with torch.no_grad():
            want = stock(input_ids=ids[row, real][None], position_ids=positions, attention_mask=ones).logits[0]
        torch.testing.assert_close(logits[row, real], want, rtol=1e-5, atol=1e-5)


def packed_row():
    g = torch.Generator().manual_seed(5)
    ids = torch.randint(0, 96, (1, sum(DOCUMENTS)), generator=g)
    positions = torch.cat([torch.arange(n) for n in DOCUMENTS])[None]
    labels = ids.clone()
    starts = torch.tensor([0, *DOCUMENTS[:-1]]).cumsum(0)
    labels[0, starts] = -100  # DataCollatorWithFlattening's labels: each document's first token ignored
    offsets = torch.nn.functional.pad(torch.tensor(DOCUMENTS).cumsum(0), (1, 0)).to(torch.int32)
    return ids, positions, labels, offsets, starts


def per_document_reference(model, ids, labels, starts):
    """Logits, loss and gradients of running each document alone, the loss taken as the packed
    row's (Hugging Face's shifted labels over the concatenated logits)."""
    model.zero_grad(set_to_none=True)
    logits = torch.cat([model(input_ids=ids[:, s : s + n]).logits for s, n in zip(starts.tolist(), DOCUMENTS,
                                                                                    strict=True)], 1)
    shifted = torch.nn.functional.pad(labels, (0, 1), value=-100)[:, 1:]
    loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), shifted.flatten(), ignore_index=-100)
    loss.backward()
    return logits.detach(), loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


PACKED = [(kind, variant) for kind in KINDS for variant in ("positions", "ones_mask", "cu_seq_lens")]


@pytest.mark.parametrize("kind,variant", PACKED, ids=[f"{k}-{v}" for k, v in PACKED])
def test_packed_rows_match_each_document_alone(kind, variant):
    ids, positions, labels, offsets, starts = packed_row()
    inputs = dict(input_ids=ids, position_ids=positions, labels=labels)
    if variant == "ones_mask":
        inputs["attention_mask"] = torch.ones_like(ids)
    if variant == "cu_seq_lens":
        inputs.update(cu_seq_lens_q=offsets, cu_seq_lens_k=offsets, max_length_q=max(DOCUMENTS),
                      max_length_k=max(DOCUMENTS))
    want = per_document_reference(build(kind, torch.float64), ids, labels, starts)
    base = per_document_reference(build(kind), ids, labels, starts)
    patched = build(kind)
    remat.patch(patched, policy=POLICIES[PACKED.index((kind, variant)) % 3])
    got = step(patched, **inputs)
    check_against_stock(got, base, want, torch.ones_like(ids, dtype=torch.bool), torch.float32)


def test_packed_rows_in_bf16():
    ids, positions, labels, _, starts = packed_row()
    want = per_document_reference(build("qwen2", torch.float64), ids, labels, starts)
    base = per_document_reference(build("qwen2", torch.bfloat16), ids, labels, starts)
    patched = build("qwen2", torch.bfloat16)
    remat.patch(patched)
    got = step(patched, input_ids=ids, position_ids=positions, labels=labels)
    check_against_stock(got, base, want, torch.ones_like(ids, dtype=torch.bool), torch.bfloat16)


@pytest.mark.parametrize("layout", ["left", "holes"])
def test_compile_with_a_padded_batch_is_one_graph(layout):
    """Under torch.compile the padding layout has fixed shapes (two sequences per row: its real tokens, then
    its pads), so a padded batch compiles to one graph (fullgraph) and matches the eager model."""
    torch._dynamo.reset()
    ids, mask = padded_batch(layout)
    inputs = dict(input_ids=ids, attention_mask=mask, labels=labels_for(ids, mask))
    model = build("llama")
    remat.patch(model)
    eager = step(model, **dict(inputs))
    counter = CompileCounter()
    compiled = torch.compile(model, backend=counter, fullgraph=True)
    got = step(compiled, **dict(inputs))
    real = mask.bool()
    torch.testing.assert_close(got[0][real], eager[0][real], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got[1], eager[1], rtol=1e-5, atol=1e-6)
    for name, g in eager[2].items():
        torch.testing.assert_close(got[2][f"_orig_mod.{name}"], g, rtol=1e-4, atol=1e-6)
    assert counter.frames == 2  # one graph for the forward with labels, one without


def test_attention_modules_alone_take_padding_and_packing():
    ids, mask = padded_batch("left")
    stock, patched = build("mistral"), build("mistral")
    report = remat.patch(patched, modules=("attention",))
    assert {old for _, old, _ in report.replaced} == {"MistralAttention"}
    inputs = dict(input_ids=ids, attention_mask=mask, labels=labels_for(ids, mask))
    got, want = step(patched, **inputs), step(stock, **inputs)
    real = mask.bool()
    torch.testing.assert_close(got[0][real], want[0][real], rtol=1e-5, atol=1e-5)
    for name, g in want[2].items():
        torch.testing.assert_close(got[2][name], g, rtol=1e-4, atol=1e-6)
    ids, positions, labels, _, starts = packed_row()
    want = per_document_reference(stock, ids, labels, starts)
    got = step(patched, input_ids=ids, position_ids=positions, labels=labels)
    torch.testing.assert_close(got[0], want[0], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got[1], want[1], rtol=1e-5, atol=1e-6)
    assert got[2].keys() == want[2].keys()
    for name, g in want[2].items():
        torch.testing.assert_close(got[2][name], g, rtol=1e-4, atol=1e-6)


def test_gradient_checkpointing_with_padding_keeps_the_gradients():
    ids, mask = padded_batch("holes")
    inputs = dict(input_ids=ids, attention_mask=mask, labels=labels_for(ids, mask))
    model = build("qwen2", attention_dropout=0.1)
    remat.patch(model)
    torch.manual_seed(0)
    plain = step(model, **dict(inputs))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        model.gradient_checkpointing_enable()
    torch.manual_seed(0)
    checkpointed = step(model, **dict(inputs))
    assert torch.equal(plain[1], checkpointed[1])
    for name, g in plain[2].items():
        assert torch.equal(checkpointed[2][name], g), name


def test_masks_that_are_not_padding_raise():
    model = build("llama")
    remat.patch(model)
    ids, mask = padded_batch("right")
    with pytest.raises(ValueError, match="2-D"):
        model(input_ids=ids, attention_mask=mask[:, None, None, :].float())
    layer = model.model.layers[0]
    x = torch.randn(2, LENGTH, 64)
    with pytest.raises(ValueError, match="padding mask"):
        layer(x, attention_mask=mask[:, :5])
    with pytest.raises(ValueError, match="cu_seq_lens"):
        layer(x, cu_seq_lens_q=torch.tensor([0, LENGTH], dtype=torch.int32))


@pytest.mark.parametrize("flash_kwargs", [False, True], ids=["positions", "cu_seq_lens"])
def test_hugging_face_flattening_collator(flash_kwargs):
    """A batch from Hugging Face's DataCollatorWithFlattening (one row, position_ids restarting,
    labels -100 at each document's first token; with return_flash_attn_kwargs the int32 offsets):
    loss and gradients equal the per-document reference."""
    ids, _, _, _, starts = packed_row()
    documents = [{"input_ids": ids[0, s : s + n].tolist()} for s, n in zip(starts.tolist(), DOCUMENTS, strict=True)]
    collated = transformers.DataCollatorWithFlattening(return_flash_attn_kwargs=flash_kwargs)(documents)
    assert ("cu_seq_lens_q" in collated) == flash_kwargs and "attention_mask" not in collated
    want = per_document_reference(build("llama"), collated["input_ids"], collated["labels"], starts)
    patched = build("llama")
    remat.patch(patched)
    got = step(patched, **collated)
    torch.testing.assert_close(got[0], want[0], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got[1], want[1], rtol=1e-5, atol=1e-6)
    for name, g in want[2].items():
        torch.testing.assert_close(got[2][name], g, rtol=1e-4, atol=1e-6)


def test_padding_layout_has_two_sequences_per_row():
    """The padding layout of a [3, 5] batch: per row its real tokens then its pads, 2B sequences
    (not one per pad: kernels' grids have a sequence limit), all tokens once, the pads marked as
    empty queries; under torch.compile (fixed shapes) max_seqlen is N, in eager the longest
    sequence."""
    from remat.sequences import sequence_layout

    real = torch.tensor([[0, 1, 1, 0, 1], [1, 1, 1, 1, 1], [0, 0, 0, 0, 0]], dtype=torch.bool)
    layout = sequence_layout(3, 5, real.long())
    assert layout.cu_seqlens.tolist() == [0, 3, 5, 10, 10, 10, 15]
    assert layout.tokens.tolist() == [1, 2, 4, 0, 3, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14]
    assert layout.empty.tolist() == [[False] * 3 + [True] * 2 + [False] * 5 + [True] * 5]
    assert layout.max_seqlen == 5
    right = sequence_layout(2, 3, torch.tensor([[1, 1, 1], [1, 1, 0]]))
    assert right.cu_seqlens is None and right.empty.tolist() == [[False] * 3, [False, False, True]]


def mask_config(kind):
    config = build(kind).config
    config._attn_implementation = "remat"
    return config


@pytest.mark.parametrize("kind", ["llama", "mistral"])
def test_mask_rules_other_than_causal_raise(kind):
    """transformers' mask builders hand the mask interface the model's rule: the causal and sliding
    rules (and packed rows) pass; a prefix-LM / image block (block_sequence_ids, PaliGemma and
    Gemma 3's token_type_ids) or an or/and mask function would be dropped by remat's causal layers,
    so they raise."""
    from transformers import masking_utils

    from remat.hf import register_attention

    register_attention()
    config = mask_config(kind)
    builder = (masking_utils.create_sliding_window_causal_mask if kind == "mistral"
               else masking_utils.create_causal_mask)
    embeds = torch.zeros(2, LENGTH, 8)
    positions = torch.arange(LENGTH)[None]
    ids, mask = padded_batch("left")
    assert torch.equal(builder(config, embeds, mask, cache=None, position_ids=positions), mask.bool())
    packed = torch.cat([torch.arange(n) for n in DOCUMENTS])[None]
    assert builder(config, embeds[:1, : sum(DOCUMENTS)], None, cache=None, position_ids=packed) is None
    blocks = torch.where(torch.arange(LENGTH) < 4, 0, -1)[None].expand(2, LENGTH)
    with pytest.raises(ValueError, match="mask rule"):
        builder(config, embeds, mask, cache=None, position_ids=positions, block_sequence_ids=blocks)
    with pytest.raises(ValueError, match="mask rule"):
        builder(config, embeds, None, cache=None, position_ids=positions,
                or_mask_function=masking_utils.blockwise_overlay(blocks))
    with pytest.raises(ValueError, match="mask rule"):
        masking_utils.create_causal_mask(config, embeds, None, cache=None, position_ids=positions,
                                         and_mask_function=masking_utils.padding_mask_function(mask.bool()))


def test_packed_rule_of_transformers_without_position_remapping(monkeypatch):
    """transformers 5.17 has no remap_positions_for_packed_sequence: its packed rule is
    and_masks(causal rule, packed_sequence_mask_function(...)), built here from the installed
    functions with the remapping removed; it passes, and other combinations still raise."""
    from transformers import masking_utils

    from remat import hf

    monkeypatch.delattr(masking_utils, "remap_positions_for_packed_sequence")
    packed = masking_utils.packed_sequence_mask_function(torch.zeros(1, LENGTH, dtype=torch.long))
    sliding = masking_utils.and_masks(masking_utils.sliding_window_overlay(4), masking_utils.causal_mask_function)
    hf.refuse_mask_rule(masking_utils.and_masks(masking_utils.causal_mask_function, packed), packed_allowed=True)
    hf.refuse_mask_rule(masking_utils.and_masks(sliding, packed), packed_allowed=True)
    with pytest.raises(ValueError, match="mask rule"):
        hf.refuse_mask_rule(masking_utils.and_masks(masking_utils.causal_mask_function, packed), packed_allowed=False)
    with pytest.raises(ValueError, match="mask rule"):
        hf.refuse_mask_rule(masking_utils.and_masks(masking_utils.bidirectional_mask_function, packed),
                            packed_allowed=True)


def test_patching_leaves_models_sharing_the_config_alone():
    """Two models built from one config object: patching one changes neither the other's config
    (attention implementation, use_cache) nor its outputs; unpatch gives the original back."""
    first = build("llama")
    config = first.config
    second = type(first)(config)
    second.load_state_dict(first.state_dict())
    ids, mask = padded_batch("left")
    with torch.no_grad():
        before = second(input_ids=ids, attention_mask=mask).logits
    settings = (config._attn_implementation, config.use_cache)
    remat.patch(first)
    assert first.config is not config and first.config._attn_implementation == "remat"
    assert first.model.layers[0]._remat_original.self_attn.config is first.config
    assert (second.config._attn_implementation, second.config.use_cache) == settings
    assert second.config is config and second.model.layers[0].self_attn.config is config
    with torch.no_grad():
        assert torch.equal(second(input_ids=ids, attention_mask=mask).logits, before)
    remat.unpatch(first)
    assert first.config is config and first.model.layers[0].self_attn.config is config
    assert (config._attn_implementation, config.use_cache) == settings


def test_offsets_with_a_padding_mask_or_wrong_sums_raise(monkeypatch):
    """cu_seq_lens_q/k describe a row without pads: with a mask that has a pad they raise, in the
    fused layers and in the attention function stock modules call; offsets that do not run from 0
    to the row length raise before the row is packed (GPT-2, no rope: positions are built from the
    offsets there, by repeat_interleave with the row length as output size)."""
    from remat.hf import hf_attention
    from remat.nn import layers

    _, _, _, offsets, _ = packed_row()
    n = sum(DOCUMENTS)
    mask = torch.ones(1, n, dtype=torch.long)
    mask[0, -2:] = 0
    model = build("llama")
    remat.patch(model)
    layer = model.model.layers[0]
    x = torch.randn(1, n, 64)
    flash = dict(cu_seq_lens_q=offsets, cu_seq_lens_k=offsets, max_length_q=6, max_length_k=6)
    with pytest.raises(ValueError, match="padding"):
        layer(x, attention_mask=mask, **flash)
    layer(x, attention_mask=torch.ones_like(mask), **flash)
    q = torch.randn(1, 2, n, 16)
    with pytest.raises(ValueError, match="padding"):
        hf_attention(layer, q, q, q, mask.bool(), **flash)
    gpt2 = build("gpt2")
    remat.patch(gpt2)
    short = offsets.clone()
    short[-1] -= 1

    def packed_before_the_check(*args):
        raise AssertionError("the row was packed before its offsets were checked")

    monkeypatch.setattr(layers, "pack_sequences", packed_before_the_check)
    for bad in (short, offsets + 1):
        with pytest.raises(ValueError, match="run from 0 to the row length"):
            gpt2(input_ids=torch.zeros(1, n, dtype=torch.long), cu_seq_lens_q=bad, cu_seq_lens_k=bad,
                 max_length_q=6, max_length_k=6)


def gemma3_multimodal():
    """A tiny Gemma 3 image-text model (SigLIP tower of one layer, 4 image tokens, id 95)."""
    text = dict(vocab_size=96, hidden_size=64, intermediate_size=160, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, head_dim=16, max_position_embeddings=64, sliding_window=4,
                layer_types=["sliding_attention", "full_attention"])
    vision = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, image_size=16,
                  patch_size=8)
    config = transformers.Gemma3Config(text_config=text, vision_config=vision, mm_tokens_per_image=4,
                                       image_token_index=95, boi_token_index=93, eoi_token_index=94)
    config._attn_implementation = "eager"
    torch.manual_seed(0)
    return transformers.Gemma3ForConditionalGeneration(config)


def test_image_blocks_of_a_multimodal_model_raise():
    """Gemma 3 lets image tokens attend to each other both ways (token_type_ids -> an or-mask rule):
    a patched model raises instead of running plain causal attention over them; text alone (the
    causal and sliding rules, built from the composite config's text_config, which is the patched
    copy) matches the stock model, and the shared configs are left as they were."""
    model = gemma3_multimodal()
    config = model.config
    ids = torch.randint(0, 90, (1, 12), generator=torch.Generator().manual_seed(0))
    ids[0, 2:6] = 95
    with torch.no_grad():
        want = model(input_ids=ids[:, 6:]).logits
    remat.patch(model)
    assert model.model.language_model.config is model.config.text_config
    assert model.config.text_config._attn_implementation == "remat"
    assert config.text_config._attn_implementation == config.vision_config._attn_implementation == "eager"
    with pytest.raises(ValueError, match="mask rule"):
        model(input_ids=ids, pixel_values=torch.randn(1, 3, 16, 16), token_type_ids=(ids == 95).long())
    with torch.no_grad():
        torch.testing.assert_close(model(input_ids=ids[:, 6:]).logits, want, rtol=1e-5, atol=1e-5)
    remat.unpatch(model)
    assert model.config is config and model.model.language_model.config is config.text_config


@pytest.mark.parametrize("kind", ["llama", "mistral", "gpt2"])
def test_packed_rows_run_tiled(kind, monkeypatch):
    # remat.patch(tile_tokens=4) on a packed row of 11 tokens (documents of 4, 1 and 6): every
    # layer's attention backward runs over query tiles (the varlen core per tile), no warning, and
    # the step equals each document run alone.
    from remat.autograd import norm_attention_tiled

    calls = []
    original = norm_attention_tiled.backward_tiled
    monkeypatch.setattr(norm_attention_tiled, "backward_tiled", lambda *a, **k: calls.append(1) or original(*a, **k))
    ids, positions, labels, _, starts = packed_row()
    want = per_document_reference(build(kind, torch.float64), ids, labels, starts)
    base = per_document_reference(build(kind), ids, labels, starts)
    patched = build(kind)
    remat.patch(patched, policy="memory", tile_tokens=4)
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)
        got = step(patched, input_ids=ids, position_ids=positions, labels=labels)
    layers = patched.config.num_hidden_layers
    assert len(calls) == layers
    check_against_stock(got, base, want, torch.ones_like(ids, dtype=torch.bool), torch.float32)


def test_packed_rows_under_compile_run_their_attention_untiled():
    # Under torch.compile the offsets are traced and a tile's sequences would be data: the layers
    # run a packed row's attention untiled (said once) and the compiled step equals the eager
    # tiled one. (Read as one sequence, the traced backward's gradients were wrong by up to 0.9.)
    from remat.nn import layers

    ids, positions, labels, offsets, _ = packed_row()
    inputs = dict(input_ids=ids, position_ids=positions, labels=labels, cu_seq_lens_q=offsets, cu_seq_lens_k=offsets,
                  max_length_q=max(DOCUMENTS), max_length_k=max(DOCUMENTS))
    eager, compiled = build("llama"), build("llama")
    for model in (eager, compiled):
        remat.patch(model, policy="memory", tile_tokens=4)
    want = step(eager, **dict(inputs))
    layers._UNTILED_ATTENTION_WARNED.clear()
    torch._dynamo.reset()
    with pytest.warns(UserWarning, match="packed rows are not tiled under torch.compile"):
        got = step(torch.compile(compiled), **dict(inputs))
    torch.testing.assert_close(got[1], want[1], rtol=1e-5, atol=1e-6)
    for name, grad in want[2].items():
        torch.testing.assert_close(got[2][f"_orig_mod.{name}"], grad, rtol=1e-4, atol=2e-6, msg=name)
