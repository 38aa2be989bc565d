import json

import pytest

from memfit.errors import MemfitError
from memfit.train_setup import TrainSetup


def test_defaults_mirror_training_arguments():
    s = TrainSetup()
    assert s.per_device_train_batch_size == 8 and s.per_device_eval_batch_size == 8
    assert s.optim == "adamw_torch_fused"  # the transformers 5 default
    assert s.effective_batch_size == 8


@pytest.mark.parametrize(
    "kwargs, fragment",
    [
        ({"per_device_train_batch_size": 0}, "per_device_train_batch_size"),
        ({"gradient_accumulation_steps": -1}, "gradient_accumulation_steps"),
        ({"max_length": 0}, "max_length"),
        ({"optim": "adamw_foo"}, "adamw_foo"),
        ({"precision": "fp8"}, "fp8"),
        ({"task": "translation-to-klingon"}, "translation-to-klingon"),
        ({"attn_implementation": "flash"}, "flash"),
        ({"example_lengths": []}, "example_lengths"),
        ({"example_lengths": [3, -1]}, "example_lengths"),
        ({"precision": "bf16", "compute_capability": (7, 0)}, "bf16"),
        ({"weights_dtype": "int4"}, "int4"),
    ],
)
def test_bad_values_name_the_value(kwargs, fragment):
    with pytest.raises(MemfitError) as err:
        TrainSetup(**kwargs)
    assert fragment in str(err.value)
    assert "`" in str(err.value)


def test_fp16_and_bf16_together_is_an_error():
    with pytest.raises(MemfitError, match="fp16=True.*bf16=True"):
        TrainSetup.from_kwargs("bert-base-uncased", training_args={"fp16": True, "bf16": True})


def test_legacy_evaluation_strategy_is_read_with_a_note():
    s = TrainSetup.from_kwargs("xlnet-large-cased", training_args={"evaluation_strategy": "epoch"})
    assert s.eval_strategy == "epoch"
    assert any("evaluation_strategy" in n and "eval_strategy" in n for n in s.notes)


def test_from_json(tmp_path):
    path = tmp_path / "args.json"
    path.write_text(json.dumps({"per_device_train_batch_size": 2, "gradient_accumulation_steps": 4, "fp16": True,
                                "evaluation_strategy": "steps", "learning_rate": 3e-5}))
    s = TrainSetup.from_json(path, "bert-base-uncased")
    assert (s.per_device_train_batch_size, s.gradient_accumulation_steps, s.precision) == (2, 4, "fp16")
    assert s.eval_strategy == "steps" and s.effective_batch_size == 8


@pytest.mark.parametrize("content, fragment", [("{not json", "not valid JSON"), ("[1, 2]", "JSON object")])
def test_from_json_bad_file(tmp_path, content, fragment):
    path = tmp_path / "args.json"
    path.write_text(content)
    with pytest.raises(MemfitError, match=fragment):
        TrainSetup.from_json(path)


def test_from_json_missing_file(tmp_path):
    with pytest.raises(MemfitError, match="does not exist"):
        TrainSetup.from_json(tmp_path / "nope.json")


def test_from_training_args_object(tmp_path):
    from transformers import TrainingArguments

    args = TrainingArguments(output_dir=str(tmp_path), per_device_train_batch_size=3, gradient_accumulation_steps=5,
                             optim="adafactor", eval_strategy="epoch", weight_decay=0.01, use_cpu=True,
                             report_to="none")
    s = TrainSetup.from_training_args(args, "bert-base-uncased")
    assert (s.per_device_train_batch_size, s.gradient_accumulation_steps, s.optim) == (3, 5, "adafactor")
    assert s.eval_strategy == "epoch" and s.weight_decay == 0.01


def test_worst_batch_from_example_lengths():
    s = TrainSetup(example_lengths=[30, 700, 4000], max_length=512)
    assert s.sequence_length == 512
    s = TrainSetup(example_lengths=[30, 700, 4000], max_length=512, truncation=False)
    assert s.sequence_length == 4000


def test_unknown_field_is_an_error():
    with pytest.raises(MemfitError, match="unknown setting `batch`"):
        TrainSetup.from_kwargs("bert-base-uncased", batch=3)
