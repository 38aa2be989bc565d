"""`memfit train --trainer reward|kto`: TRL's real RewardTrainer / KTOTrainer on the CPU under memfit.fit, a
2-layer Llama built from a config with a character tokenizer built in code (no hub); reward data in TRL's
preference format (`chosen`/`rejected`, `prompt` optional), KTO data unpaired (`prompt`/`completion`/`label`);
every bad input a one-line error before a model loads."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("trl")  # the `llm` extra; the `test` extra installs it

from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from helpers import assert_accepted_or_one_line, record_budget_models, trl_llama_config  # noqa: E402
from memfit.cli import main  # noqa: E402

CHARS = "abcdefghijklmnopqrstuvwxyz "
CHAT_TEMPLATE = "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }} {% endfor %}"
WORDS = ["abc", "de fgh", "ijk lmn op", "qr"]


def _tokenizer():
    """A character-level tokenizer: pad 0, bos 1, eos 2, then the characters; a chat template."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<pad>": 0, "<s>": 1, "</s>": 2, **{c: i + 3 for i, c in enumerate(CHARS)}}
    tk = Tokenizer(models.WordLevel(vocab, unk_token="<pad>"))
    tk.pre_tokenizer = pre_tokenizers.Split("", "isolated")
    tok = PreTrainedTokenizerFast(tokenizer_object=tk, pad_token="<pad>", bos_token="<s>", eos_token="</s>",
                                  model_max_length=64)
    tok.chat_template = CHAT_TEMPLATE
    return tok


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    """A causal LM, a one-label reward model, a two-label classifier and a vision encoder (no text classifier)."""
    import torch
    from transformers import LlamaForCausalLM, LlamaForSequenceClassification, ViTConfig, ViTModel

    root = tmp_path_factory.mktemp("pref")
    tok = _tokenizer()
    torch.manual_seed(0)
    out = {}
    for name, model in [("causal", LlamaForCausalLM(trl_llama_config(len(tok)))),
                        ("rm", LlamaForSequenceClassification(trl_llama_config(len(tok), num_labels=1))),
                        ("two_labels", LlamaForSequenceClassification(trl_llama_config(len(tok), num_labels=2))),
                        ("vit", ViTModel(ViTConfig(hidden_size=32, num_hidden_layers=1, num_attention_heads=4,
                                                   intermediate_size=64, image_size=32, patch_size=16)))]:
        model.save_pretrained(root / name)
        tok.save_pretrained(root / name)
        out[name] = root / name
    return out


def _jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return path


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    d = tmp_path_factory.mktemp("pref-data")
    pairs = [{"prompt": WORDS[i % 4], "chosen": " " + WORDS[(i + 1) % 4] * 2, "rejected": " " + WORDS[(i + 2) % 4]}
             for i in range(8)]
    return {
        "pairs": _jsonl(d / "pairs.jsonl", pairs),
        "implicit": _jsonl(d / "implicit.jsonl", [{"chosen": p["prompt"] + p["chosen"],
                                                    "rejected": p["prompt"] + p["rejected"]} for p in pairs]),
        "chat_pairs": _jsonl(d / "chat_pairs.jsonl", [
            {"chosen": [{"role": "user", "content": p["prompt"]}, {"role": "assistant", "content": p["chosen"]}],
             "rejected": [{"role": "user", "content": p["prompt"]}, {"role": "assistant", "content": p["rejected"]}]}
            for p in pairs]),
        "unpaired": _jsonl(d / "unpaired.jsonl", [{"prompt": WORDS[i % 4], "completion": " " + WORDS[(i + 1) % 4],
                                                   "label": i % 3 != 0} for i in range(8)]),
        "int_label": _jsonl(d / "int_label.jsonl", [{"prompt": "ab", "completion": "cd", "label": 1}]),
        "no_label": _jsonl(d / "no_label.jsonl", [{"prompt": "ab", "completion": "cd", "label": True},
                                                  {"prompt": "ab", "completion": "cd"}]),
        "pc": _jsonl(d / "pc.jsonl", [{"prompt": "ab", "completion": "cd"}]),
        "csv": d / "pairs.csv",
    }


@pytest.fixture(scope="module", autouse=True)
def _csv(files):
    files["csv"].write_text("text,label\nab,1\n")


def _run(argv, capsys):
    code = main(["train"] + [str(a) for a in argv])
    return code, capsys.readouterr()


def test_bad_reward_and_kto_inputs_are_one_line_errors(dirs, files, tmp_path, capsys):
    """Each bad input of `--trainer reward` / `kto` is one line on stderr, exit 2, no traceback, before a model
    loads (no output folder)."""
    out = ["--output-dir", tmp_path / "out"]
    cases = [
        ([dirs["causal"], "--trainer", "reward", "--data", files["unpaired"]],
         "RewardTrainer's dataset needs `chosen` and `rejected` (and optionally `prompt`)"),
        ([dirs["causal"], "--trainer", "reward", "--data", files["csv"]],
         "`--trainer reward` reads JSONL (one object per line: `chosen`/`rejected`, optionally `prompt`)"),
        ([dirs["causal"], "--trainer", "kto", "--data", files["implicit"]],
         "KTOTrainer's dataset needs `prompt`, `completion` and `label` (true: desirable"),
        ([dirs["causal"], "--trainer", "kto", "--data", files["pc"]], "KTOTrainer's dataset needs `prompt`, `completion`"),
        ([dirs["causal"], "--trainer", "kto", "--data", files["int_label"]],
         "`label` of example 1 in "),
        ([dirs["causal"], "--trainer", "kto", "--data", files["no_label"]], "example 2 of "),
        ([dirs["two_labels"], "--trainer", "reward", "--data", files["pairs"]],
         "with 2 labels; RewardTrainer loads it with num_labels=1"),
        ([dirs["vit"], "--trainer", "reward", "--data", files["pairs"]], "(model type `vit`) has no sequence-"),
        ([dirs["rm"], "--trainer", "kto", "--data", files["unpaired"]],
         "is a `LlamaForSequenceClassification`, not a causal language model"),
        ([dirs["causal"], "--trainer", "reward", "--data", files["pairs"], "--beta", "0.1"],
         "is for `--trainer dpo`, `--trainer grpo`, `--trainer rloo`, `--trainer kto` or `--trainer distill`, not `--trainer reward`"),
        ([dirs["causal"], "--trainer", "reward", "--data", files["pairs"], "--precompute-ref-log-probs"],
         "not `--trainer reward`: RewardConfig has no such setting"),
        ([dirs["causal"], "--trainer", "reward", "--data", files["pairs"], "--packing"],
         "is for `--trainer sft`, not `--trainer reward`: RewardConfig has no such setting"),
        ([dirs["causal"], "--trainer", "kto", "--data", files["unpaired"], "--num-generations", "4"],
         "is for `--trainer grpo` or `--trainer rloo`, not `--trainer kto`"),
        ([dirs["causal"], "--trainer", "kto", "--data", files["unpaired"], "--reward-func", "trl.rewards:x"],
         "`--reward-func` is for `--trainer grpo`"),
        ([dirs["causal"], "--trainer", "reward", "--data", files["pairs"], "--num-labels", "2"],
         "`--trainer reward` trains one score per sequence (num_labels=1)"),
        # KTOTrainer.__init__: the KL term pairs the examples of a micro-batch
        ([dirs["causal"], "--trainer", "kto", "--data", files["unpaired"], "--batch-size", "1"],
         "KTOTrainer needs at least 2 examples per micro-batch"),
        (["--beta", "0.1"], "`--beta` is a TRL setting; add `--trainer dpo, grpo, rloo, kto or distill`"),
        ([dirs["causal"], "--trainer", "reward", "--data", files["pairs"], "--task", "causal-lm"],
         "does not go with `--trainer reward`, which trains a one-score sequence classifier (seq-cls)"),
        ([dirs["causal"], "--trainer", "distill", "--data", files["pc"]], "`--trainer distill` needs the teacher"),
    ]
    for argv, match in cases:
        code, res = _run(argv + out, capsys)
        assert code == 2, (argv, res.err[-800:])
        assert match in res.err and res.err.count("\n") == 1 and "Traceback" not in res.err, (argv, res.err[-800:])
    assert not (tmp_path / "out").exists()  # every check ran before the run started


@pytest.mark.slow
@pytest.mark.parametrize("model,data,lora", [("causal", "pairs", False), ("rm", "chat_pairs", False),
                                             ("causal", "implicit", True)])
def test_reward_run(dirs, files, tmp_path, capsys, model, data, lora):
    """Real RewardTrainer for 2 optimizer steps under an emulated GPU: from a causal LM's directory (a new one-score
    head, said in a note) on explicit-prompt pairs, from a one-label reward model on chat pairs (implicit prompt),
    and with LoRA on string pairs with an implicit prompt (peft's SEQ_CLS task: the score head saved in full beside
    the adapters); checkpoint, report, model saved as a sequence classifier."""
    out = tmp_path / "out"
    code, res = _run([dirs[model], "--trainer", "reward", "--data", files[data], "--batch-size", "2",
                      "--grad-accum", "2", "--max-steps", "2", "--budget", "400MiB", "--output-dir", out]
                     + (["--lora-r", "4"] if lora else []), capsys)
    assert code == 0, res.err[-2000:]
    r = json.loads((out / "memfit-report.json").read_text())
    assert r["status"] == "completed" and r["steps_completed"] == r["steps_expected"] == 2
    assert r["preflight"]["fits"] is True
    rows = [json.loads(x) for x in files[data].read_text().splitlines()]
    if data != "chat_pairs":  # preflight's length: the longest sequence RewardTrainer tokenized (EOS appended)
        longest = max(len(x.get("prompt", "") + x[k]) + 1 for x in rows for k in ("chosen", "rejected"))
        assert r["preflight"]["sequence_length"] == longest < 64
    assert sorted(p.name for p in out.iterdir() if p.name.startswith("checkpoint-")) == ["checkpoint-2"]
    if lora:
        from safetensors import safe_open

        with safe_open(out / "adapter_model.safetensors", "pt") as f:
            keys = list(f.keys())
        assert "base_model.model.score.weight" in keys and any("lora_A" in k for k in keys)
        assert json.loads((out / "adapter_config.json").read_text())["task_type"] == "SEQ_CLS"
    else:
        from transformers import AutoConfig

        saved = AutoConfig.from_pretrained(out)
        assert saved.architectures == ["LlamaForSequenceClassification"] and saved.num_labels == 1
    text = " ".join(res.out.split())  # the console wraps long lines
    assert "with TRL's RewardTrainer" in text and "steps 2/2" in text
    assert ("starts a new one-score head" in text) == (model == "causal")
    assert ("preference, conversational" in text) == (data == "chat_pairs")


@pytest.mark.slow
def test_kto_run_with_its_reference(dirs, files, tmp_path, capsys, monkeypatch):
    """Real KTOTrainer for 2 optimizer steps under an emulated GPU on unpaired data: TRL loads the reference from
    the model directory (counted in the emulated GPU beside the policy); checkpoint, report, model saved."""
    counted = record_budget_models(monkeypatch)
    out = tmp_path / "out"
    code, res = _run([dirs["causal"], "--trainer", "kto", "--data", files["unpaired"], "--batch-size", "2",
                      "--grad-accum", "2", "--max-steps", "2", "--beta", "0.2", "--budget", "400MiB",
                      "--output-dir", out], capsys)
    assert code == 0, res.err[-2000:]
    r = json.loads((out / "memfit-report.json").read_text())
    assert r["status"] == "completed" and r["steps_completed"] == r["steps_expected"] == 2
    assert sorted(p.name for p in out.iterdir() if p.name.startswith("checkpoint-")) == ["checkpoint-2"]
    assert (out / "model.safetensors").exists()
    # preflight's length: an example's or its KL sequence's (its prompt with another example's completion), EOS
    rows = [json.loads(x) for x in files["unpaired"].read_text().splitlines()]
    own = max(len(x["prompt"] + x["completion"]) + 1 for x in rows)
    most = max(len(x["prompt"]) for x in rows) + max(len(x["completion"]) for x in rows) + 1
    assert own <= r["preflight"]["sequence_length"] <= most < 64
    models = counted[-1]  # the policy and TRL's reference copy, two models of the same size
    assert len(models) == 2 and models[0] is not models[1]
    assert [type(m).__name__ for m in models] == ["LlamaForCausalLM", "LlamaForCausalLM"]
    text = " ".join(res.out.split())  # the console wraps long lines
    assert "with TRL's KTOTrainer" in text and "unpaired-preference" in text and "steps 2/2" in text


def _weights(folder):
    from safetensors.torch import load_file

    return load_file(folder / "model.safetensors")


def _max_diff(a, b) -> float:
    assert a.keys() == b.keys()
    return max(float((a[k].float() - b[k].float()).abs().max()) for k in a)


#: SGD, so that the update is linear in the gradient (Adam's first step is about lr * sign(g) for every weight)
SGD = {"optim": "sgd", "learning_rate": 0.05}


@pytest.mark.slow
def test_reward_oom_recovery_splits_pairs(dirs, files, tmp_path, capsys):
    """Under a 600 KiB emulated GPU (no plan) a RewardTrainer micro-batch of 4 pairs runs out of memory and memfit
    splits it into chunks of whole pairs (RewardTrainer's batch holds the chosen rows, then the rejected ones, and
    its loss pairs the two halves): the weights are those of the run that did not run out of memory (within 1e-4;
    chunks of rows, which pair a chosen with a chosen, ended 2.6e-3 away when tried)."""
    (tmp_path / "a.json").write_text(json.dumps(SGD))
    runs = {}
    for name, budget in (("whole", "400MiB"), ("split", "600KiB")):
        out = tmp_path / name
        code, res = _run([dirs["causal"], "--trainer", "reward", "--data", files["pairs"], "--batch-size", "4",
                          "--max-steps", "2", "--no-plan", "--budget", budget, "--args", tmp_path / "a.json",
                          "--output-dir", out], capsys)
        assert code == 0, res.err[-2000:]
        runs[name] = json.loads((out / "memfit-report.json").read_text())
    assert runs["whole"]["oom_recoveries"] == [] and runs["split"]["oom_recoveries"]
    assert runs["split"]["steps_completed"] == 2 and runs["split"]["micro_batch_chunks"] >= 2
    whole, start = _weights(tmp_path / "whole"), _weights(dirs["causal"])
    body = {k: v for k, v in whole.items() if k in start}  # the causal LM's lm_head is not the new score head
    assert _max_diff(body, {k: start[k] for k in body}) > 1e-3  # the steps moved the weights
    assert _max_diff(_weights(tmp_path / "split"), whole) < 1e-4


@pytest.mark.slow
def test_kto_oom_recovery(dirs, files, tmp_path, capsys):
    """Under a 3 MiB emulated GPU (no plan) a KTO micro-batch of 4 runs out of memory. With loss_type
    apo_zero_unpaired (a mean of per-example losses) memfit splits it and the weights are those of the run that did
    not run out of memory (within 1e-4); with the default loss (each example's loss uses the KL estimate of the
    whole micro-batch) it does not split it: the run stops with one line saying why."""
    runs = {}
    for name, budget, loss in (("whole", "400MiB", "apo_zero_unpaired"), ("split", "3MiB", "apo_zero_unpaired"),
                               ("kl", "3MiB", "kto")):
        (tmp_path / f"{name}.json").write_text(json.dumps({**SGD, "loss_type": loss}))
        out = tmp_path / name
        code, res = _run([dirs["causal"], "--trainer", "kto", "--data", files["unpaired"], "--batch-size", "4",
                          "--max-steps", "2", "--no-plan", "--budget", budget, "--args", tmp_path / f"{name}.json",
                          "--output-dir", out], capsys)
        runs[name] = (code, res, json.loads((out / "memfit-report.json").read_text()))
    assert runs["whole"][0] == runs["split"][0] == 0, runs["split"][1].err[-2000:]
    assert runs["whole"][2]["oom_recoveries"] == [] and runs["split"][2]["oom_recoveries"]
    assert runs["split"][2]["steps_completed"] == 2
    assert _max_diff(_weights(tmp_path / "split"), _weights(tmp_path / "whole")) < 1e-4
    code, res, report = runs["kl"]
    assert code != 0 and report["status"] != "completed" and report["oom_recoveries"] == []
    assert "in a KTO micro-batch of 4, which memfit does not split: KTOTrainer's loss uses the KL estimate" in res.err
    assert "Traceback" not in res.err


_ARG_NAMES = ["beta", "loss_type", "max_length", "precompute_ref_log_probs", "desirable_weight", "undesirable_weight",
              "center_rewards_coefficient", "per_device_train_batch_size", "train_sampling_strategy", "trainer",
              "bf16", "disable_dropout", "packing", "num_labels"]
_VALUES = st.one_of(st.none(), st.booleans(), st.integers(-2, 10**6), st.floats(allow_nan=True), st.text(max_size=8),
                    st.sampled_from(["kto", "apo_zero_unpaired", "reward", "sequential", "random", "sigmoid"]))


@settings(max_examples=40, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
@given(trainer=st.sampled_from(["reward", "kto"]),
       data=st.dictionaries(st.sampled_from(_ARG_NAMES), _VALUES, min_size=1, max_size=4))
def test_fuzz_reward_kto_args_files(dirs, files, tmp_path_factory, trainer, data):
    """Any RewardConfig / KTOConfig --args file: accepted (stopped before the model is loaded), or a one-line error,
    never a traceback."""
    d = tmp_path_factory.mktemp("fuzz")
    (d / "a.json").write_text(json.dumps(data))
    assert_accepted_or_one_line(["train", str(dirs["causal"]), "--trainer", trainer, "--data",
                                 str(files["pairs" if trainer == "reward" else "unpaired"]), "--args",
                                 str(d / "a.json"), "--output-dir", str(d / "o")],
                                stop_at="build_trl_trainer", context=data)


@pytest.mark.slow
def test_kto_run_on_pairs(dirs, files, tmp_path, capsys):
    """Paired data (`prompt`/`chosen`/`rejected`): KTOTrainer unpairs it (`unpair_preference_dataset`: each pair a
    desirable and an undesirable example), 2 optimizer steps complete."""
    out = tmp_path / "out"
    code, res = _run([dirs["causal"], "--trainer", "kto", "--data", files["pairs"], "--batch-size", "2",
                      "--max-steps", "2", "--budget", "400MiB", "--output-dir", out], capsys)
    assert code == 0, res.err[-2000:]
    r = json.loads((out / "memfit-report.json").read_text())
    assert r["status"] == "completed" and r["steps_completed"] == 2
    assert "(8 examples, preference; 16 train rows)" in " ".join(res.out.split())
