"""Packed vs padded training steps of a small Llama on one batch of documents of mixed lengths,
stock vs remat-patched (README, "Sequences: masks, packed rows, generation").

The same documents (fixed seed, lengths spread over 16..256) are fed two ways:

- padded: right padding to the longest document, ``attention_mask`` 0 at pads, labels -100 at
  pads; the model computes ``documents x longest`` token positions.
- packed: one row built by transformers' own ``DataCollatorWithFlattening`` (labels -100 at each
  document's first position, ``position_ids`` restarting at 0), either with ``position_ids`` only
  (the route Hugging Face's sdpa/eager masks detect; ``use_cache=False`` so the detection runs,
  hf_integration.md pitfall 1) or with the collator's ``cu_seq_lens_q/k`` and ``max_length_q/k``
  arguments as well (``return_flash_attn_kwargs=True``; only remat reads them, the stock sdpa model
  would ignore them, so stock runs the ``position_ids`` route alone).

Per configuration: the step time (forward with labels + backward) as a ratio to stock-padded,
measured side by side in interleaved rounds (benchmarks.common.interleaved_timings: median of the
per-round ratios, ``time_vs_stock_padded``, with its 20-80% band and verdict), and its inverse,
the ratio of real-token throughput (every configuration trains on the same real tokens, so tokens
per second scale as 1 / time); the peak of bytes saved for
backward over the step (remat.memory.PeakSavedBytes). The losses are checked before anything is
timed: every configuration must give stock-padded's loss within rounding (the same targets: each
document's tokens after its first), and the packed row run as one sequence (documents attending
across boundaries) must not, so the check can tell a leaking configuration from a correct one.
"""

import copy

import torch

import remat
from benchmarks.common import (
    Progress,
    environment_tags,
    interleaved_timings,
    loss_step,
    run_step,
    timing_summary,
    with_end_load,
)
from remat.memory import PeakSavedBytes

VOCAB = 2048
DOCUMENTS = 8
SHORTEST, LONGEST = 16, 256
# Relative loss difference that counts as rounding (fp32: the losses differ only in summation order).
LOSS_RTOL = 1e-5


def make_model(device):
    import transformers

    torch.manual_seed(0)
    hidden = 128
    config = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=hidden, intermediate_size=hidden * 8 // 3,
                                      num_hidden_layers=2, num_attention_heads=hidden // 32,
                                      num_key_value_heads=hidden // 64, max_position_embeddings=1024,
                                      use_cache=False, attn_implementation="sdpa")
    return transformers.LlamaForCausalLM(config).to(device=device, dtype=torch.float32).train()


def make_documents():
    """DOCUMENTS lists of token ids, lengths spread over [SHORTEST, LONGEST] (the extremes included)."""
    g = torch.Generator().manual_seed(7)
    lengths = torch.randint(SHORTEST, LONGEST + 1, (DOCUMENTS,), generator=g).tolist()
    lengths[0], lengths[1] = SHORTEST, LONGEST
    return [torch.randint(0, VOCAB, (n,), generator=g).tolist() for n in lengths]


def padded_batch(documents, device):
    """Right padding to the longest document: input_ids/attention_mask/labels [documents, longest]."""
    longest = max(len(d) for d in documents)
    ids = torch.zeros(len(documents), longest, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for row, doc in enumerate(documents):
        ids[row, : len(doc)] = torch.tensor(doc)
        mask[row, : len(doc)] = 1
    labels = ids.masked_fill(mask == 0, -100)
    return {"input_ids": ids.to(device), "attention_mask": mask.to(device), "labels": labels.to(device)}


def packed_batch(documents, device, flash_kwargs):
    """One row from transformers' DataCollatorWithFlattening; with ``flash_kwargs`` also its
    cu_seq_lens_q/k and max_length_q/k."""
    from transformers import DataCollatorWithFlattening

    collator = DataCollatorWithFlattening(return_flash_attn_kwargs=flash_kwargs)
    batch = collator([{"input_ids": doc} for doc in documents])
    return {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in batch.items()}


def configurations(base, documents, device):
    """(label, model, layout, inputs) per configuration."""
    padded = padded_batch(documents, device)
    packed_positions = packed_batch(documents, device, flash_kwargs=False)
    packed_offsets = packed_batch(documents, device, flash_kwargs=True)
    out = [("stock padded", base, "padded", padded), ("stock packed", base, "packed position_ids", packed_positions)]
    for policy in ("balanced", "memory"):
        model = copy.deepcopy(base)
        remat.patch(model, policy=policy)
        out += [(f"remat {policy} padded", model, "padded", padded),
                (f"remat {policy} packed", model, "packed position_ids", packed_positions),
                (f"remat {policy} packed cu_seq_lens", model, "packed cu_seq_lens", packed_offsets)]
    return out


def check_losses(losses, base, documents, device):
    """Raises AssertionError unless every configuration's loss equals stock-padded's within
    LOSS_RTOL, and unless the packed row run as one causal sequence (no position restarts: the
    documents see each other) differs from it by more, so the check discriminates."""
    reference = losses["stock padded"]
    for label, loss in losses.items():
        if abs(loss - reference) > LOSS_RTOL * abs(reference):
            raise AssertionError(f"{label}: loss {loss:.8f} differs from stock padded {reference:.8f} by more than "
                                 f"rounding (rtol {LOSS_RTOL}): a wrong configuration")
    leaking = packed_batch(documents, device, flash_kwargs=False)
    leaking.pop("position_ids")
    with torch.no_grad():
        leak_loss = base(**leaking).loss.item()
    if abs(leak_loss - reference) <= LOSS_RTOL * abs(reference):
        raise AssertionError(f"the packed row without position restarts gives the padded loss ({leak_loss:.8f}): "
                             "the loss check cannot tell attention across documents")
    return leak_loss


def run(device, quick=False):
    base = make_model(device)
    documents = make_documents()
    entries = configurations(base, documents, device)
    tags = environment_tags()
    progress = Progress(len(entries) + 2, "packing")
    losses, peaks, steps = {}, {}, {}
    for label, model, _, inputs in entries:
        steps[label] = step = loss_step(model, inputs)
        run_step(step)  # warm-up
        with PeakSavedBytes() as peak:
            loss = step.forward()
            step.backward(loss)
        losses[label], peaks[label] = loss.item(), peak.peak
        progress.step(f"{label}: loss {losses[label]:.6f}, peak saved {peak.peak} bytes")
    leak_loss = check_losses(losses, base, documents, device)
    progress.step(f"losses agree within rtol {LOSS_RTOL} (max |diff| "
                  f"{max(abs(v - losses['stock padded']) for v in losses.values()):.2e}); packed without restarts "
                  f"(leaking) gives {leak_loss:.6f}")
    timings = timing_summary(interleaved_timings(steps, device, rounds=2 if quick else 12),
                             {"stock_padded": "stock padded"}, "packing")
    progress.step("interleaved timing")
    real_tokens = sum(len(d) for d in documents)
    rows = []
    for label, _, layout, inputs in entries:
        columns = timings[label, "full"]
        median, low, high = (columns[f"time_vs_stock_padded{q}"] for q in ("", "_q20", "_q80"))
        rows.append({
            **tags, "model": f"llama h={base.config.hidden_size} L={base.config.num_hidden_layers} fp32",
            "documents": "/".join(str(len(d)) for d in documents), "configuration": label, "layout": layout,
            "real_tokens": real_tokens, "computed_tokens": inputs["input_ids"].numel(),
            "loss": losses[label], "loss_diff_vs_stock_padded": losses[label] - losses["stock padded"],
            "peak_saved_bytes": peaks[label], "saved_bytes_per_real_token": peaks[label] / real_tokens,
            **columns,
            # Same real tokens everywhere: the throughput ratio is the inverse time ratio (band inverted).
            "tokens_per_s_ratio": 1 / median, "tokens_per_s_ratio_q20": 1 / high, "tokens_per_s_ratio_q80": 1 / low,
        })
    return with_end_load(rows)


summary_columns = ["configuration", "computed_tokens", "peak_saved_bytes", "saved_bytes_per_real_token",
                   "tokens_per_s_ratio", "tokens_per_s_ratio_q20", "tokens_per_s_ratio_q80",
                   "time_vs_stock_padded_verdict", "suspect", "loss_diff_vs_stock_padded"]
