"""The configuration files users already have (tests/data/real_configs, sources in its SOURCES.md): each is estimated
with the per-rank figure its engine allocates, or refused in one line naming the key; never a traceback.

The figure checked is the optimizer state per GPU at the optimizer step, in closed form from the engine's code for a
full AdamW fine-tune of the model (P parameters, N ranks): DDP keeps Adam's two fp32 moments of every parameter
(8 P); FSDP1 / FSDP2 shard fp32 parameters and their moments (8 P / N); DeepSpeed ZeRO with fp16 / bf16 holds a fp32
master partition and two moments (12 P / N, stage_1_and_2.py / stage3.py `single_partition_of_fp32_groups` and
`fp32_partitioned_groups_flat`); offloaded optimizer state holds none on the GPU.
"""

import json

import pytest
import yaml

from helpers import DATA_DIR
from memfit.errors import MemfitError
from memfit.parallel import parallel_from_accelerate_config, zero_settings_from_deepspeed
from memfit.parallel.deepspeed_rules import check_batch_keys
from memfit.process import main

REAL = DATA_DIR / "real_configs"

#: file -> (extra flags, expected: ("ok", strategy, world, precision, optimizer bytes per parameter before sharding) or
#: ("refused", the key the one-line error names)). Flags are what the file's own recipe passes to the Trainer.
CASES = {
    "trl_deepspeed_zero1.yaml": ([], ("ok", "zero1", 8, "bf16", 12)),
    "trl_deepspeed_zero2.yaml": ([], ("ok", "zero2", 8, "bf16", 12)),
    "trl_deepspeed_zero3.yaml": ([], ("ok", "zero3", 8, "bf16", 12)),
    "trl_fsdp2.yaml": ([], ("ok", "fsdp", 8, "bf16", 8)),
    "trl_fsdp_qlora.yaml": ([], ("refused", "fsdp_offload_params")),
    "trl_multi_gpu.yaml": ([], ("ok", "ddp", 8, "fp32", 8)),
    "peft_fsdp_config.yaml": ([], ("ok", "fsdp", 8, "bf16", 8)),
    "peft_deepspeed_config.yaml": ([], ("ok", "zero3", 8, "bf16", 12)),
    "peft_deepspeed_config_z3_qlora.yaml": ([], ("ok", "zero3", 2, "bf16", 12)),
    "accelerate_template_deepspeed.yaml": ([], ("ok", "zero1", 2, "fp16", 12)),
    "accelerate_template_fsdp.yaml": ([], ("ok", "fsdp", 2, "bf16", 8)),
    "transformers_ds_config_zero2.json": (["--gpus", "8xA100-80GB", "--precision", "bf16"],
                                          ("ok", "zero2", 8, "bf16", 0)),  # optimizer offloaded to the CPU
    "transformers_ds_config_zero3.json": (["--gpus", "8xA100-80GB", "--precision", "bf16"],
                                          ("ok", "zero3", 8, "bf16", 0)),
    "accelerate_zero_stage1_config.json": (["--gpus", "2xA100-80GB"], ("ok", "zero1", 2, "fp16", 12)),
    "accelerate_zero_stage3_offload_config.json": (["--gpus", "2xA100-80GB"], ("ok", "zero3", 2, "fp16", 0)),
    "deepspeedexamples_tensor_parallel_ds_config.json": (["--gpus", "8xA100-80GB", "--precision", "bf16"],
                                                         ("ok", "zero2", 8, "bf16", 12)),
    "deepspeedexamples_llama_7b_single_node.json": (["--gpus", "8xA100-80GB", "--batch-size", "4", "--grad-accum", "4"],
                                                    ("ok", "zero2", 8, "bf16", 12)),
}


def test_every_vendored_file_has_a_case():
    files = {p.name for p in REAL.iterdir() if p.suffix in (".json", ".yaml")}
    assert files == set(CASES)


@pytest.mark.parametrize("name", sorted(CASES))
def test_reads_in_one_line_or_refuses_naming_the_key(name):
    """Without a simulation: memfit's readers of the file."""
    flags, expected = CASES[name]
    path = REAL / name
    try:
        if path.suffix == ".yaml":
            trainer = flags[flags.index("--precision") + 1] if "--precision" in flags else None
            acc = parallel_from_accelerate_config(path, hidden_size=64, trainer_precision=trainer)
            par, precision = acc.parallel, acc.precision
            raw = yaml.safe_load(path.read_text())
            assert par.world_size == raw["num_processes"]
        else:
            config = json.loads(path.read_text())
            trainer = flags[flags.index("--precision") + 1] if "--precision" in flags else "fp32"
            zero, notes = zero_settings_from_deepspeed(config, hidden_size=64, precision=trainer)
            precision = zero.dtype
            par = None
    except MemfitError as err:
        assert "\n" not in str(err)
        assert expected[0] == "refused" and expected[1] in str(err), str(err)
        return
    if expected[0] == "refused":  # refused by the simulation of the engine (the slow test checks the message)
        return
    if par is not None:
        assert (par.strategy, par.world_size, precision) == expected[1:4]
    else:
        assert precision == expected[3]


def test_a_train_batch_size_for_other_gpus_is_refused_naming_it():
    config = json.loads((REAL / "deepspeedexamples_llama_7b_single_node.json").read_text())
    check_batch_keys(config, micro_batch=4, accumulation=4, world_size=8)  # 4 x 4 x 8 = 128, as the file says
    with pytest.raises(MemfitError, match="`train_batch_size` `128`"):
        check_batch_keys(config, micro_batch=4, accumulation=4, world_size=4)


_LLAMA = dict(vocab_size=1000, hidden_size=256, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
              intermediate_size=512, max_position_embeddings=512)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from transformers import LlamaConfig

    path = tmp_path_factory.mktemp("llama")
    LlamaConfig(**_LLAMA).save_pretrained(path)
    return str(path)


@pytest.fixture(scope="module")
def model_params():
    """P: the parameters of the model transformers builds from that config (counted on the meta device)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    with torch.device("meta"):
        model = LlamaForCausalLM(LlamaConfig(**_LLAMA))
    return sum(p.numel() for p in model.parameters())


@pytest.mark.parametrize("name", sorted(CASES))  # one simulation per file, about a second each
def test_estimated_per_rank_as_the_engine_allocates(name, model_dir, model_params, capsys):
    flags, expected = CASES[name]
    path = REAL / name
    engine = ["--accelerate-config", str(path)] if path.suffix == ".yaml" else ["--deepspeed", str(path)]
    code = main(["estimate", model_dir, "--task", "causal-lm", "--max-length", "64", "--gpu", "A100-80GB",
                 "--no-cache", "--json", *engine, *flags])
    out, err = capsys.readouterr()
    if expected[0] == "refused":
        assert code == 2 and len(err.strip().splitlines()) == 1 and expected[1] in err
        return
    assert code == 0, err
    data = json.loads(out)
    par = data["parallel"]
    assert (par["strategy"], par["world_size"], data["setup"]["precision"]) == expected[1:4]
    n = par["world_size"]
    want = expected[4] * model_params // (1 if par["strategy"] == "ddp" else n)
    got = data["phase_breakdowns"].get("optimizer", {}).get("optimizer_state", 0)  # offloaded: no GPU step
    assert abs(got - want) <= 0.02 * want + 64 * 1024, (got, want)
    if par["strategy"].startswith("zero"):  # DeepSpeed's estimator figure comes with why it differs
        assert any("DeepSpeed's own model-state estimator" in n and "another quantity" in n for n in data["notes"])
    if "tensor_parallel" in name:
        assert any("autotp_size` 4" in note for note in data["notes"])


def test_estimate_refuses_the_batch_of_other_gpus(model_dir, capsys):
    path = REAL / "deepspeedexamples_llama_7b_single_node.json"
    assert main(["estimate", model_dir, "--task", "causal-lm", "--max-length", "64", "--deepspeed", str(path),
                 "--gpus", "4xA100-80GB", "--batch-size", "4", "--grad-accum", "4"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "train_batch_size" in err
