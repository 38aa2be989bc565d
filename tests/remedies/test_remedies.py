"""Each remedy's saving, predicted on fake tensors, equals the saving of a real CPU run and has the right sign."""

import pytest
import torch
from transformers import BertConfig, XLNetConfig

from memfit.errors import MemfitError
from memfit.remedies import OPT_IN, REGISTRY
from memfit.peaks import peaks
from memfit.sim.engine import simulate
from memfit.train_setup import TrainSetup

BERT = BertConfig(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=128, vocab_size=300)
XLNET = XLNetConfig(d_model=64, n_layer=2, n_head=4, d_inner=128, vocab_size=300)


def _peak(setup, *, fake, phase=None):
    tp = peaks(simulate(setup, fake=fake, splice=False).trace, round_to=1)
    return tp.overall.bytes if phase is None else tp.by_phase[phase].bytes


@pytest.fixture(scope="module", autouse=True)
def warm():
    simulate(TrainSetup(model=BERT, per_device_train_batch_size=2, max_length=16), fake=False, splice=False)


# (remedy, model, base setup, changes, phase whose peak must drop)
CASES = [
    ("gradient_checkpointing", XLNET, dict(per_device_train_batch_size=4, max_length=64), {"gradient_checkpointing": True}, None),
    ("micro_batch", BERT, dict(per_device_train_batch_size=8, gradient_accumulation_steps=1, max_length=64),
     {"per_device_train_batch_size": 2, "gradient_accumulation_steps": 4}, None),
    ("optimizer", BERT, dict(per_device_train_batch_size=2, max_length=16), {"optim": "adafactor"}, None),
    ("eval_settings", BERT, dict(per_device_train_batch_size=2, max_length=64, eval_strategy="epoch",
                                 per_device_eval_batch_size=16, eval_samples=32), {"per_device_eval_batch_size": 2}, "eval"),
    ("freeze", BERT, dict(per_device_train_batch_size=2, max_length=16), {"freeze_embeddings": True}, None),
    ("lora", BERT, dict(per_device_train_batch_size=2, max_length=16), {"lora_r": 4}, None),
    ("offload", BERT, dict(per_device_train_batch_size=2, max_length=16), {"offload_optimizer_state": True}, None),
    ("truncation", BERT, dict(per_device_train_batch_size=4, max_length=128), {"max_length": 32}, None),
]


@pytest.mark.parametrize("name, config, base, changes, phase", CASES, ids=[c[0] for c in CASES])
def test_saving_matches_a_real_cpu_run(name, config, base, changes, phase):
    before = TrainSetup(model=config, **base)
    after = before.replace(**changes)
    fake_saving = _peak(before, fake=True, phase=phase) - _peak(after, fake=True, phase=phase)
    real_saving = _peak(before, fake=False, phase=phase) - _peak(after, fake=False, phase=phase)
    assert fake_saving > 0, f"{name} should save memory"
    assert fake_saving == real_saving


def test_mixed_precision_saves_activations_but_not_states():
    # fp16 AMP on the CPU runs the same code path as the simulation; states stay fp32
    s = TrainSetup(model=XLNET, per_device_train_batch_size=8, max_length=128)
    fp32 = peaks(simulate(s).trace, round_to=1)
    amp = peaks(simulate(s.replace(precision="fp16")).trace, round_to=1)
    for key in ("weights", "gradients", "optimizer_state"):
        assert amp.by_phase["optimizer"].breakdown[key] == fp32.by_phase["optimizer"].breakdown[key]
    assert amp.by_phase["backward"].breakdown["activations"] < fp32.by_phase["backward"].breakdown["activations"]


def test_every_remedy_is_documented_and_checkable():
    s = TrainSetup(model=BERT)
    for name, remedy in REGISTRY.items():
        verdict = remedy.check(s, None)
        assert isinstance(verdict.reason, str) and verdict.reason
        assert remedy.saves and remedy.costs and remedy.title
    assert set(OPT_IN) == {"truncation", "lora", "freeze", "offload", "qlora", "fewer_generations",
                           "shorter_completions", "no_reference", "freeze_vision_tower", "smaller_images",
                           "no_pan_and_scan", "fewer_beams", "shorter_generation"}
    # padding never counts as making a run fit: the peak is set by the longest batch
    assert REGISTRY["padding"].check(s, None).applies is False


def test_frozen_lower_blocks_save_gradients_and_state_like_a_real_run():
    base = TrainSetup(model=XLNET.__class__(**{**XLNET.to_dict(), "n_layer": 4}), per_device_train_batch_size=2,
                      max_length=32)
    frozen = base.replace(freeze_layers=2)
    for fake in (True, False):
        a = peaks(simulate(base, fake=fake, splice=False).trace, round_to=1).by_phase["optimizer"].breakdown
        b = peaks(simulate(frozen, fake=fake, splice=False).trace, round_to=1).by_phase["optimizer"].breakdown
        assert b["gradients"] < a["gradients"] and b["optimizer_state"] < a["optimizer_state"]
    fake_saving = _peak(base, fake=True) - _peak(frozen, fake=True)
    assert fake_saving > 0 and fake_saving == _peak(base, fake=False) - _peak(frozen, fake=False)


def test_freeze_layers_out_of_range_is_a_clear_error():
    from memfit.errors import MemfitError

    with pytest.raises(MemfitError, match="freeze at most 2"):
        simulate(TrainSetup(model=XLNET, per_device_train_batch_size=1, max_length=16, freeze_layers=5))
    with pytest.raises(MemfitError, match="freeze_layers"):
        TrainSetup(model=XLNET, freeze_layers=-1)


# -- one remedy, one unit ----------------------------------------------------------------------

def test_every_setup_field_a_remedy_changes_has_one_owner():
    from memfit.remedies import REGISTRY, remedy_for_field

    setup = TrainSetup(model=BERT, per_device_train_batch_size=4, gradient_accumulation_steps=2, max_length=256,
                       eval_strategy="epoch")
    for r in REGISTRY.values():
        for f in r.fields:
            sharing = [o for o in REGISTRY.values() if f in o.fields]
            if len(sharing) == 1:
                assert remedy_for_field(f) is r, f
            else:  # a shared field (gradient_checkpointing_kwargs): each says which of its changes are its own
                assert all(o.owns is not None for o in sharing), (f, [o.name for o in sharing])
                assert remedy_for_field(f) is sharing[0], f  # memfit.fit sets it whole through the first
                for v in r.variants(setup, None):
                    assert [o.name for o in sharing if o.owns(v, setup)] == [r.name], (r.name, v)
        for v in (r.variants(TrainSetup(model=BERT, per_device_train_batch_size=4, gradient_accumulation_steps=2,
                                        max_length=256, eval_strategy="epoch"), None)
                  if r.name not in ("freeze",) else []):
            assert set(v) <= set(r.fields), (r.name, v)  # a variant only changes what its remedy owns


def test_incompatible_remedies_are_never_combined_in_a_plan():
    from memfit.remedies import REGISTRY, conflict

    assert conflict(["offload", "optimizer"]) and conflict(["freeze", "lora"])
    assert conflict(["mixed_precision", "gradient_checkpointing"]) is None
    for r in REGISTRY.values():
        assert all(name in REGISTRY for name in r.incompatible), r.name


def test_offload_config_names_an_optimizer_deepspeed_accepts():
    """Without an "optimizer" section DeepSpeed refuses Trainer's AdamW under ZeRO-Offload
    (zero_force_ds_cpu_optimizer defaults to True)."""
    from memfit.remedies import REGISTRY

    args, _, _ = REGISTRY["offload"].apply({"offload_optimizer_state": True}, None)
    ds = args["deepspeed"]
    assert ds["zero_optimization"]["offload_optimizer"]["device"] == "cpu"
    assert ds["optimizer"]["type"] == "AdamW"


def test_diagnose_advice_ids_of_remedies_exist_and_are_owned_once():
    from memfit.diagnosis.strings import MESSAGES
    from memfit.remedies import REGISTRY

    owners: dict[str, str] = {}
    for r in REGISTRY.values():
        for a in r.advice:
            assert a not in owners, (a, owners.get(a), r.name)
            owners[a] = r.name
            assert any(k == f"advice.{a}" or k.startswith(f"advice.{a}.") for k in MESSAGES), a


def test_a_remedy_has_one_id_its_module_the_registry_allow_and_advice_share():
    import importlib

    from memfit.remedies import ALIASES, remedy_for_advice

    for name, r in REGISTRY.items():
        assert r.name == name and importlib.import_module(f"memfit.remedies.{name}").REMEDY is r
        assert all(a == name or a.startswith(f"{name}.") for a in r.advice), (name, r.advice)
        assert all(remedy_for_advice(a) is r for a in r.advice)
    assert OPT_IN == tuple(name for name, r in REGISTRY.items() if r.opt_in)  # the `--allow` names are the ids
    assert set(ALIASES.values()) <= set(REGISTRY) and not set(ALIASES) & set(REGISTRY)


def test_an_earlier_remedy_name_is_accepted_with_a_warning():
    from memfit.planner.search import _check_options
    from memfit.remedies import remedy_id

    with pytest.warns(FutureWarning, match="`sequence_length` is called `truncation`"):
        assert remedy_id("sequence_length") == "truncation"
    with pytest.warns(FutureWarning):
        assert _check_options(margin=0.05, allow=("sequence_length",), exclude=()) == ("truncation",)
    assert remedy_id("lora") == "lora"
    with pytest.raises(MemfitError, match="cannot allow `shorter`"):
        _check_options(margin=0.05, allow=("shorter",), exclude=())


@pytest.mark.parametrize("current, paged, bnb, expected", [
    ("adamw_torch", True, True, ("adamw_bnb_8bit", "adafactor", "paged_adamw_8bit", "paged_adamw_32bit")),
    ("adamw_torch", False, True, ("adamw_bnb_8bit", "adafactor")),  # the multi-GPU search: no managed memory
    ("adamw_torch", False, False, ("adafactor",)),  # fit without bitsandbytes or off CUDA
    ("adamw_bnb_8bit", True, True, ("paged_adamw_8bit",)),  # 8-bit already: only the paging is new
    ("adamw_bnb_8bit", False, True, ()),
    ("paged_adamw_32bit", True, True, ("adamw_bnb_8bit", "adafactor", "paged_adamw_8bit")),
    ("adafactor", True, True, ()), ("sgd", True, True, ()), ("lion_8bit", False, True, ()),
])
def test_one_answer_to_which_smaller_optimizer(current, paged, bnb, expected):
    from memfit.remedies.optimizer import smaller_optimizers

    assert smaller_optimizers(current, paged=paged, bitsandbytes=bnb) == expected
    if paged and bnb:  # the remedy's variants are that answer
        setup = TrainSetup(model=BERT, optim=current)
        assert [v["optim"] for v in REGISTRY["optimizer"].variants(setup, None)] == list(expected)


def test_apply_plan_goes_through_the_remedies(tmp_path):
    import sys

    sys.path.insert(0, str(__import__("pathlib").Path(__file__).resolve().parents[1]))  # tests/: helpers
    from helpers import tiny_trainer

    from memfit.fitting.run import apply_plan

    t = tiny_trainer(tmp_path, bs=8, ga=2)
    log: list[str] = []
    applied = apply_plan(t, {"per_device_train_batch_size": 4, "gradient_accumulation_steps": 4, "lora_r": 8,
                             "per_device_eval_batch_size": 2}, log)
    assert applied == {"per_device_train_batch_size": 4, "gradient_accumulation_steps": 4,
                       "per_device_eval_batch_size": 2}
    assert t.args.per_device_train_batch_size == 4 and t.args.gradient_accumulation_steps == 4
    assert any("lora_r=8 not applied automatically" in line for line in log)


def test_diagnose_names_the_remedies_its_advice_recommends():
    from memfit.diagnosis import diagnose

    d = diagnose("torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 4.00 GiB. GPU 0 has a total capacity "
                 "of 15.78 GiB of which 100.00 MiB is free. Of the allocated memory 14.90 GiB is allocated by PyTorch, "
                 "and 20.00 MiB is reserved by PyTorch but unallocated.")
    assert d.remedies and all(name in REGISTRY for name in d.remedies)
    assert "micro_batch" in d.remedies
