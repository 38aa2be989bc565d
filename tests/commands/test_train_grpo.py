"""`memfit train --trainer grpo`: TRL's real GRPOTrainer on the CPU under memfit.fit, with reward functions named
as `--reward-func SPEC` (memfit.commands._reward_funcs): a 2-layer Llama built from a config with a character
tokenizer built in code (no hub), prompts in TRL's prompt-only format; every bad SPEC a one-line error."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("trl")  # the `llm` extra; the `test` extra installs it

from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from helpers import assert_accepted_or_one_line, record_budget_models, trl_llama_config  # noqa: E402
from memfit.cli import main  # noqa: E402

PROMPTS = ["abcd", "efghij", "klm", "nopqrs", "tuvw", "xyz", "abcdefg", "hi"]
CHARS = "abcdefghijklmnopqrstuvwxyz "

#: The reward of the run: a completion's length, each length also written to `lengths.txt` beside this file, so
#: the test sees what GRPOTrainer generated and scored.
LENGTH_REWARD = '''
import os

LOG = os.path.join(os.path.dirname(os.path.abspath(__file__)), "lengths.txt")


def length(prompts, completions, target, **kwargs):
    assert len(target) == len(completions)  # the dataset's other column, passed by GRPOTrainer by name
    with open(LOG, "a") as fh:
        fh.write("".join(f"{len(c)}\\n" for c in completions))
    return [float(len(c)) for c in completions]
'''


def _tokenizer(extra: str = "", model_max_length: int | None = 64):
    """A character-level tokenizer: pad 0, bos 1, eos 2, then the characters (and `extra` ones); without
    `model_max_length`, transformers' "no maximum" (1e30)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<pad>": 0, "<s>": 1, "</s>": 2, **{c: i + 3 for i, c in enumerate(CHARS + extra)}}
    tk = Tokenizer(models.WordLevel(vocab, unk_token="<pad>"))
    tk.pre_tokenizer = pre_tokenizers.Split("", "isolated")
    limit = {} if model_max_length is None else {"model_max_length": model_max_length}
    return PreTrainedTokenizerFast(tokenizer_object=tk, pad_token="<pad>", bos_token="<s>", eos_token="</s>", **limit)


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    """The policy, a reward model, and reward model directories that are wrong in one way each."""
    import torch
    from transformers import LlamaForCausalLM, LlamaForSequenceClassification

    root = tmp_path_factory.mktemp("grpo")
    tok = _tokenizer()
    torch.manual_seed(0)
    out = {}
    for name, model, tokenizer in [
        ("policy", LlamaForCausalLM(trl_llama_config(len(tok))), tok),
        ("rm", LlamaForSequenceClassification(trl_llama_config(len(tok), num_labels=1)), tok),
        # its tokenizer has uppercase letters too: ids past the 30 embeddings the reward model was trained with
        ("rm_other_tok", LlamaForSequenceClassification(trl_llama_config(len(tok), num_labels=1)),
         _tokenizer("ABCDEFGHIJKLMNOPQRSTUVWXYZ")),
        ("rm_two_labels", LlamaForSequenceClassification(trl_llama_config(len(tok), num_labels=2)), tok),
        ("rm_causal", LlamaForCausalLM(trl_llama_config(len(tok))), tok),
        ("rm_no_tok", LlamaForSequenceClassification(trl_llama_config(len(tok), num_labels=1)), None),
    ]:
        path = root / name
        model.save_pretrained(path)
        if tokenizer is not None:
            tokenizer.save_pretrained(path)
        out[name] = path
    chat_tok = _tokenizer(model_max_length=None)
    chat_tok.chat_template = "{% for m in messages %}{{ m['content'] }} {% endfor %}"
    LlamaForCausalLM(trl_llama_config(len(tok))).save_pretrained(root / "chat_policy")
    chat_tok.save_pretrained(root / "chat_policy")
    out["chat_policy"] = root / "chat_policy"
    (root / "empty").mkdir()
    out["empty"] = root / "empty"
    return out


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    d = tmp_path_factory.mktemp("grpo-files")
    (d / "prompts.jsonl").write_text("".join(json.dumps({"prompt": p, "target": len(p)}) + "\n" for p in PROMPTS))
    (d / "chat.jsonl").write_text(json.dumps({"messages": [{"role": "user", "content": "x"}]}) + "\n")
    (d / "chat_prompts.jsonl").write_text("".join(json.dumps({"prompt": [{"role": "user", "content": p}]}) + "\n"
                                                  for p in PROMPTS[:4]))
    (d / "one_prompt.jsonl").write_text(json.dumps({"prompt": PROMPTS[0], "target": 1}) + "\n")
    (d / "rewards.py").write_text(LENGTH_REWARD)
    (d / "syntax.py").write_text("def length(completions, **kwargs)\n    return [0.0]\n")
    (d / "raises.py").write_text("import json\nraise RuntimeError('no reward server at localhost:9000')\n")
    (d / "imports.py").write_text("import no_such_reward_lib\n")
    (d / "strings.py").write_text("def length(completions: list[str], **kwargs):\n    return [0.0]\n")
    (d / "misc.py").write_text("THRESHOLD = 0.5\n\n\ndef strict(completions):\n    return [0.0] * len(completions)\n"
                               "\n\ndef needs_answer(completions, answer, **kwargs):\n    return [0.0]\n")
    return {p.stem: p for p in d.iterdir()}


def _run(argv, capsys):
    code = main(["train"] + [str(a) for a in argv])
    return code, capsys.readouterr()


def test_bad_reward_specs_are_one_line_errors(dirs, files, tmp_path, capsys):
    """Each bad `--reward-func` (and GRPO flag) is one line on stderr, exit 2, no traceback, before a model loads."""
    base = [dirs["policy"], "--trainer", "grpo", "--data", files["prompts"], "--output-dir", tmp_path / "out"]
    f = files
    cases = [
        ([], "`--trainer grpo` needs a reward: give `--reward-func SPEC`"),
        (["--reward-func", f["rewards"].parent / "nope.py:length"], "does not exist; give an existing .py file"),
        (["--reward-func", f"{f['rewards']}:lenght"], "has no `lenght`; did you mean"),
        (["--reward-func", f"{f['misc']}:THRESHOLD"], "`THRESHOLD` in "),
        (["--reward-func", f"{f['misc']}:strict"], "it takes no `prompts`; GRPOTrainer calls a reward function as"),
        (["--reward-func", f"{f['misc']}:needs_answer"], "needs `answer`, which GRPOTrainer passes only from a data"),
        (["--reward-func", f"{f['syntax']}:length"], "has a syntax error at line 1"),
        (["--reward-func", f"{f['raises']}:length"], "raised RuntimeError: no reward server at localhost:9000"),
        (["--reward-func", f"{f['imports']}:length"], "raised ModuleNotFoundError: No module named 'no_such_rew"),
        (["--reward-func", "no_such_reward_pkg.rewards:f"], "module `no_such_reward_pkg.rewards` cannot be imported"),
        (["--reward-func", "trl.rewards:think_format"], "did you mean `trl.rewards:think_format_reward`?"),
        (["--reward-func", "trl.rewards:get_soft_overlong_punishment"], "builds a reward function, it is not one"),
        (["--reward-func", "trl.rewards:accuracy_reward"], "takes conversational completions"),
        (["--reward-func", "trl.rewards:think_format_reward"], "takes conversational completions (`completions: "
                                                               "list[list[dict[str,str]]]`"),
        (["--reward-func", f["rewards"]], "names a file but no function"),
        (["--reward-func", "OpenAssistant/reward-model-deberta"], "is not a local directory"),
        (["--reward-func", "nothing-here"], "is neither a function nor an existing directory"),
        (["--reward-func", dirs["empty"]], "is a directory without config.json"),
        (["--reward-func", dirs["rm_causal"]], "is a `LlamaForCausalLM`, not a sequence-classification reward"),
        (["--reward-func", dirs["rm_two_labels"]], "has 2 labels; GRPOTrainer loads a reward model with num_labels"),
        (["--reward-func", dirs["rm_no_tok"]], "its tokenizer cannot be loaded"),
        (["--reward-func", dirs["rm_other_tok"]], "its tokenizer has 56 tokens but the reward model has 30 token "
                                                  "embeddings: another tokenizer"),
        (["--reward-func", f"{f['rewards']}:length", "--max-length", "32"],
         "does not go with `--trainer grpo`"),
        (["--reward-func", f"{f['rewards']}:length", "--max-completion-length", "64"],
         "leaves no room for a prompt in the model's 64 positions"),
        (["--reward-func", f"{f['rewards']}:length", "--num-generations", "3", "--batch-size", "4"],
         "invalid GRPOConfig"),
        (["--reward-func", f"{f['rewards']}:length", "--num-generations", "0"], "`--num-generations` must be a "
                                                                               "positive integer; got `0`"),
        (["--reward-func", f"{f['rewards']}:length", "--packing"], "is for `--trainer sft`, not `--trainer "
                                                                            "grpo`: GRPOConfig has no such setting"),
    ]
    for argv, match in cases:
        code, res = _run(base + [str(a) for a in argv], capsys)
        assert code == 2, (argv, res.err[-800:])
        assert match in res.err and res.err.count("\n") == 1 and "Traceback" not in res.err, (argv, res.err[-800:])
    other = [
        ([dirs["policy"], "--trainer", "grpo", "--data", files["chat"], "--reward-func", f"{f['rewards']}:length"],
         "the examples have the columns `messages`; GRPOTrainer's dataset needs a `prompt` column"),
        ([dirs["chat_policy"], "--trainer", "grpo", "--data", files["chat_prompts"], "--reward-func", dirs["rm"]],
         "its tokenizer has no chat template, which GRPOTrainer applies"),
        ([dirs["chat_policy"], "--trainer", "grpo", "--data", files["chat_prompts"], "--reward-func",
          f"{f['strings']}:length"], "takes completions as strings (`completions: list[str]`)"),
        ([dirs["policy"], "--trainer", "sft", "--data", files["prompts"], "--reward-func", "trl.rewards:x"],
         "`--reward-func` is for `--trainer grpo`"),
        (["--num-generations", "4"], "is a TRL setting; add `--trainer grpo or rloo`"),
        (["--reward-func", "trl.rewards:x"], "`--reward-func` is for `--trainer grpo`"),
        ([dirs["policy"], "--trainer", "dpo", "--data", files["prompts"], "--num-generations", "4"],
         "is for `--trainer grpo` or `--trainer rloo`, not `--trainer dpo`: DPOConfig has no such setting"),
        ([dirs["policy"], "--trainer", "sft", "--data", files["prompts"], "--beta", "0.1"],
         "is for `--trainer dpo`, `--trainer grpo`, `--trainer rloo`, `--trainer kto` or `--trainer distill`, not `--trainer sft`: SFTConfig has no "
         "such setting"),
        # RLOOTrainer takes GRPOTrainer's reward functions and generation settings: the same checks
        ([dirs["policy"], "--trainer", "rloo", "--data", files["prompts"]], "`--trainer rloo` needs a reward"),
        ([dirs["policy"], "--trainer", "rloo", "--data", files["prompts"], "--reward-func", f"{f['rewards']}:length",
          "--max-length", "32"], "does not go with `--trainer rloo`: RLOOConfig has no max_length"),
        ([dirs["policy"], "--trainer", "rloo", "--data", files["prompts"], "--reward-func", f"{f['rewards']}:lenght"],
         "has no `lenght`; did you mean"),
        ([dirs["policy"], "--trainer", "rloo", "--data", files["prompts"], "--reward-func", f"{f['misc']}:needs_answer"],
         "needs `answer`, which RLOOTrainer passes only from a dataset column"),
        ([dirs["policy"], "--trainer", "rloo", "--data", files["prompts"], "--reward-func", dirs["rm_two_labels"]],
         "has 2 labels; RLOOTrainer loads a reward model with num_labels=1"),
        ([dirs["policy"], "--trainer", "rloo", "--data", files["prompts"], "--reward-func", f"{f['rewards']}:length",
          "--num-generations", "1"], "invalid RLOOConfig: RLOO requires at least 2 generations per prompt"),
        # RepeatSampler: 8 completions per generation batch, 4 per prompt = 2 prompts; 1 prompt would run no step
        ([dirs["policy"], "--trainer", "rloo", "--data", files["one_prompt"], "--reward-func", f"{f['rewards']}:length",
          "--num-generations", "4", "--batch-size", "4", "--grad-accum", "2"],
         "one_prompt.jsonl` gives 1 training prompt, so no step would run; give at least 2"),
        ([dirs["policy"], "--trainer", "rloo", "--data", files["chat"], "--reward-func", f"{f['rewards']}:length"],
         "RLOOTrainer's dataset needs a `prompt` column"),
    ]
    for argv, match in other:
        code, res = _run(argv + ["--output-dir", tmp_path / "out"], capsys)
        assert code == 2, (argv, res.err[-800:])
        assert match in res.err and res.err.count("\n") == 1 and "Traceback" not in res.err, (argv, res.err[-800:])
    for data, match in [({"loss_type": "grpoo"}, "is not a GRPOTrainer loss; use one of"),
                        ({"num_generations": 0}, "`num_generations` in"),  # GRPOConfig would divide by it
                        ({"temperature": "hot"}, "must be a positive number (the sampling temperature"),
                        ({"reward_weights": [1.0, 2.0]}, "has 2 weights for 1 --reward-func"),
                        ({"reward_weights": "ab"}, "must be a list of numbers, one per --reward-func"),
                        ({"use_vllm": True}, "needs vLLM, which is not installed")]:
        if "use_vllm" in data:
            import importlib.util

            if importlib.util.find_spec("vllm") is not None:
                continue
        (tmp_path / "a.json").write_text(json.dumps(data))
        code, res = _run(base + ["--reward-func", f"{f['rewards']}:length", "--args", tmp_path / "a.json"], capsys)
        assert code == 2, (data, res.err[-800:])
        assert match in res.err and res.err.count("\n") == 1 and "Traceback" not in res.err, (data, res.err[-800:])
    # RLOOConfig has no loss_type (rloo_trainer.py `_compute_loss`: one loss)
    (tmp_path / "a.json").write_text(json.dumps({"loss_type": "grpo"}))
    code, res = _run([dirs["policy"], "--trainer", "rloo", "--data", files["prompts"], "--reward-func",
                      f"{f['rewards']}:length", "--args", tmp_path / "a.json", "--output-dir", tmp_path / "out"], capsys)
    assert code == 2 and res.err.count("\n") == 1 and "Traceback" not in res.err
    assert "`loss_type` in " in res.err and "is not a setting of RLOOConfig (SFTConfig, DPOConfig, GRPOConfig" in res.err
    assert not (tmp_path / "out").exists()  # every check ran before the run started


def test_reward_specs_resolve_to_what_grpo_trainer_takes(dirs, files):
    """A module function, a file's function (loaded from that file) and a reward model directory (its path: TRL
    loads it)."""
    from trl.rewards import think_format_reward

    from memfit.commands._reward_funcs import read_reward_funcs
    from memfit.errors import MemfitError

    funcs = read_reward_funcs(["trl.rewards:think_format_reward", f"{files['rewards']}:length", str(dirs["rm"])],
                              columns=("target",))
    assert [(r.kind, r.name) for r in funcs] == [("function", "think_format_reward"), ("function", "length"),
                                                 ("model", "rm")]
    assert funcs[0].value is think_format_reward and funcs[2].value == str(dirs["rm"])
    assert funcs[1].value(prompts=["a", "b"], completions=["xy", "xyz"], target=[1, 1]) == [2.0, 3.0]
    # trl.rewards' accuracy reward: chat completions and a `solution` column
    assert read_reward_funcs(["trl.rewards:accuracy_reward"], ("solution",), conversational=True)[0].kind == "function"
    with pytest.raises(MemfitError, match="needs `solution`, which GRPOTrainer passes only from a dataset column"):
        read_reward_funcs(["trl.rewards:accuracy_reward"], ("answer",), conversational=True)
    with pytest.raises(MemfitError, match="takes conversational completions"):
        read_reward_funcs(["trl.rewards:accuracy_reward"], ("solution",), conversational=False)


@pytest.mark.slow
def test_grpo_run_with_a_file_reward_and_a_reward_model(dirs, files, tmp_path, capsys, monkeypatch):
    """Real GRPOTrainer for 2 optimizer steps under an emulated GPU, rewarded by a function of the user's file and
    by a reward model directory (loaded by TRL, counted in the emulated GPU): completes, the completions' lengths
    vary, checkpoint, report, model saved."""
    counted = record_budget_models(monkeypatch)
    log = files["rewards"].parent / "lengths.txt"
    log.unlink(missing_ok=True)
    out = tmp_path / "out"
    code, res = _run([dirs["policy"], "--trainer", "grpo", "--data", files["prompts"],
                      "--reward-func", f"{files['rewards']}:length", "--reward-func", dirs["rm"],
                      "--num-generations", "4", "--max-completion-length", "8", "--batch-size", "4",
                      "--grad-accum", "2", "--max-steps", "2", "--budget", "400MiB", "--output-dir", out], capsys)
    assert code == 0, res.err[-2000:]
    r = json.loads((out / "memfit-report.json").read_text())
    assert r["status"] == "completed" and r["steps_completed"] == r["steps_expected"] == 2
    # GRPOConfig as TRL derives it: 8 completions per generation batch (batch 4 x accumulation 2), 4 per prompt
    assert r["rl"]["generation_batch_size"] == 8 and r["rl"]["num_generations"] == 4
    assert r["rl"]["generate_calls"] == 2  # one generation batch per optimizer step
    assert r["preflight"]["fits"] is True and r["phases"]["generation"]["measured_bytes"] > 0
    lengths = [int(x) for x in log.read_text().split()]
    assert len(lengths) == 16 and len(set(lengths)) > 1  # 2 generation batches of 8, not all of one length
    assert sorted(p.name for p in out.iterdir() if p.name.startswith("checkpoint-")) == ["checkpoint-2"]
    assert (out / "model.safetensors").exists()
    # the emulated GPU holds the policy and the reward model TRL loaded from the directory (beta 0: no reference)
    assert [type(m).__name__ for m in counted[-1]] == ["LlamaForCausalLM", "LlamaForSequenceClassification"]
    assert "with TRL's GRPOTrainer" in res.out and "rewards: length (function), rm (reward model)" in res.out
    assert "reward model `rm` sits on the GPU beside the policy; memfit's prediction counts" in res.out
    assert "steps 2/2" in res.out
    # the preflight's estimate holds the reward model: its weights beside the policy's
    assert r["preflight"]["reward_model"] == str(dirs["rm"])


_ARG_NAMES = ["num_generations", "max_completion_length", "generation_batch_size", "steps_per_generation", "beta",
              "num_iterations", "loss_type", "reward_weights", "temperature", "use_vllm", "vllm_mode",
              "per_device_train_batch_size", "gradient_accumulation_steps", "bf16", "max_length", "trainer"]
_VALUES = st.one_of(st.none(), st.booleans(), st.integers(-2, 10**6), st.floats(allow_nan=True), st.text(max_size=8),
                    st.lists(st.floats(-2, 2), max_size=3), st.sampled_from(["grpo", "dapo", "colocate", "server"]))
_FLAGS = ["--num-generations", "--max-completion-length", "--generation-batch-size", "--steps-per-generation",
          "--beta", "--num-iterations", "--batch-size", "--grad-accum", "--reward-func"]
_FLAG_VALUES = st.one_of(st.integers(-2, 100).map(str), st.floats(allow_nan=True).map(str), st.text(max_size=8),
                         st.sampled_from(["trl.rewards:think_format_reward", "os:path", "x.py:f", "."]))


@settings(max_examples=40, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.dictionaries(st.sampled_from(_ARG_NAMES), _VALUES, max_size=4),
       pairs=st.lists(st.tuples(st.sampled_from(_FLAGS), _FLAG_VALUES), max_size=3),
       trainer=st.sampled_from(["grpo", "rloo"]))
def test_fuzz_grpo_args_and_flags(dirs, files, tmp_path_factory, data, pairs, trainer):
    """Any GRPOConfig / RLOOConfig --args file and their flag values: accepted (stopped before the model is loaded),
    or a one-line error, never a traceback."""
    d = tmp_path_factory.mktemp("fuzz")
    (d / "a.json").write_text(json.dumps(data))
    argv = ["train", str(dirs["policy"]), "--trainer", trainer, "--data", str(files["prompts"]), "--reward-func",
            f"{files['rewards']}:length", "--args", str(d / "a.json"), "--output-dir", str(d / "o")]
    for flag, value in pairs:
        argv += [flag, value]
    assert_accepted_or_one_line(argv, stop_at="build_trl_trainer", context=(trainer, data, pairs))


@pytest.mark.slow
def test_grpo_run_with_a_reference_recovers_from_oom_without_losing_steps(dirs, files, tmp_path, capsys,
                                                                          monkeypatch):
    """`--beta 0.04`: TRL loads a reference copy from the model directory (counted in the emulated GPU); under 3 MiB
    the scoring pass (old / reference log-probs) and a training micro-step run out of memory, memfit halves the
    scoring chunks and splits the micro-batch, and every optimizer step is done with TRL's derived sizes kept."""
    counted = record_budget_models(monkeypatch)
    out = tmp_path / "out"
    code, res = _run([dirs["policy"], "--trainer", "grpo", "--data", files["prompts"],
                      "--reward-func", f"{files['rewards']}:length", "--num-generations", "4",
                      "--max-completion-length", "8", "--batch-size", "4", "--grad-accum", "2", "--beta", "0.04",
                      "--max-steps", "2", "--budget", "3MiB", "--output-dir", out], capsys)
    assert code == 0, res.err[-2000:]
    r = json.loads((out / "memfit-report.json").read_text())
    assert r["status"] == "completed" and r["steps_completed"] == r["steps_expected"] == 2
    assert {x["phase"] for x in r["oom_recoveries"]} == {"scoring", "train"}
    assert r["rl"]["scoring_batch_size"] < 4 and r["micro_batch_chunks"] >= 2
    assert (r["rl"]["generation_batch_size"], r["rl"]["steps_per_generation"], r["effective_batch_size"]) == (8, 2, 8)
    models = counted[-1]  # the policy and TRL's reference copy, two models of the same size
    assert len(models) == 2 and models[0] is not models[1]
    assert sum(p.numel() for p in models[1].parameters()) == sum(p.numel() for p in models[0].parameters())
    assert "OOM recoveries: 2 (scoring, train)" in res.out and "steps 2/2" in res.out


@pytest.mark.slow
def test_grpo_run_on_chat_prompts_with_trls_own_reward(dirs, files, tmp_path, capsys):
    """Chat prompts (the tokenizer's chat template) rewarded by TRL 1.16's `trl.rewards:think_format_reward`, which
    reads `completion[0]["content"]`: GRPOTrainer passes lists of one message, 2 optimizer steps complete."""
    out = tmp_path / "out"
    code, res = _run([dirs["chat_policy"], "--trainer", "grpo", "--data", files["chat_prompts"],
                      "--reward-func", "trl.rewards:think_format_reward", "--num-generations", "4",
                      "--max-completion-length", "8", "--batch-size", "4", "--max-steps", "2", "--budget", "400MiB",
                      "--output-dir", out], capsys)
    assert code == 0, res.err[-2000:]
    r = json.loads((out / "memfit-report.json").read_text())
    assert r["status"] == "completed" and r["steps_completed"] == 2 and r["rl"]["generate_calls"] == 2
    assert "prompt-only, conversational" in res.out and "rewards: think_format_reward (function)" in res.out
    # its tokenizer has no maximum length (1e30): no preflight flag, GRPOTrainer never truncates with the tokenizer
    assert "no real maximum length" not in res.out


@pytest.mark.slow
def test_rloo_run_with_a_file_reward_and_its_reference_recovers_from_oom(dirs, files, tmp_path, capsys, monkeypatch):
    """`--trainer rloo`: TRL's real RLOOTrainer for 2 optimizer steps, rewarded by a function of the user's file,
    with RLOOConfig's default beta 0.05 (TRL loads a reference copy from the model directory, counted in the emulated
    GPU). Under 3 MiB the scoring pass and the micro-batches run out of memory; memfit halves the scoring chunks and
    splits the micro-batches, and every step is done with RLOOConfig's derived sizes kept."""
    counted = record_budget_models(monkeypatch)
    log = files["rewards"].parent / "lengths.txt"
    log.unlink(missing_ok=True)
    out = tmp_path / "out"
    code, res = _run([dirs["policy"], "--trainer", "rloo", "--data", files["prompts"],
                      "--reward-func", f"{files['rewards']}:length", "--num-generations", "4",
                      "--max-completion-length", "8", "--batch-size", "4", "--grad-accum", "2", "--max-steps", "2",
                      "--budget", "3MiB", "--no-plan", "--output-dir", out], capsys)  # no plan: recovery alone
    assert code == 0, res.err[-2000:]
    r = json.loads((out / "memfit-report.json").read_text())
    assert r["status"] == "completed" and r["steps_completed"] == r["steps_expected"] == 2
    # preflight estimated RLOO's step (generation and scoring phases) on the prompts as RLOOTrainer tokenizes them
    assert {"generation", "scoring"} <= set(r["preflight"]["predicted_phases"])
    assert r["preflight"]["longest_example"] == max(map(len, PROMPTS))
    assert {x["phase"] for x in r["oom_recoveries"]} == {"scoring", "train"}
    assert r["rl"]["scoring_batch_size"] < 4 and r["micro_batch_chunks"] >= 2
    assert (r["rl"]["generation_batch_size"], r["rl"]["steps_per_generation"], r["rl"]["num_generations"],
            r["effective_batch_size"], r["rl"]["generate_calls"]) == (8, 2, 4, 8, 2)
    lengths = [int(x) for x in log.read_text().split()]
    assert len(lengths) == 16 and len(set(lengths)) > 1  # 2 generation batches of 8, not all of one length
    assert (out / "model.safetensors").exists() and (out / "checkpoint-2").is_dir()
    models = counted[-1]  # the policy and TRL's reference copy, two models of the same size
    assert len(models) == 2 and models[0] is not models[1]
    assert "with TRL's RLOOTrainer" in res.out and "beta 0.05" in res.out and "steps 2/2" in res.out
