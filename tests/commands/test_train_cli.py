"""`memfit train`: bad inputs fail before training with one clear line; a tiny end-to-end run."""

import json

import pytest

pytest.importorskip("transformers")
from memfit.cli import main  # noqa: E402
from memfit.commands.train import bundled_data_path, bundled_model_dir, load_examples  # noqa: E402
from memfit.errors import MemfitError  # noqa: E402


def _run(argv, capsys):
    code = main(["train"] + argv)
    return code, capsys.readouterr()


@pytest.fixture
def csv_file(tmp_path):
    p = tmp_path / "d.csv"
    p.write_text("text,label\ngood film,1\nbad film,0\nfine,1\nawful,0\nnice,1\n", encoding="utf-8")
    return p


def test_bundled_dataset_is_valid():
    texts, labels = load_examples(bundled_data_path(), "text", "label")
    assert 200 <= len(texts) <= 400 and set(labels) == {0, 1}


@pytest.mark.parametrize("content,ext,match", [
    ("text,label\n", ".csv", "no examples"),
    ("review,label\nhi,1\n", ".csv", "column `text` is not in"),
    ("text,label\nhi,positive\n", ".csv", "not an integer class id"),
    ("text,label\nhi,1.5\n", ".csv", "not an integer class id"),
    ('{"text": "hi", "label": 1}\n{"text": "x"\n', ".jsonl", "line 2"),
    ('[{"text": "hi", "label": -1}]', ".json", "negative"),
    ("a", ".txt", "extension"),
])
def test_bad_data_files(tmp_path, content, ext, match):
    p = tmp_path / f"d{ext}"
    p.write_text(content, encoding="utf-8")
    with pytest.raises(MemfitError, match=match):
        load_examples(str(p), "text", "label")


def test_jsonl_and_json_load(tmp_path):
    p = tmp_path / "d.jsonl"
    p.write_text('{"t": "a", "y": 1}\n{"t": "b", "y": "0"}\n', encoding="utf-8")
    assert load_examples(str(p), "t", "y") == (["a", "b"], [1, 0])
    q = tmp_path / "d.json"
    q.write_text(json.dumps({"data": [{"text": "a", "label": 2}]}), encoding="utf-8")
    assert load_examples(str(q), "text", "label") == (["a"], [2])


def test_cli_errors_are_one_line(tmp_path, csv_file, capsys):
    model = bundled_model_dir()
    cases = [
        (["--task", "causal-lm"], "only `--task seq-cls`"),
        (["--task", "nonsense"], "unknown task"),
        ([str(tmp_path / "nope"), "--data", str(csv_file)], "not a local directory"),
        ([str(tmp_path), "--data", str(csv_file)], "no config.json"),
        (["--batch-size", "0"], "positive integer"),
        (["--budget", "0"], "is zero"),
        (["--resume", str(tmp_path / "nope")], "is not a folder"),
        ([str(tmp_path)], "give both a model and --data"),
    ]
    if model:
        cases += [
            ([model, "--data", str(tmp_path / "missing.csv")], "does not exist"),
            ([model, "--data", str(csv_file), "--text-column", "review"], "--text-column"),
            ([model, "--data", str(csv_file), "--num-labels", "1"], "does not fit a head of 1 labels"),
            ([model, "--data", str(csv_file), "--resume", "--output-dir", str(tmp_path / "fresh")],
             "holds no checkpoint-N folder"),
        ]
    for argv, match in cases:
        code, out = _run(argv, capsys)
        assert code == 2, argv
        assert match in out.err and out.err.count("\n") == 1, (argv, out.err)


def test_args_file_errors(tmp_path, csv_file, capsys):
    model = bundled_model_dir()
    if not model:
        pytest.skip("bundled model not installed")
    bad = tmp_path / "a.json"
    bad.write_text("{nope", encoding="utf-8")
    code, out = _run([model, "--data", str(csv_file), "--args", str(bad)], capsys)
    assert code == 2 and "not valid JSON" in out.err


@pytest.mark.slow
def test_tiny_end_to_end_with_budget(tmp_path, capsys):
    """A 2-layer random BERT with MiniLM's tokenizer, an emulated GPU, legacy --args names."""
    model_src = bundled_model_dir()
    if not model_src:
        pytest.skip("bundled model not installed")
    from transformers import AutoTokenizer, BertConfig, BertForSequenceClassification

    tiny = tmp_path / "tiny"
    model = BertForSequenceClassification(BertConfig(vocab_size=30522, hidden_size=32, num_hidden_layers=2,
                                                     num_attention_heads=2, intermediate_size=64))
    model.save_pretrained(tiny)
    weights_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    AutoTokenizer.from_pretrained(model_src).save_pretrained(tiny)
    args = tmp_path / "args.json"
    args.write_text(json.dumps({"evaluation_strategy": "epoch", "overwrite_output_dir": True,
                                "per_device_train_batch_size": 16, "num_train_epochs": 1}), encoding="utf-8")
    out_dir = tmp_path / "out"
    code, out = _run([str(tiny), "--data", bundled_data_path(), "--args", str(args), "--budget", "64MiB",
                      "--output-dir", str(out_dir), "--max-steps", "4"], capsys)
    assert code == 0, out.err
    report = json.loads((out_dir / "memfit-report.json").read_text())
    assert report["steps_completed"] == report["steps_expected"] == 4
    assert report["effective_batch_size"] == 16
    assert "eval_accuracy" in report["final_metrics"]
    # the backward holds at least the weights, and the run kept within the emulated 64 MiB card
    assert weights_bytes < report["phases"]["backward"]["measured_bytes"] <= 64 * 2**20
    assert (out_dir / "config.json").exists() and any(p.name.startswith("checkpoint-") for p in out_dir.iterdir())
    assert "old name of `eval_strategy`" in out.out and "steps 4/4" in out.out
    last = max((p for p in out_dir.iterdir() if p.name.startswith("checkpoint-")), key=lambda p: int(p.name[11:]))
    assert json.loads((last / "memfit-state.json").read_text())["per_device_train_batch_size"] == 16
    # resumed from its last checkpoint with the settings memfit saved there, to 6 steps
    code, out = _run([str(tiny), "--data", bundled_data_path(), "--args", str(args), "--budget", "64MiB",
                      "--output-dir", str(out_dir), "--max-steps", "6", "--resume"], capsys)
    assert code == 0, out.err
    assert json.loads((out_dir / "memfit-report.json").read_text())["steps_completed"] == 6
