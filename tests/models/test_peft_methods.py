"""peft methods beyond LoRA: `TrainSetup(peft_config=...)` / `use_dora`, built by peft's own
`get_peft_model` on the meta model (memfit.models.peft_methods).

For every method memfit simulates, on a tiny Llama: the trainable parameter count equals peft's
`get_nb_trainable_parameters()` of the same method on a real CPU model, and the training step on real CPU
tensors and on FakeTensors gives the same allocation trace event for event. The methods memfit refuses
(`FAKE_UNSUPPORTED`) really fail under fake tensors without the refusal, and are refused with one line.
"""

from __future__ import annotations

import json

import pytest
import torch
from helpers import like_fake, trace_key
from transformers import LlamaConfig, LlamaForCausalLM

from memfit.errors import MemfitError
from memfit.models import peft_methods
from memfit.peaks import peaks
from memfit.sim import engine
from memfit.sim.engine import simulate
from memfit.models.resolve import resolve
from memfit.train_setup import TrainSetup

T = ["q_proj", "v_proj"]
#: One small configuration per peft type (dimensions chosen to divide the tiny model's: hidden 64, kv 32).
CONFIGS = {
    "ADALORA": dict(target_r=4, init_r=6, total_step=100, target_modules=T),
    "ADAPTION_PROMPT": dict(adapter_len=4, adapter_layers=1),
    "BEFT": dict(target_modules=["v_proj"]),
    "BOFT": dict(boft_block_size=4, target_modules=T),
    "C3A": dict(block_size=16, target_modules=T),
    "DEFT": dict(r=4, target_modules=T),
    "DELORA": dict(r=4, target_modules=T),
    "FOURIERFT": dict(n_frequency=100, target_modules=T),
    "GLORA": dict(r=4, target_modules=T),
    "GRALORA": dict(r=8, target_modules=T),
    "HIRA": dict(r=4, target_modules=T),
    "HRA": dict(r=4, target_modules=T),
    "IA3": dict(target_modules=["k_proj", "v_proj", "down_proj"], feedforward_modules=["down_proj"]),
    "LILY": dict(r=4, target_modules=T),
    "LN_TUNING": dict(),
    "LOHA": dict(r=4, target_modules=T, module_dropout=0.1),
    "LOKR": dict(r=4, target_modules=T),
    "LORA": dict(r=4, target_modules=T, use_dora=True),
    "MISS": dict(r=8, target_modules=T),
    "OFT": dict(r=0, oft_block_size=8, target_modules=T),
    "OSF": dict(target_modules=T),
    "PEANUT": dict(r=4, target_modules=T),
    "PREFIX_TUNING": dict(num_virtual_tokens=4),
    "PROMPT_TUNING": dict(num_virtual_tokens=4),
    "P_TUNING": dict(num_virtual_tokens=4, encoder_hidden_size=32),
    "PSOFT": dict(r=8, target_modules=T),
    "PVERA": dict(r=8, target_modules=T),
    "RANDLORA": dict(r=8, target_modules=T),
    "ROAD": dict(target_modules=T, group_size=16),
    "SHADOW": dict(),
    "SUPERTUNING": dict(),
    "TINYLORA": dict(r=2, target_modules=T),
    "TRAINABLE_TOKENS": dict(target_modules=["embed_tokens"], token_indices=[0, 1]),
    "VERA": dict(r=8, target_modules=T),
}
UNSUPPORTED = {
    "ADAMSS": dict(r=16, target_modules=T),
    "FROD": dict(target_modules=T),
    "SHIRA": dict(r=4, target_modules=T),
    "UNILORA": dict(r=4, target_modules=T),
    "VBLORA": dict(r=4, vector_length=16, num_vectors=32, target_modules=T),
    "WAVEFT": dict(n_frequency=100, target_modules=T),
}


def _config(layers: int = 2) -> LlamaConfig:
    return LlamaConfig(vocab_size=100, hidden_size=64, num_hidden_layers=layers, num_attention_heads=4,
                       num_key_value_heads=2, intermediate_size=128, max_position_embeddings=64, bos_token_id=0,
                       eos_token_id=0)


def _setup(kind: str, kw: dict, layers: int = 2) -> TrainSetup:
    return resolve(TrainSetup(model=_config(layers), task="causal-lm", per_device_train_batch_size=2, max_length=16,
                              optim="adamw_torch", peft_config={"peft_type": kind, **kw}))


def _peft_trainable(kind: str, kw: dict) -> int:
    """peft's own count on a real CPU model (get_nb_trainable_parameters)."""
    from peft import get_peft_config, get_peft_model

    torch.manual_seed(0)
    model = LlamaForCausalLM(_config())
    peft_model = get_peft_model(model, get_peft_config({"peft_type": kind, "task_type": "CAUSAL_LM", **kw}))
    trainable, _total = peft_model.get_nb_trainable_parameters()
    return trainable


def test_every_peft_type_is_covered():
    """Every type peft 0.21 has is simulated here, refused as unsupported, or refused as not built."""
    from peft.mapping import PEFT_TYPE_TO_CONFIG_MAPPING

    covered = set(CONFIGS) | set(peft_methods.FAKE_UNSUPPORTED) | set(peft_methods.NOT_BUILT)
    assert set(PEFT_TYPE_TO_CONFIG_MAPPING) <= covered
    assert set(UNSUPPORTED) == set(peft_methods.FAKE_UNSUPPORTED)


@pytest.mark.parametrize("kind", sorted(CONFIGS))
def test_trainable_count_and_trace_equal_a_real_cpu_run(kind):
    kw = CONFIGS[kind]
    setup = _setup(kind, kw)
    fake = simulate(setup, fake=True, splice=False)
    with like_fake():
        real = simulate(setup, fake=False, splice=False)
    a, b = trace_key(real.trace), trace_key(fake.trace)
    first = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
    assert a == b, f"first difference at event {first}: real {a[first:first + 2]} fake {b[first:first + 2]}"
    assert fake.trainable_params == real.trainable_params == _peft_trainable(kind, kw)
    assert 0 < fake.trainable_params < fake.params
    assert {"forward", "backward", "optimizer"} <= {ev.phase for ev in fake.trace}


def test_dora_through_the_lora_fields():
    """`use_dora=True` on the LoRA fields is peft's DoRA: its magnitude vectors are trained, and the step is exact."""
    base = dict(model=_config(), task="causal-lm", per_device_train_batch_size=2, max_length=16, optim="adamw_torch",
                lora_r=4, lora_target_modules=T)
    lora = simulate(TrainSetup(**base), fake=True, splice=False)
    dora = simulate(TrainSetup(**base, use_dora=True), fake=True, splice=False)
    with like_fake():
        real = simulate(TrainSetup(**base, use_dora=True), fake=False, splice=False)
    assert trace_key(real.trace) == trace_key(dora.trace)
    # one magnitude per output feature of each wrapped layer: q_proj 64 + v_proj 32, 2 layers
    assert dora.trainable_params - lora.trainable_params == 2 * (64 + 32)
    assert dora.trainable_params == _peft_trainable("LORA", dict(r=4, target_modules=T, use_dora=True))
    assert peaks(dora.trace, round_to=1).overall.bytes > peaks(lora.trace, round_to=1).overall.bytes


@pytest.mark.parametrize("kind", sorted(UNSUPPORTED))
def test_unsupported_methods_fail_under_fake_tensors(kind, monkeypatch):
    """The refusal is one line naming the method; without it peft's own code really fails under fake tensors."""
    setup = _setup(kind, UNSUPPORTED[kind])  # the config itself is valid
    with pytest.raises(MemfitError, match=f"peft method {kind} cannot be simulated under fake tensors") as info:
        simulate(setup, fake=True, splice=False)
    assert "\n" not in str(info.value)
    monkeypatch.setattr(peft_methods, "FAKE_UNSUPPORTED", {})
    with pytest.raises(Exception):  # noqa: B017 - whatever peft raises on meta / fake tensors
        simulate(_setup(kind, UNSUPPORTED[kind]), fake=True, splice=False)


@pytest.mark.parametrize("kind", ["LORA", "IA3", "PROMPT_TUNING", "BOFT"])
def test_spliced_equals_full(kind):
    """Methods in SPLICE_OK: simulating 5 of 8 blocks and repeating them gives the full simulation's figures."""
    seen = []
    plain = engine._Runner.run

    def run(self, **kw):
        seen.append(self)
        return plain(self, **kw)

    engine._Runner.run = run
    try:
        spliced = simulate(_setup(kind, CONFIGS[kind], layers=8), splice=True)
        assert seen[-1].cut is not None
        full = simulate(_setup(kind, CONFIGS[kind], layers=8), splice=False)
    finally:
        engine._Runner.run = plain
    a, b = peaks(spliced.trace, round_to=1), peaks(full.trace, round_to=1)
    assert (a.overall.bytes, a.phase_of_peak, len(spliced.trace)) == (b.overall.bytes, b.phase_of_peak, len(full.trace))
    assert spliced.trainable_params == full.trainable_params


def test_adalora_is_not_spliced():
    """AdaLoRA's orthogonality loss spans every block's adapters: the cut model would have fewer."""
    assert not peft_methods.splice_allowed(_setup("ADALORA", CONFIGS["ADALORA"]))
    assert peft_methods.splice_allowed(_setup("IA3", CONFIGS["IA3"]))


# -- inputs -----------------------------------------------------------------------------------------------------
def _bad(match: str, **kw):
    with pytest.raises(MemfitError, match=match) as info:
        resolve(TrainSetup(model=_config(), task="causal-lm", **kw))
    assert "\n" not in str(info.value)


def test_bad_peft_configs_are_one_line_errors():
    _bad(r"unknown peft_type `IA4`.*did you mean `IA3`", peft_config={"peft_type": "IA4"})
    _bad(r"has no `peft_type`", peft_config={"r": 8})
    _bad(r"unknown key `rank` for peft_type `LOHA`", peft_config={"peft_type": "LOHA", "rank": 8})
    _bad(r"peft rejects `peft_config` \(OFT\)", peft_config={"peft_type": "OFT", "r": 0, "oft_block_size": 0})
    _bad(r"must be a dict with `peft_type`", peft_config=[1, 2])
    _bad(r"not a JSON object", peft_config="{nope")
    _bad(r"both `lora_r` and `peft_config`", lora_r=8, peft_config={"peft_type": "IA3"})
    _bad(r"`use_dora` is a LoRA setting", use_dora=True)
    _bad(r"`use_dora` must be true or false", lora_r=4, use_dora="yes")
    _bad(r"peft_type `XLORA` is not modelled", peft_config={"peft_type": "XLORA"})


def test_peft_config_objects_and_json_are_read():
    from peft import IA3Config

    obj = resolve(TrainSetup(model=_config(), task="causal-lm", peft_config=IA3Config(target_modules=["k_proj"],
                                                                                    feedforward_modules=[])))
    assert obj.peft_config["peft_type"] == "IA3" and obj.peft_config["target_modules"] == ["k_proj"]
    json.dumps(obj.peft_config)  # cacheable
    text = resolve(TrainSetup(model=_config(), task="causal-lm", peft_config='{"peft_type": "ia3"}'))
    assert text.peft_config["peft_type"] == "ia3"
    assert peft_methods.setup_config(text).task_type == "CAUSAL_LM"  # memfit's task, as for LoRA


def test_cli_peft_config_and_use_dora(tmp_path, capsys):
    from memfit.cli import main

    cfg_dir = tmp_path / "model"
    cfg_dir.mkdir()
    (cfg_dir / "config.json").write_text(json.dumps({**_config().to_dict(), "architectures": ["LlamaForCausalLM"]}))
    adapter = tmp_path / "adapter"
    adapter.mkdir()
    (adapter / "adapter_config.json").write_text(json.dumps({"peft_type": "IA3", "target_modules": ["v_proj"],
                                                             "feedforward_modules": []}))
    common = [str(cfg_dir), "--batch-size", "2", "--max-length", "16", "--json", "--no-cache"]
    assert main(["estimate", *common, "--peft-config", str(adapter)]) == 0
    ia3 = json.loads(capsys.readouterr().out)
    assert ia3["trainable_params"] == 2 * 32  # one scaling vector per v_proj output feature, 2 layers
    assert main(["estimate", *common, "--lora-r", "4", "--use-dora"]) == 0
    dora = json.loads(capsys.readouterr().out)
    assert dora["setup"]["use_dora"] is True
    assert main(["estimate", *common, "--peft-config", str(tmp_path / "missing.json")]) != 0
    assert "does not exist" in capsys.readouterr().err
    args = tmp_path / "args.json"  # the same method from an --args file
    args.write_text(json.dumps({"peft_config": json.loads((adapter / "adapter_config.json").read_text())}))
    assert main(["estimate", *common, "--args", str(args)]) == 0
    assert json.loads(capsys.readouterr().out)["trainable_params"] == ia3["trainable_params"]


def test_quantized_base_takes_the_methods_peft_has_bitsandbytes_layers_for():
    """IA3 (peft.tuners.ia3.bnb) and prompt tuning run on a 4-bit base; LoHa, which has no bnb layers, is one line."""
    pytest.importorskip("bitsandbytes")
    from memfit import estimate

    base = dict(model=_config(), task="causal-lm", per_device_train_batch_size=2, max_length=16, load_in_4bit=True)
    ia3 = estimate(TrainSetup(**base, peft_config={"peft_type": "IA3", **CONFIGS["IA3"]}))
    assert ia3.trainable_params == _peft_trainable("IA3", CONFIGS["IA3"])
    assert estimate(TrainSetup(**base, peft_config={"peft_type": "PROMPT_TUNING", "num_virtual_tokens": 4})).quantization
    with pytest.raises(MemfitError, match=r"peft method LOHA on 4-/8-bit weights is not modelled.*IA3") as info:
        estimate(TrainSetup(**base, peft_config={"peft_type": "LOHA", **CONFIGS["LOHA"]}))
    assert "\n" not in str(info.value)
    assert {"LORA", "ADALORA", "IA3"} <= set(peft_methods.quantized_peft_types())


def test_preflight_reads_a_peft_models_method(tmp_path):
    """A Trainer of an IA3 peft model is estimated as that IA3 model, not as full fine-tuning."""
    from peft import IA3Config, get_peft_model
    from transformers import Trainer, TrainingArguments

    from memfit.fitting.preflight_check import setup_from_trainer

    torch.manual_seed(0)
    model = get_peft_model(LlamaForCausalLM(_config()), IA3Config(task_type="CAUSAL_LM", **CONFIGS["IA3"]))
    args = TrainingArguments(str(tmp_path), per_device_train_batch_size=2, report_to="none", use_cpu=True)
    data = [{"input_ids": [1, 2, 3, 4], "labels": [1, 2, 3, 4]}] * 4
    setup, _ = setup_from_trainer(Trainer(model=model, args=args, train_dataset=data))
    assert setup.peft_config["peft_type"] == "IA3" and setup.lora_r is None
    assert simulate(setup, fake=True).trainable_params == model.get_nb_trainable_parameters()[0]


def test_the_report_says_what_is_simulated_differently():
    adalora = simulate(_setup("ADALORA", CONFIGS["ADALORA"]), fake=True, splice=False)
    assert any("update_and_allocate" in n for n in adalora.notes)
    prompt = simulate(_setup("PROMPT_TUNING", CONFIGS["PROMPT_TUNING"]), fake=True, splice=False)
    assert any("virtual tokens" in n for n in prompt.notes)
    loha = simulate(_setup("LOHA", CONFIGS["LOHA"]), fake=True, splice=False)  # module_dropout 0.1
    assert any("module_dropout" in n for n in loha.notes)
    assert not any("peft" in n for n in simulate(_setup("IA3", CONFIGS["IA3"]), fake=True, splice=False).notes)


@pytest.mark.parametrize("bits", [4, 8])
def test_dora_on_quantized_weights_dequantizes_them(bits, monkeypatch):
    """QDoRA: DoRA's weight norm dequantizes the bitsandbytes weight (peft's `dequantize_bnb_weight` ops), which
    memfit's stand-in parameters get through models._peft_adapter; without it 4-bit DoRA used the packed storage."""
    bnb = pytest.importorskip("bitsandbytes")
    from memfit import estimate

    name = "dequantize_4bit" if bits == 4 else "int8_vectorwise_dequant"
    calls = []
    original = getattr(bnb.functional, name)
    monkeypatch.setattr(bnb.functional, name, lambda *a, **k: calls.append(1) or original(*a, **k))
    quant = dict(load_in_4bit=True, bnb_4bit_quant_type="nf4") if bits == 4 else dict(load_in_8bit=True)
    report = estimate(TrainSetup(model=_config(), task="causal-lm", per_device_train_batch_size=2, max_length=16,
                                 lora_r=4, lora_target_modules=T, use_dora=True, **quant))
    assert calls  # DoRA's forward dequantized the base weights
    assert report.trainable_params == _peft_trainable("LORA", dict(r=4, target_modules=T, use_dora=True))
