"""torchao Float8 training (memfit.models.float8): accelerate's `mixed_precision="fp8"` (torchao backend)
on the meta model, simulated from torchao's own code.

torch's CPU build runs `torch._scaled_mm`, so the float8 step runs on real CPU tensors too: the fake trace must
equal the real one event for event (as tests/sim/test_exactness.py checks for the other setups). What torchao saves for
backward is read from its installed source, so an upgrade that changes it fails here.
"""

from __future__ import annotations

import inspect
import json

import pytest
import torch
from helpers import B, SEQ, like_fake, tiny_config, trace_key

pytest.importorskip("torchao")

from memfit.cli import main  # noqa: E402
from memfit.errors import MemfitError  # noqa: E402
from memfit.models.float8 import convert_float8  # noqa: E402
from memfit.train_setup import FLOAT8_RECIPES  # noqa: E402
from memfit.sim.engine import simulate  # noqa: E402
from memfit.train_setup import TrainSetup  # noqa: E402

H100 = (9, 0)


def _setup(**kw) -> TrainSetup:
    kw.setdefault("precision", "bf16")
    kw.setdefault("compute_capability", H100)
    kw.setdefault("per_device_train_batch_size", B)
    kw.setdefault("max_length", SEQ)
    return TrainSetup(model=tiny_config("llama"), task="causal-lm", **kw)


def _meta_float8_model(recipe: str):
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(tiny_config("llama"))
    return model, convert_float8(model, recipe)


def test_recipes_and_saved_tensors_are_torchao_s():
    """The recipe names, and what autograd keeps: the high-precision input and the weight, in every recipe."""
    from torchao.float8 import Float8LinearRecipeName
    from torchao.float8.float8_linear import Float8Linear, matmul_with_hp_or_float8_args

    assert FLOAT8_RECIPES == tuple(n.value for n in Float8LinearRecipeName)
    forward = inspect.getsource(matmul_with_hp_or_float8_args.forward)
    assert forward.count("save_for_backward") == 1 and "ctx.save_for_backward(input_hp, weight_hp_t)" in forward
    # the input cast memfit.models.float8.cuda_autocast_queries answers for
    assert "torch.get_autocast_gpu_dtype()" in inspect.getsource(Float8Linear.forward)


def test_accelerate_s_filter_keeps_first_and_last_linear():
    model, converted = _meta_float8_model("tensorwise")
    linears = [n for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)]
    assert linears[0] == "model.layers.0.self_attn.q_proj" and linears[-1] == "lm_head"
    assert converted == linears[1:-1]
    # accelerate's AORecipeKwargs default: inner dims padded to multiples of 16 for the CUDA _scaled_mm
    assert all(model.get_submodule(n).config.pad_inner_dim for n in converted)


@pytest.mark.parametrize("recipe, kw", [(r, {}) for r in FLOAT8_RECIPES]
                         + [("tensorwise", dict(gradient_checkpointing=True)),
                            # 15 tokens: the grad_weight GEMM's inner dim is padded to 16 (pad_inner_dim)
                            ("rowwise", dict(per_device_train_batch_size=1, max_length=15))])
def test_fake_trace_equals_real_cpu_run(recipe, kw):
    setup = _setup(float8_recipe=recipe, **kw)
    with like_fake():
        real = simulate(setup, fake=False, splice=False, optimizer_steps=1)
    fake = simulate(setup, fake=True, splice=False, optimizer_steps=1)
    a, b = trace_key(real.trace), trace_key(fake.trace)
    first = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
    assert a == b, f"first difference at event {first}: real {a[first:first + 3]} fake {b[first:first + 3]}"
    # the float8 casts really ran: float8 storages (1 byte per element) are allocated and freed in the trace
    assert len(a) > len(trace_key(simulate(_setup(**kw), fake=True, splice=False, optimizer_steps=1).trace))
    note = next(n for n in fake.notes if n.startswith("torchao Float8"))
    assert f"`{recipe}`" in note and "13 linears converted" in note and "lm_head" in note


def _activations_at_forward_end(trace) -> int:
    end = max(i for i, e in enumerate(trace) if e.phase == "forward")
    live = {}
    for e in trace[: end + 1]:
        if e.action == "alloc":
            live[e.id] = e
        else:
            live.pop(e.id, None)
    return sum(e.size_bytes for e in live.values() if e.category == "activations")


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise_with_gw_hp"])
def test_saved_activations_lose_exactly_the_bf16_weight_copies(recipe):
    """Under bf16 autocast a plain F.linear saves a bf16 copy of its fp32 weight for backward; Float8Linear saves
    the fp32 weight's view and the same bf16 input (torchao's save_for_backward above). So what is held at the end
    of the forward drops by 2 bytes per weight element of the converted linears, and by nothing else."""
    model, converted = _meta_float8_model(recipe)
    bf16_copies = sum(2 * model.get_submodule(n).weight.numel() for n in converted)
    plain = _activations_at_forward_end(simulate(_setup(), splice=False, optimizer_steps=0).trace)
    float8 = _activations_at_forward_end(simulate(_setup(float8_recipe=recipe), splice=False, optimizer_steps=0).trace)
    assert plain - float8 == bf16_copies > 0


@pytest.mark.parametrize("kw, words", [
    (dict(float8_recipe="blockwise"), "float8 recipe `blockwise` is not one of tensorwise"),
    (dict(float8_recipe=8), "float8 recipe `8`"),
    (dict(float8_recipe="rowwise", precision="fp16"), "precision is `fp16`; use `--precision bf16`"),
    (dict(float8_recipe="rowwise", precision="fp32"), "precision is `fp32`"),
    (dict(float8_recipe="tensorwise", lora_r=4), "LoRA / peft adapters is not modelled"),
])
def test_bad_setups_are_one_line_errors(kw, words):
    with pytest.raises(MemfitError) as err:
        _setup(**kw)
    assert words in str(err.value) and "\n" not in str(err.value)


def test_gpu_without_float8_gemms_is_refused():
    with pytest.raises(MemfitError) as err:
        simulate(_setup(float8_recipe="tensorwise", compute_capability=(8, 0)), splice=False)
    msg = str(err.value)
    assert "compute capability 8.9 or newer" in msg and "`(8, 0)`" in msg and "--gpu H100-80GB" in msg and "\n" not in msg


def test_cli_flag_and_args_file(tmp_path, capsys):
    tiny_config("llama").save_pretrained(tmp_path / "tiny-llama")
    model = str(tmp_path / "tiny-llama")
    base = ["estimate", model, "--task", "causal-lm", "--batch-size", "2", "--max-length", "16", "--precision", "bf16"]
    assert main(base + ["--gpu", "H100-80GB", "--float8", "rowwise", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert any("recipe `rowwise`" in n for n in report["notes"])
    args = tmp_path / "args.json"
    args.write_text(json.dumps({"float8_recipe": "tensorwise"}), encoding="utf-8")
    assert main(base + ["--gpu", "H100-80GB", "--args", str(args), "--json"]) == 0
    assert any("recipe `tensorwise`" in n for n in json.loads(capsys.readouterr().out)["notes"])
    assert main(base + ["--gpu", "A100-80GB", "--float8", "rowwise"]) != 0
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "compute capability 8.9 or newer" in err[0]
