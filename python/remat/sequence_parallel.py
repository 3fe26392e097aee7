"""Ulysses sequence parallelism for remat's fused decoder layers: ``remat.patch(model,
sequence_parallel=group)``.

The P ranks of ``group`` (a ``torch.distributed`` process group) share one sequence: each holds a
contiguous shard of n = N / P tokens (``input_ids``, ``position_ids`` and ``shift_labels`` of its
part, as :func:`shard_batch` or DeepSpeed's ``UlyssesSPDataLoaderAdapter`` cut them). Everything
per token (embedding, norms, projections, rope, MLP, the fused loss) runs on the shard. Inside the
attention sub-block (remat.autograd.norm_attention) an all-to-all over heads gives each rank the
whole sequence for Hq / P query heads and their KV heads (:func:`scatter_heads`), the attention
core runs on those, and a second all-to-all brings o back to the rank's tokens
(:func:`gather_heads`). Backward runs the transposed collectives. The exchange runs one group of
heads at a time (remat.autograd.norm_attention._head_chunks: gcd(Hq / P, Hkv) groups), so what it
holds at once is one group's; within a group that has fewer KV heads than ranks (always, with GQA
and fewer KV heads than ranks; with chunking also otherwise), each KV head is replicated to the
ranks whose query heads read it, and the gradients of the replicas are summed (in fp32, of the
core's gradients in the inputs' dtype), as DeepSpeed's Ulysses does.

What a rank keeps for backward is the single-GPU contract for its n tokens (the same bytes: lse is
kept head-sharded, ``[B, Hq / P, N]``, which is as large as ``[B, Hq, n]``); nothing an all-to-all
makes is kept. Backward re-runs the forward's all-to-alls on what it recomputes (q, k, v) and one
more on o.

The layout of the whole sequence (dense, or packed documents where positions restart) comes from
the position_ids of all ranks, gathered once per model forward (:func:`sequence_parallel_layout`);
the layout must be the same on every rank, so each rank reads every shard's positions.

Not taken (clear errors on every rank, before the attention's collectives): a padding mask with
pads on any rank (pad the sequence's end instead: :func:`shard_batch`), a KV cache (generation),
Hugging Face's ``cu_seq_lens_q/k`` (pass restarting position_ids),
packed documents in a batch of more than one row, attention dropout, the attention sub-block's
query tiling (the MLP and loss still tile), layers remat does not fuse.
"""

import weakref

import torch
import torch.distributed as dist

from remat.sequences import SequenceLayout, padding_or_position_layout

IGNORE_INDEX = -100


def check_group(group):
    """The size P of ``group`` after checking it: ``torch.distributed`` initialised and ``group`` a
    ``ProcessGroup`` of which this process is a member. Raises RuntimeError / TypeError /
    ValueError otherwise, before any collective is issued."""
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError("sequence_parallel needs torch.distributed initialised (dist.init_process_group) on every "
                           "rank of the group before remat.patch")
    if not isinstance(group, dist.ProcessGroup):
        raise TypeError(f"sequence_parallel must be a torch.distributed ProcessGroup (dist.new_group(ranks) or "
                        f"dist.group.WORLD), got {type(group).__name__}")
    if dist.get_rank(group) < 0:
        raise ValueError("this process is not a member of the sequence_parallel group")
    return dist.get_world_size(group)


# SequenceGroup.smallest's stand-in for None (no limit) in its int64 all-reduce.
_NO_LIMIT = 2**63 - 1


class SequenceGroup:
    """Where the fused layers of a model patched with ``sequence_parallel`` find their group:
    the ProcessGroup given to remat.patch, or with ``"deepspeed"`` DeepSpeed's sequence-parallel
    group (``deepspeed.runtime.sequence_parallel.parallel_state_sp``, which DeepSpeed's
    ``UlyssesSPAttentionHF.register_with_transformers`` creates, as HF Accelerate's
    ``ParallelismConfig(sp_backend="deepspeed")`` and the Trainer do inside ``prepare``, after the
    model was built and patched), looked up at the first forward. :meth:`resolve` returns
    (group, size)."""

    def __init__(self, source):
        if source == "deepspeed":
            import importlib.util

            if importlib.util.find_spec("deepspeed") is None:
                raise ImportError("sequence_parallel='deepspeed' needs DeepSpeed installed")
            self.group = None
        else:
            self.group = source
            check_group(source)
        self.source = source

    def resolve(self):
        """(process group, its size P), checked (:func:`check_group`)."""
        group = self.group
        if group is None:
            from deepspeed.runtime.sequence_parallel import parallel_state_sp

            group = parallel_state_sp._SEQUENCE_PARALLEL_GROUP
            if group is None:
                raise RuntimeError("sequence_parallel='deepspeed': DeepSpeed's sequence-parallel group is not "
                                   "initialised yet (UlyssesSPAttentionHF.register_with_transformers creates it; HF "
                                   "Accelerate does inside prepare with ParallelismConfig(sp_backend='deepspeed'))")
        return group, check_group(group)

    def smallest(self, value):
        """The smallest ``value`` over the group's ranks (an int, or None for no limit: None only
        if it is None on every rank), by one ``all_reduce(MIN)`` that every rank must call.
        remat.patch(policy="auto", seq_len=..., sequence_parallel=...) plans each rank on its own,
        so the ranks agree on the budgets first: the same plan on every rank recomputes, and so
        exchanges, the same tensors in backward (ranks with other GPUs or budgets would otherwise
        issue different collectives)."""
        group, _ = self.resolve()
        backend = str(dist.get_backend(group))
        on_cuda = "nccl" in backend and "gloo" not in backend  # NCCL reduces CUDA tensors only
        device = torch.device("cuda", torch.cuda.current_device()) if on_cuda else torch.device("cpu")
        reduced = torch.tensor([_NO_LIMIT if value is None else int(value)], dtype=torch.int64, device=device)
        dist.all_reduce(reduced, op=dist.ReduceOp.MIN, group=group)
        smallest = int(reduced.item())
        return None if smallest == _NO_LIMIT else smallest


def check_heads(num_heads, num_kv_heads, size, where="the model"):
    """Raises ValueError unless ``size`` ranks can split ``num_heads`` query heads evenly and the
    ``num_kv_heads`` KV heads evenly or by replication (``size`` a multiple of ``num_kv_heads``)."""
    if num_heads % size:
        raise ValueError(f"sequence_parallel over {size} ranks needs the query heads of {where} ({num_heads}) to be a "
                         f"multiple of {size}")
    if num_kv_heads % size and size % num_kv_heads:
        raise ValueError(f"sequence_parallel over {size} ranks needs the KV heads of {where} ({num_kv_heads}) to be "
                         f"a multiple of {size}, or {size} a multiple of them (each KV head then replicated)")


def kv_replicas(num_kv_heads, size):
    """How many ranks share each KV head: ``size / num_kv_heads`` when there are fewer KV heads than
    ranks, else 1."""
    return size // num_kv_heads if num_kv_heads < size else 1


def _estimating(t):
    """Whether ``t`` belongs to a remat.estimate run (fake tensors, no data): the collectives'
    buffers are allocated as in a real step, but nothing is sent (the group may be a real one, as
    under ``remat.patch(policy="auto", seq_len=..., sequence_parallel=group)``, each rank planning
    on its own)."""
    from remat.planning.estimator import estimating, is_fake

    return is_fake(t) and estimating()


def _all_to_all(received, send, group):
    """``dist.all_to_all_single(received, send)`` over ``group``; under remat.estimate nothing is
    sent (:func:`_estimating`)."""
    if not _estimating(send):
        dist.all_to_all_single(received, send, group=group)


def scatter_heads(t, group, size):
    """One all-to-all: ``t`` ``[B, n, H, D]`` (this rank's n tokens, every head) -> ``[B, P n, H / P,
    D]`` (every rank's tokens in rank order, this rank's group of H / P heads), a new contiguous
    tensor."""
    batch, n, heads, head_dim = t.shape
    send = t.reshape(batch, n, size, heads // size, head_dim).permute(2, 0, 1, 3, 4).contiguous()
    received = torch.empty_like(send)
    _all_to_all(received, send, group)
    # received[s]: rank s's tokens for this rank's heads.
    # (A reshape of the permutation is a strided view when B = 1 or one head per rank: made contiguous.)
    return received.permute(1, 0, 2, 3, 4).reshape(batch, size * n, heads // size, head_dim).contiguous()


def gather_heads(t, group, size):
    """The inverse of :func:`scatter_heads`, one all-to-all: ``t`` ``[B, P n, h, D]`` (every token,
    this rank's h heads) -> ``[B, n, P h, D]`` (this rank's tokens, every head)."""
    batch, total, heads, head_dim = t.shape
    n = total // size
    send = t.reshape(batch, size, n, heads, head_dim).permute(1, 0, 2, 3, 4).contiguous()
    received = torch.empty_like(send)
    _all_to_all(received, send, group)
    # received[s]: this rank's tokens for rank s's heads.
    # Contiguous, so that o and the output projection's input (its view) share one storage.
    return received.permute(1, 2, 0, 3, 4).reshape(batch, n, size * heads, head_dim).contiguous()


def scatter_kv_heads(t, group, size):
    """:func:`scatter_heads` for k or v ``[B, n, Hkv, D]``, each KV head first replicated to the
    ``size / Hkv`` ranks that read it when Hkv < size: ``[B, P n, max(Hkv / P, 1), D]``."""
    replicas = kv_replicas(t.shape[2], size)
    if replicas > 1:
        t = t.repeat_interleave(replicas, dim=2)
    return scatter_heads(t, group, size)


def gather_kv_grads(t, group, size, num_kv_heads):
    """The gradient of :func:`scatter_kv_heads`: ``t`` ``[B, P n, h, D]`` -> ``[B, n, Hkv, D]``, the
    replicas' gradients summed in fp32 and rounded once to ``t``'s dtype (each replica's gradient
    is already in that dtype)."""
    gathered = gather_heads(t, group, size)
    replicas = kv_replicas(num_kv_heads, size)
    if replicas == 1:
        return gathered
    batch, n, _, head_dim = gathered.shape
    grouped = gathered.view(batch, n, num_kv_heads, replicas, head_dim)
    return grouped.sum(3, dtype=torch.float32).to(t.dtype)


_PADS_MESSAGE = ("sequence_parallel does not take a padding mask with pads: pad the sequence's end "
                 "(remat.sequence_parallel.shard_batch does, labels -100) or pack documents with restarting "
                 "position_ids")


def _gather_positions(position_ids, group, size, pads):
    """Every rank's position_ids ``[B or 1, n]``, concatenated in rank order: ``[B or 1, P n]``.
    First one small all_gather of each rank's shape and ``pads`` (whether its attention_mask has
    pads), so that shards of different shapes, or pads on any rank, raise ValueError on every rank
    instead of one rank raising while the others wait in the next collective."""
    dims = position_ids.dim()
    shape = list(position_ids.shape) + [1] * (2 - dims) if dims <= 2 else [0, 0]
    facts = torch.tensor([dims, *shape, int(pads)], dtype=torch.int64, device=position_ids.device)
    gathered = [torch.empty_like(facts) for _ in range(size)]
    dist.all_gather(gathered, facts, group=group)
    if any(int(f[3]) for f in gathered):
        raise ValueError(f"{_PADS_MESSAGE} (pads on rank(s) {[r for r, f in enumerate(gathered) if int(f[3])]})")
    shapes = [tuple(f[1:1 + int(f[0])].tolist()) if int(f[0]) <= 2 else f"{int(f[0])}-D" for f in gathered]
    if any(int(f[0]) > 2 for f in gathered):
        raise ValueError(f"sequence_parallel: position_ids must be [B, n] or [n], got shapes {shapes} on the ranks")
    if any(not torch.equal(f[:3], gathered[0][:3]) for f in gathered):
        raise ValueError(f"sequence_parallel: the ranks' position_ids differ in shape ({shapes}); every rank needs a "
                         "shard of the same length (shard_batch pads the sequence's end to a multiple of the group "
                         "size)")
    parts = [torch.empty_like(position_ids) for _ in range(size)]
    dist.all_gather(parts, position_ids.contiguous(), group=group)
    return torch.cat(parts, dim=-1)


def sequence_parallel_layout(batch, n, attention_mask, position_ids, source, offsets):
    """The layout of the whole sequence for a rank's shard ``[B, n]``, the same on every rank: a
    :class:`remat.sequences.SequenceLayout` with ``sequence_parallel`` set to ``(group, P)`` (from
    ``source``, a :class:`SequenceGroup`) and,
    where the positions restart (packed documents, B = 1), the offsets of the P n tokens. Gathers
    every rank's position_ids (two all_gathers; the result is reused while the same position_ids
    tensor comes back, as it does layer after layer). Raises ValueError for what sequence
    parallelism does not take (module docstring), before any collective."""
    if any(v is not None for v in offsets.values()):
        raise ValueError("sequence_parallel does not take cu_seq_lens_q/k: pass each shard's position_ids, "
                         "restarting at 0 where a packed document starts")
    if position_ids is None:
        raise ValueError("sequence_parallel needs each shard's position_ids (its tokens' places in the whole "
                         "sequence; remat.sequence_parallel.shard_batch and DeepSpeed's UlyssesSPDataLoaderAdapter "
                         "provide them): without them every shard would start at position 0")
    if torch.compiler.is_compiling():
        raise ValueError("sequence_parallel under torch.compile is not supported yet: the shards' layout is read "
                         "from their gathered position_ids on the host")
    group, size = source.resolve()
    if _estimating(position_ids):  # remat.estimate: dense rows, no positions to read
        return SequenceLayout(None, None, None, None, (group, size))
    # Inference tensors have no version counter: their layouts are not reused (gathered per layer).
    key = None if position_ids.is_inference() else (
        id(position_ids), position_ids._version, id(attention_mask), id(group), batch, n)
    last = _LAST.get("entry")
    if key is not None and last is not None and last[0] == key and last[1]() is position_ids:
        return last[2]
    # Read once per layout (the mask is part of the key), not per layer: pads on one rank's shard only
    # (a right-padded batch cut by hand) are refused on every rank, the flag travelling in the first gather.
    pads = attention_mask is not None and not bool(attention_mask.to(torch.bool).all())
    positions = _gather_positions(position_ids, group, size, pads)
    whole = padding_or_position_layout(None, positions, batch, size * n)
    if whole is not None and whole.cu_seqlens is not None and batch != 1:
        raise ValueError("sequence_parallel with packed documents (restarting position_ids) takes one row "
                         f"(B = 1), got B = {batch}")
    cu_seqlens, max_seqlen = (None, None) if whole is None else (whole.cu_seqlens, whole.max_seqlen)
    layout = SequenceLayout(None, cu_seqlens, max_seqlen, None, (group, size))
    if key is not None:
        _LAST["entry"] = (key, weakref.ref(position_ids), layout)
    return layout


_LAST = {}


def shard_batch(batch, group, *, pad_token_id=0):
    """This rank's shard of a batch of whole sequences, as a new dict: the batch's ``[B, N]`` tensors
    cut to tokens ``[r n, (r + 1) n)`` of rank r = ``dist.get_rank(group)``, n = N / P, with
    ``shift_labels`` (labels shifted left by one, -100 last, computed before cutting so that a
    shard's last token predicts the next shard's first) and ``num_items_in_batch`` (labelled tokens
    of the whole batch) added: pass the result to a patched causal LM as keyword arguments. Each
    rank's loss is then its share of the whole batch's mean, and the losses sum to it.

    Args:
        batch: a dict with ``input_ids`` ``[B, N]``, ``labels`` ``[B, N]`` (optional: without them
            no shift_labels / num_items_in_batch) and ``position_ids`` ``[B, N]`` (optional:
            default 0 .. N - 1; restarting positions mark packed documents). Other ``[B, N]``
            tensors are cut too, and ``[1, N]`` ones (such as position_ids shared by every row)
            as every row's; anything else is copied. ``attention_mask`` raises ValueError
            (sequence parallelism takes no pads but at the end, added here).
        group: the sequence-parallel process group.
        pad_token_id: when N is not a multiple of P, the sequence's end is padded to the next
            multiple with this token, positions continuing and labels -100 (under causal
            attention no real token sees them, and they carry no loss).

    Returns: the dict of the shard; ``labels`` keep the shard's own labels (a causal LM computes a
    loss only when they are given; ``shift_labels`` replaces their shift).
    """
    size = check_group(group)
    rank = dist.get_rank(group)
    if "attention_mask" in batch:
        raise ValueError("shard_batch takes no attention_mask: pack documents with restarting position_ids, or pad "
                         "only at the end (done here)")
    ids = batch["input_ids"]
    if ids.dim() != 2:
        raise ValueError(f"input_ids must be [B, N], got shape {tuple(ids.shape)}")
    rows, length = ids.shape
    whole = dict(batch)
    whole.setdefault("position_ids", torch.arange(length, device=ids.device).expand(rows, length))
    for name, value in list(whole.items()):
        # [1, N, ...] tensors beside B > 1 rows (position_ids as Hugging Face broadcasts them) are
        # every row's: expanded, so that they are cut like the others.
        if torch.is_tensor(value) and value.dim() >= 2 and value.shape[:2] == (1, length) and rows > 1:
            whole[name] = value.expand(rows, *value.shape[1:])
    pad = -length % size
    if pad:
        fills = {"input_ids": pad_token_id, "labels": IGNORE_INDEX}
        for name, value in list(whole.items()):
            if torch.is_tensor(value) and value.shape[:2] == (rows, length):
                if name == "position_ids":
                    steps = torch.arange(1, pad + 1, device=value.device)
                    extra = value[:, -1:] + steps
                else:
                    extra = value.new_full((rows, pad, *value.shape[2:]), fills.get(name, 0))
                whole[name] = torch.cat([value, extra], dim=1)
        length += pad
    if "labels" in whole:
        labels = whole["labels"]
        whole["shift_labels"] = torch.nn.functional.pad(labels, (0, 1), value=IGNORE_INDEX)[:, 1:]
        whole["num_items_in_batch"] = (whole["shift_labels"] != IGNORE_INDEX).sum()
    n = length // size
    return {name: value[:, rank * n:(rank + 1) * n].contiguous()
            if torch.is_tensor(value) and value.dim() >= 2 and value.shape[:2] == (rows, length) else value
            for name, value in whole.items()}
