"""python -m remat fit: the longest sequence (or largest batch) that fits, per setup, from a
Hugging Face config on fake CUDA tensors (no GPU here)."""

import json

import pytest

from remat.__main__ import main as remat_main
from remat.planning import fit as fit_module
from remat.planning.fit import FitRow, build_model, fit, parse_bytes, set_up

transformers = pytest.importorskip("transformers")
pytest.importorskip("peft")

TINY = dict(model_type="llama", vocab_size=512, hidden_size=128, intermediate_size=352, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4096)


def tiny_config():
    return transformers.AutoConfig.for_model(**TINY)


def test_parse_bytes_reads_gpu_sizes_in_binary_units():
    assert parse_bytes("80GB") == 80 * 2**30
    assert parse_bytes("141 GiB") == 141 * 2**30
    assert parse_bytes("512MB") == 512 * 2**20
    assert parse_bytes("1.5G") == int(1.5 * 2**30)
    assert parse_bytes("4096") == 4096
    for bad in ("", "eighty", "80 XB", "-1GB"):
        with pytest.raises(ValueError, match="cannot read a size"):
            parse_bytes(bad)


def test_each_setup_gets_the_longest_length_that_fits():
    from remat.planning.estimator import estimate

    gpu, reserve = 64 * 2**20, 4 * 2**20
    rows = {r.setup: r for r in fit(tiny_config(), gpu_memory=gpu, reserve=reserve, lora_rank=8,
                                    setups=("stock", "stock+checkpointing", "remat:memory"), workers=1)}
    for setup, row in rows.items():
        assert row.max_seq_len and row.peak_bytes <= gpu - reserve, row
        # Maximal to the search's resolution (1/64): 2% more does not fit.
        longer = int(row.max_seq_len * 1.02) + 1
        model = set_up(build_model(tiny_config(), lora_rank=8), setup)
        assert estimate(model, seq_len=longer).peak_bytes > gpu - reserve, setup
    assert rows["stock"].max_seq_len < rows["stock+checkpointing"].max_seq_len
    assert rows["stock"].max_seq_len < rows["remat:memory"].max_seq_len


def test_a_fixed_length_searches_the_batch_size():
    rows = fit(tiny_config(), gpu_memory=64 * 2**20, reserve=4 * 2**20, seq_len=256, setups=("remat:memory",))
    assert rows[0].max_seq_len == 256 and rows[0].max_batch_size >= 1


def test_nothing_fits_is_reported_not_raised():
    rows = fit(tiny_config(), gpu_memory=2 * 2**20, reserve=2**20, setups=("stock",))
    assert rows == [FitRow("stock", 0, None, None, None)]


def test_the_command_prints_json_rows_with_every_setup(tmp_path, capsys):
    config = tmp_path / "config.json"
    config.write_text(json.dumps(TINY))
    assert remat_main(["fit", str(config), "--gpu-memory", "64MB", "--reserve", "4MB", "--lora-rank", "8",
                       "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert [r["setup"] for r in rows] == list(fit_module.SETUPS)
    for row in rows:
        assert set(row) >= {"setup", "max_seq_len", "peak_bytes", "host_bytes"}
        assert row["max_seq_len"] > 0 and row["peak_bytes"] <= 60 * 2**20
        if row["setup"] == "remat:auto":
            assert row["note"].startswith("reached with ")
    by_setup = {row["setup"]: row for row in rows}
    # auto reaches at least as far as every fixed policy (its candidates include them).
    assert by_setup["remat:auto"]["max_seq_len"] >= max(by_setup[f"remat:{p}"]["max_seq_len"]
                                                        for p in ("speed", "balanced", "memory"))


def test_the_table_states_the_reserve(tmp_path, capsys):
    config = tmp_path / "config.json"
    config.write_text(json.dumps(TINY))
    assert remat_main(["fit", str(config), "--gpu-memory", "64MB", "--reserve", "4MB",
                       "--setups", "stock,remat:memory", "--workers", "1"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == ("GPU memory 64.00 MiB, reserve 4.0 MiB kept free (CUDA context, workspaces, fragmentation): "
                        "60.00 MiB usable; any host memory")
    assert [line.split()[0] for line in lines[2:4]] == ["stock", "remat:memory"]
    assert lines[4].startswith("2 rows in ")
    # The default reserve (3 GiB) exceeds 64 MB: a clear error, no traceback.
    assert remat_main(["fit", str(config), "--gpu-memory", "64MB"]) == 2
    assert "must exceed the reserve" in capsys.readouterr().err


def test_bad_arguments():
    with pytest.raises(ValueError, match="must exceed the reserve"):
        fit(tiny_config(), gpu_memory=2**20, reserve=2**20)
    with pytest.raises(ValueError, match="unknown setups"):
        fit(tiny_config(), gpu_memory=2**33, setups=("remat:fast",))
    assert remat_main(["nonsense"]) == 2


def test_offload_lets_remat_fit_longer_and_reports_host_bytes():
    # Six layers: at the peak (the last layer's backward) two layers' kept tensors are on the
    # device (that layer's and the one prefetched), not six.
    config = transformers.AutoConfig.for_model(**{**TINY, "num_hidden_layers": 6})
    kwargs = dict(gpu_memory=64 * 2**20, reserve=4 * 2**20, setups=("remat:memory",))
    kept = fit(config, **kwargs)[0]
    offloaded = fit(config, offload=True, **kwargs)[0]
    assert kept.host_bytes == 0 and offloaded.host_bytes > 0
    assert offloaded.max_seq_len > kept.max_seq_len


def test_a_host_memory_limit_bounds_the_offloaded_length():
    config = transformers.AutoConfig.for_model(**{**TINY, "num_hidden_layers": 6})
    kwargs = dict(gpu_memory=64 * 2**20, reserve=4 * 2**20, setups=("remat:memory",), offload=True)
    free = fit(config, **kwargs)[0]
    limit = free.host_bytes // 2
    bounded = fit(config, host_memory=limit, **kwargs)[0]
    # (Below MIN_BYTES a layer's kept tensors stay on the device: the answer may hold no host bytes.)
    assert bounded.host_bytes <= limit and bounded.max_seq_len < free.max_seq_len
    assert bounded.note.endswith("limited by the host memory") and free.note.endswith("limited by the device")
    with pytest.raises(ValueError, match="host_memory"):
        fit(config, host_memory=-1, **kwargs)


def test_lora_targets_reach_peft_and_the_command(tmp_path, capsys):
    """--lora-targets names PEFT's target modules (a mixture-of-experts model's attention, since
    PEFT's all-linear also wraps its router and 3-D experts, which remat's MoE layers leave alone);
    a row's note carries the estimate's routing assumption."""
    config = dict(model_type="qwen3_moe", vocab_size=256, hidden_size=64, intermediate_size=128,
                  moe_intermediate_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                  head_dim=16, num_experts=8, num_experts_per_tok=2, max_position_embeddings=4096)
    model = build_model(transformers.AutoConfig.for_model(**config), lora_rank=4, lora_targets=["q_proj", "o_proj"])
    adapted = {name.rsplit(".", 1)[-1] for name, module in model.named_modules() if hasattr(module, "lora_A")}
    assert adapted == {"q_proj", "o_proj"}
    path = tmp_path / "config.json"
    path.write_text(json.dumps(config))
    assert remat_main(["fit", str(path), "--gpu-memory", "20MB", "--reserve", "4MB", "--lora-rank", "4",
                       "--lora-targets", "q_proj,k_proj,v_proj,o_proj", "--setups", "stock,remat:memory",
                       "--json", "--workers", "1"]) == 0
    rows = {row["setup"]: row for row in json.loads(capsys.readouterr().out)}
    assert rows["stock"]["max_seq_len"] and rows["stock"]["note"].endswith("limited by the device")
    assert rows["remat:memory"]["max_seq_len"] > rows["stock"]["max_seq_len"]
    assert "assumed mixture-of-experts routing" in rows["remat:memory"]["note"]
    assert remat_main(["fit", str(path), "--gpu-memory", "64MB", "--lora-rank", "4", "--lora-targets", " , "]) == 2


def test_sequence_parallel_rows_are_per_rank_peaks_of_whole_sequences():
    """With --sequence-parallel P each row's length is the whole sequence N (a multiple of P) whose
    rank step (N / P tokens, through a simulated group) fits; a P-rank step fits more than one
    GPU's, and the stock setups are refused with the reason. The group is gone afterwards."""
    import torch.distributed as dist

    from remat.planning.estimator import estimate
    from remat.planning.fit import simulated_group

    gpu, reserve = 64 * 2**20, 4 * 2**20
    single = fit(tiny_config(), gpu_memory=gpu, reserve=reserve, setups=("remat:memory",))[0]
    rows = {r.setup: r for r in fit(tiny_config(), gpu_memory=gpu, reserve=reserve, sequence_parallel=2,
                                    setups=("remat:memory", "stock"))}
    assert not dist.is_initialized()
    memory = rows["remat:memory"]
    assert memory.max_seq_len % 2 == 0 and memory.max_seq_len > single.max_seq_len, (memory, single)
    assert memory.peak_bytes <= gpu - reserve and "per rank of 2" in memory.note
    with simulated_group(2) as group:  # one rank's shard of a longer sequence does not fit
        model = build_model(tiny_config())
        set_up(model, "remat:memory", sequence_parallel=group)
        assert estimate(model, seq_len=int(memory.max_seq_len / 2 * 1.02) + 1).peak_bytes > gpu - reserve
    assert rows["stock"].max_seq_len is None and "not estimated under sequence parallelism" in rows["stock"].note
    with pytest.raises(ValueError, match="multiple of sequence_parallel"):
        fit(tiny_config(), gpu_memory=gpu, reserve=reserve, seq_len=33, sequence_parallel=2)


def six_layers():
    return transformers.AutoConfig.for_model(**{**TINY, "num_hidden_layers": 6})


@pytest.mark.parametrize("setup", ["stock", "remat:memory"])
def test_the_answer_fits_and_its_next_step_does_not_by_the_full_simulation(setup):
    """The search runs on the composed estimate; the full simulation agrees with its answer: the
    row's length fits, one step up (1/64, at most 1,024 tokens) does not."""
    from remat.planning.estimator import estimate
    from remat.planning.fit import step_of

    gpu, reserve = 64 * 2**20, 4 * 2**20
    row = fit(six_layers(), gpu_memory=gpu, reserve=reserve, lora_rank=8, setups=(setup,), workers=1)[0]
    assert row.note.startswith("composed from 3, 4 of 6 layers") and row.note.endswith("limited by the device")
    model = set_up(build_model(six_layers(), lora_rank=8), setup)
    n = row.max_seq_len
    assert estimate(model, seq_len=n).peak_bytes == row.peak_bytes <= gpu - reserve
    assert estimate(model, seq_len=n + step_of(n)).peak_bytes > gpu - reserve


def test_the_composed_search_gives_the_exact_searchs_rows():
    kwargs = dict(gpu_memory=64 * 2**20, reserve=4 * 2**20, lora_rank=8, setups=("stock+checkpointing", "remat:memory"))
    fast = fit(six_layers(), **kwargs)  # two forked workers
    exact = fit(six_layers(), exact=True, workers=1, **kwargs)
    assert [(r.max_seq_len, r.peak_bytes, r.host_bytes) for r in fast] == \
        [(r.max_seq_len, r.peak_bytes, r.host_bytes) for r in exact]
    assert all(r.note.startswith("composed from 3, 4 of 6 layers") for r in fast)
    assert all("simulated whole (exact)" in r.note for r in exact)


def test_step_of_is_a_64th_at_most_1024():
    from remat.planning.fit import step_of

    assert [step_of(n) for n in (1, 63, 64, 6400, 65536, 2**20)] == [1, 1, 1, 100, 1024, 1024]


def test_named_gpus_are_their_reported_sizes():
    from remat.planning.fit import GPUS, gpu_memory_of

    assert gpu_memory_of("H100-80GB") == gpu_memory_of("h100 80gb") == 81_559 * 2**20 == GPUS["H100-80GB"]
    with pytest.raises(ValueError, match="unknown GPU 'B300'"):
        gpu_memory_of("B300")


@pytest.mark.parametrize(("content", "message"), [
    (None, "cannot read the config"),
    ("{\"model_type\": \"llama\"", "is not valid JSON"),
    ("[1, 2]", "holds a JSON list, not an object"),
    (json.dumps({"model_type": "llama", "vocab_size": 512}),
     "lacks hidden_size, num_hidden_layers, num_attention_heads: transformers would take its defaults"),
    (json.dumps({**TINY, "model_type": "no-such-model"}), "transformers cannot make a config"),
])
def test_config_files_it_cannot_use_are_refused_with_the_reason(tmp_path, capsys, content, message):
    path = tmp_path / "config.json"
    if content is not None:
        path.write_text(content)
    assert remat_main(["fit", str(path), "--gpu", "H100-80GB"]) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err


@pytest.mark.parametrize("argument", [["--seq-len", "0"], ["--batch-size", "-1"], ["--lora-rank", "-2"],
                                      ["--gpu", "H200", "--gpu-memory", "80GB"]])
def test_bad_command_arguments_exit_2_without_a_traceback(tmp_path, capsys, argument):
    path = tmp_path / "config.json"
    path.write_text(json.dumps(TINY))
    device = [] if "--gpu" in argument else ["--gpu-memory", "64MB", "--reserve", "4MB"]
    with pytest.raises(SystemExit) as exited:  # argparse's exit, with the usage and the reason
        remat_main(["fit", str(path), *device, *argument])
    assert exited.value.code == 2
    err = capsys.readouterr().err
    assert "error: argument" in err and "Traceback" not in err


def test_an_unknown_gpu_name_exits_2_naming_the_known_ones(tmp_path, capsys):
    path = tmp_path / "config.json"
    path.write_text(json.dumps(TINY))
    assert remat_main(["fit", str(path), "--gpu", "B300"]) == 2
    assert "unknown GPU 'B300': choose from H100-80GB, H200" in capsys.readouterr().err


def test_a_failed_row_makes_the_command_exit_1(tmp_path, capsys, monkeypatch):
    path = tmp_path / "config.json"
    path.write_text(json.dumps(TINY))

    def broken(*args, **kwargs):
        raise RuntimeError("simulated failure")

    monkeypatch.setattr(fit_module, "set_up", broken)
    assert remat_main(["fit", str(path), "--gpu-memory", "64MB", "--reserve", "4MB", "--setups", "stock",
                       "--workers", "1"]) == 1
    captured = capsys.readouterr()
    assert "failed: RuntimeError: simulated failure" in captured.out
    assert "1 of 1 rows failed (stock)" in captured.err


def test_gemma2_rows_run_stock_on_eager_attention(tmp_path):
    config = transformers.AutoConfig.for_model(**{**TINY, "model_type": "gemma2", "head_dim": 32})
    rows = {r.setup: r for r in fit(config, gpu_memory=64 * 2**20, reserve=4 * 2**20, setups=("stock", "remat:memory"),
                                    workers=1)}
    assert rows["stock"].max_seq_len and "Hugging Face's eager attention" in rows["stock"].note
    assert rows["remat:memory"].max_seq_len > rows["stock"].max_seq_len


def test_a_family_remat_does_not_patch_says_so_in_its_row():
    config = transformers.AutoConfig.for_model(**{**TINY, "model_type": "gemma", "head_dim": 32})
    rows = fit(config, gpu_memory=64 * 2**20, reserve=4 * 2**20, setups=("stock", "remat:memory"), workers=1)
    assert rows[1].note.startswith("left unchanged: stock (remat fuses no layer of this family)")
    assert rows[1].max_seq_len == rows[0].max_seq_len
