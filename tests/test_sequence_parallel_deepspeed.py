"""A patched model trains under DeepSpeed's long-sequence stack (Arctic Long Sequence Training's
pieces in deepspeed 0.19.8: ``UlyssesSPAttentionHF.register_with_transformers``, its data loader
adapter ``UlyssesSPDataLoaderAdapter`` sharding the batches, the DeepSpeed engine with ZeRO-1, and
transformers' ``deepspeed_sp_compute_loss``, the Trainer's loss under sequence parallelism) on two
CPU processes (gloo), in the order HF Accelerate runs them: DeepSpeed's registration first (inside
``prepare``), then ``remat.patch(model, sequence_parallel="deepspeed")``. Its losses and parameters
after two steps equal the stock model's trained by the same stack with DeepSpeed's own Ulysses
attention wrapper. The same through the Trainer with HF Accelerate's
``ParallelismConfig(sp_backend="deepspeed")``, the model patched by remat.patch_callback when
training begins."""

import os
import socket
import types

import pytest
import torch
import torch.multiprocessing as mp

import remat

transformers = pytest.importorskip("transformers")
pytest.importorskip("deepspeed")

LENGTH, WORLD = 24, 2


def _model():
    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=80, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, use_cache=False,
                                      attn_implementation="sdpa")
    return transformers.LlamaForCausalLM(config)


def _sample(rank):
    """Rank r's data loader holds one sequence; the adapter gathers one from each rank and gives
    every rank its shard of each in turn (two micro-batches, two steps)."""
    g = torch.Generator().manual_seed(10 + rank)
    ids = torch.randint(0, 64, (LENGTH,), generator=g)
    labels = ids.clone()
    labels[:5] = -100  # a prompt without loss, as in SFT
    return {"input_ids": ids, "labels": labels, "position_ids": torch.arange(LENGTH)}


def _worker(rank, port, out_path):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(WORLD),
                      LOCAL_RANK=str(rank))
    torch.set_num_threads(1)
    import deepspeed
    import deepspeed.ops
    from deepspeed.runtime.sequence_parallel.ulysses_sp import UlyssesSPAttentionHF, UlyssesSPDataLoaderAdapter
    from transformers.integrations.deepspeed import deepspeed_sp_compute_loss

    # DeepSpeed's optional shared-memory all-reduce for CPUs is a C++ op compiled at first use
    # (~60 s on this machine); without it gloo carries every collective.
    deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
    deepspeed.init_distributed(dist_backend="gloo")
    try:
        patched, stock = _model(), _model()
        mpu = UlyssesSPAttentionHF.register_with_transformers(
            model_name_or_path=patched, core_attn_implementation="sdpa", sequence_parallel_size=WORLD,
            micro_batch_size=1, seq_length_is_variable=True)
        remat.patch(patched, policy="balanced", sequence_parallel="deepspeed")
        config = {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1,
                  "optimizer": {"type": "SGD", "params": {"lr": 0.5}}, "zero_optimization": {"stage": 1},
                  "zero_allow_untested_optimizer": True}
        # transformers' loss under DeepSpeed sequence parallelism reads these two fields only.
        parallelism = types.SimpleNamespace(sp_backend="deepspeed", sp_size=WORLD)
        results = {}
        for name, model in (("patched", patched), ("stock", stock)):
            engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config, mpu=mpu)
            loader = UlyssesSPDataLoaderAdapter(
                torch.utils.data.DataLoader([_sample(rank)], batch_size=1), sp_rank=mpu.get_sequence_parallel_rank(),
                sp_group=mpu.get_sequence_parallel_group(), sp_world_size=WORLD, device="cpu")
            losses = []
            for batch in loader:
                loss = deepspeed_sp_compute_loss(None, engine, batch, False, parallelism)
                engine.backward(loss)
                engine.step()
                losses.append(loss.detach())
            results[name] = {"losses": losses, "shard": tuple(batch["input_ids"].shape),
                             "state": {k: p.detach().clone() for k, p in model.named_parameters()}}
        results["fused"] = type(patched.model.layers[0]).__name__
        torch.save(results, f"{out_path}.{rank}")
        torch.distributed.barrier()
    finally:
        torch.distributed.destroy_process_group()
    os._exit(0)


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_patched_model_trains_like_stock_under_deepspeed_ulysses(tmp_path):
    out_path = str(tmp_path / "ds")
    mp.spawn(_worker, args=(_free_port(), out_path), nprocs=WORLD, join=True)
    initial = dict(_model().named_parameters())
    for rank in range(WORLD):
        results = torch.load(f"{out_path}.{rank}")
        assert results["fused"] == "HFLlamaLayer"
        patched, stock = results["patched"], results["stock"]
        assert patched["shard"] == (1, LENGTH // WORLD) and len(patched["losses"]) == WORLD
        torch.testing.assert_close(torch.stack(patched["losses"]), torch.stack(stock["losses"]), rtol=1e-5, atol=1e-6)
        for name, p in stock["state"].items():
            assert not torch.equal(p, initial[name]), f"{name} did not train"
            torch.testing.assert_close(patched["state"][name], p, rtol=1e-4, atol=1e-5, msg=name)


class _Sequences(torch.utils.data.Dataset):
    def __len__(self):
        return 4

    def __getitem__(self, index):
        return _sample(index)


def _trainer_worker(rank, port, patched, out_path):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(WORLD),
                      LOCAL_RANK=str(rank))
    torch.set_num_threads(1)
    import deepspeed
    import deepspeed.ops
    from accelerate.parallelism_config import ParallelismConfig
    from accelerate.utils import DeepSpeedSequenceParallelConfig

    deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
    deepspeed.init_distributed(dist_backend="gloo")  # Accelerate on the CPU leaves it to the launcher
    try:
        handler = DeepSpeedSequenceParallelConfig(sp_seq_length_is_variable=True, sp_attn_implementation="sdpa")
        parallelism = ParallelismConfig(sp_backend="deepspeed", sp_size=WORLD, sp_handler=handler)
        config = {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1,
                  "zero_optimization": {"stage": 1}, "zero_allow_untested_optimizer": True}
        args = transformers.TrainingArguments(
            output_dir=out_path + f".out{rank}", per_device_train_batch_size=1, max_steps=2, learning_rate=0.5,
            lr_scheduler_type="constant", optim="sgd", report_to=[], save_strategy="no", use_cpu=True,
            deepspeed=config, parallelism_config=parallelism, logging_steps=1, seed=0, disable_tqdm=True)
        model = _model()
        callbacks = [remat.patch_callback(policy="memory", sequence_parallel="deepspeed")] if patched else []
        trainer = transformers.Trainer(model=model, args=args, train_dataset=_Sequences(), callbacks=callbacks)
        trainer.train()
        losses = [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]
        torch.save({"losses": losses, "layer": type(model.model.layers[0]).__name__,
                    "state": {k: p.detach().clone() for k, p in model.named_parameters()}}, f"{out_path}.{rank}")
        torch.distributed.barrier()
    finally:
        torch.distributed.destroy_process_group()
    os._exit(0)


def test_patched_model_trains_like_stock_in_the_trainer_with_accelerate_sequence_parallelism(tmp_path):
    runs = {}
    for patched in (True, False):
        out_path = str(tmp_path / f"trainer{int(patched)}")
        mp.spawn(_trainer_worker, args=(_free_port(), patched, out_path), nprocs=WORLD, join=True)
        runs[patched] = [torch.load(f"{out_path}.{rank}") for rank in range(WORLD)]
    for patched, stock in zip(runs[True], runs[False], strict=True):
        assert patched["layer"] == "HFLlamaLayer" and stock["layer"] == "LlamaDecoderLayer"
        assert len(patched["losses"]) == 2
        torch.testing.assert_close(patched["losses"], stock["losses"], rtol=1e-5, atol=1e-6)
        for name, p in stock["state"].items():
            torch.testing.assert_close(patched["state"][name], p, rtol=1e-4, atol=1e-5, msg=name)
