"""`memfit plan --trainer grpo --gpus NxGPU [--vllm-server-gpus K]` on the command line: the flag's one-line
refusal, the JSON of a server layout and the launch files it writes."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("trl")  # the `llm` extra; the `test` extra installs it

from transformers import LlamaConfig  # noqa: E402

from memfit.cli import main  # noqa: E402


def test_server_gpus_without_gpus_is_one_line(capsys):
    rc = main(["plan", "--trainer", "grpo", "--gpu", "A100-80GB", "--vllm-server-gpus", "1", "Qwen/Qwen2.5-0.5B"])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc != 0 and len(err) == 1 and "--vllm-server-gpus" in err[0] and "--gpus" in err[0]


@pytest.mark.slow
def test_server_layout_json_and_launch_files(tmp_path, capsys):
    model = tmp_path / "tiny-llama"
    LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, pad_token_id=0, bos_token_id=1, eos_token_id=2,
                max_position_embeddings=512).save_pretrained(model)
    args = tmp_path / "grpo.json"
    args.write_text(json.dumps({"per_device_train_batch_size": 4, "gradient_accumulation_steps": 2,
                                "num_generations": 4, "max_completion_length": 24, "max_length": 16,
                                "use_vllm": True, "vllm_mode": "colocate"}))
    out = tmp_path / "launch"
    rc = main(["plan", str(model), "--trainer", "grpo", "--args", str(args), "--gpus", "2xA100-80GB",
               "--vllm-server-gpus", "1", "--json", "--write-launch", str(out), "--max-simulations", "3"])
    data = json.loads(capsys.readouterr().out)
    assert rc == 0 and data["schema"] == "memfit.plan.parallel/1" and data["config_class"] == "GRPOConfig"
    best = data["candidates"][data["chosen"]]
    gen = best["generation"]
    assert gen["mode"] == "server" and gen["server_gpus"] == 1 and gen["training_ranks"] == 1
    # one training rank takes the 2 x 8 completions per step the two ranks of the setup had
    assert gen["completions_per_step"] == 16 == best["per_device_train_batch_size"] * \
        best["gradient_accumulation_steps"]
    written = json.loads((out / "training_args.json").read_text())
    assert written["vllm_mode"] == "server" and written["vllm_server_port"] == 8000
    cmds = data["launch"]["commands"]
    assert cmds[0].startswith("CUDA_VISIBLE_DEVICES=0 trl vllm-serve --model ") and cmds[1].startswith(
        "CUDA_VISIBLE_DEVICES=1 ")
