"""A patched tiny Llama trains under DDP and FSDP2 (fully_shard) with two CPU processes (gloo) and
reaches the same parameters as one process stepping on the same global batch."""

import os
import socket
import sys

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import remat

transformers = pytest.importorskip("transformers")

STEPS, PER_RANK, LENGTH, WORLD = 3, 2, 9, 2


def _model():
    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=80, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, use_cache=False,
                                      attn_implementation="eager")
    model = transformers.LlamaForCausalLM(config)
    remat.patch(model, policy="memory")
    return model


def _batches():
    g = torch.Generator().manual_seed(1)
    return [torch.randint(0, 64, (WORLD * PER_RANK, LENGTH), generator=g) for _ in range(STEPS)]


def _train(model, batches, rows):
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    for ids in batches:
        optimizer.zero_grad(set_to_none=True)
        part = ids[rows]
        model(input_ids=part, labels=part).loss.backward()
        optimizer.step()


def _worker(rank, mode, port, out_path):
    sys.path.insert(0, os.path.dirname(__file__))
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=WORLD)
    torch.set_num_threads(1)
    try:
        model = _model()
        if mode == "ddp":
            wrapped = torch.nn.parallel.DistributedDataParallel(model)
        else:
            from torch.distributed.fsdp import fully_shard

            for layer in model.model.layers:
                fully_shard(layer)
            wrapped = fully_shard(model)
        _train(wrapped, _batches(), slice(rank * PER_RANK, (rank + 1) * PER_RANK))
        state = {}
        for name, p in model.named_parameters():
            full = p.full_tensor() if hasattr(p, "full_tensor") else p
            state[name] = full.detach().clone()
        if rank == 0:
            torch.save(state, out_path)
        # Both ranks leave together: a rank that tears down gloo while its peer still talks to it
        # can abort the peer ("terminate called without an active exception").
        dist.barrier()
    finally:
        dist.destroy_process_group()
    # The work is done and saved: skip interpreter teardown, where gloo's threads have aborted a
    # process under load (seen once in `make test`). Errors above still propagate to mp.spawn.
    os._exit(0)


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.parametrize("mode", ["ddp", "fsdp2"])
def test_two_process_training_matches_one_process(mode, tmp_path):
    out_path = str(tmp_path / "rank0.pt")
    mp.spawn(_worker, args=(mode, _free_port(), out_path), nprocs=WORLD, join=True)
    distributed = torch.load(out_path)
    initial = dict(_model().named_parameters())
    single = _model()
    _train(single, _batches(), slice(None))
    for name, p in single.named_parameters():
        assert not torch.equal(p, initial[name]), f"{name} did not train"
        torch.testing.assert_close(distributed[name], p.detach(), rtol=1e-4, atol=1e-5, msg=name)
