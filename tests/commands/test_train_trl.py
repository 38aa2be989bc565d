"""`memfit train --trainer sft|dpo`: TRL's real SFTTrainer / DPOTrainer on the CPU under memfit.fit,
a tiny causal LM built from a config with MiniLM's tokenizer (chat template set here); every bad input a
one-line error; TRL's activation offloading on the simulated TRL step."""

from __future__ import annotations

import json
import shutil

import pytest

pytest.importorskip("trl")  # the `llm` extra; the `test` extra installs it

from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from memfit.cli import main  # noqa: E402
from memfit.commands.train import bundled_model_dir  # noqa: E402
from helpers import assert_accepted_or_one_line, bundled_tokenizer, record_budget_models  # noqa: E402

CHAT_TEMPLATE = ("{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
                 "{% if add_generation_prompt %}assistant: {% endif %}")
WORDS = ["alpha", "beta gamma", "delta epsilon zeta", "eta"]


def _tokenizer():
    return bundled_tokenizer()


@pytest.fixture(scope="module")
def llm_dir(tmp_path_factory):
    """A 2-layer random Llama saved with MiniLM's tokenizer and a chat template (no download)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    tok = _tokenizer()
    tok.chat_template = CHAT_TEMPLATE
    out = tmp_path_factory.mktemp("tiny-llm")
    cfg = LlamaConfig(vocab_size=len(tok), hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, intermediate_size=64, max_position_embeddings=128,
                      pad_token_id=tok.pad_token_id, eos_token_id=tok.sep_token_id, bos_token_id=tok.cls_token_id)
    torch.manual_seed(0)
    LlamaForCausalLM(cfg).save_pretrained(out)
    tok.save_pretrained(out)
    return out


@pytest.fixture(scope="module")
def no_template_dir(llm_dir, tmp_path_factory):
    """The same model, its tokenizer without a chat template."""
    out = tmp_path_factory.mktemp("no-template")
    for p in llm_dir.iterdir():
        if p.name != "chat_template.jinja":
            shutil.copy(p, out / p.name)
    cfg = json.loads((out / "tokenizer_config.json").read_text())
    cfg.pop("chat_template", None)
    (out / "tokenizer_config.json").write_text(json.dumps(cfg))
    return out


def _jsonl(path, rows):
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n", encoding="utf-8")
    return path


def _chat(i):
    return {"messages": [{"role": "user", "content": WORDS[i % 4] * (i % 3 + 1)},
                         {"role": "assistant", "content": " ".join(WORDS[: i % 4 + 1])}]}


def _pair(i):
    return {"prompt": "q " * (i % 3 + 1), "chosen": "good " * (i % 4 + 1), "rejected": "bad " * (i % 5 + 1)}


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    d = tmp_path_factory.mktemp("data")
    return {
        "chat": _jsonl(d / "chat.jsonl", [_chat(i) for i in range(16)]),
        "pc": _jsonl(d / "pc.jsonl", [{"prompt": WORDS[i % 4], "completion": " ".join(WORDS[: i % 3 + 1])}
                                      for i in range(8)]),
        "text": _jsonl(d / "text.jsonl", [{"text": " ".join(WORDS[: i % 4 + 1])} for i in range(8)]),
        "pairs": _jsonl(d / "pairs.jsonl", [_pair(i) for i in range(8)]),
        "cls_jsonl": _jsonl(d / "cls.jsonl", [{"text": "good film", "label": 1}, {"text": "bad", "label": 0}]),
        "wrong": _jsonl(d / "wrong.jsonl", [{"question": "x", "answer": "y"}]),
        "mixed": _jsonl(d / "mixed.jsonl", [{"prompt": "x", "completion": "y"},
                                            {"prompt": [{"role": "user", "content": "x"}], "completion": "y"}]),
        "bad_msgs": _jsonl(d / "bad_msgs.jsonl", [{"messages": [{"role": "user"}]}]),
        "csv": d / "cls.csv",
    }


def _run(argv, capsys):
    code = main(["train"] + [str(a) for a in argv])
    return code, capsys.readouterr()


def test_bad_inputs_are_one_line_errors(llm_dir, no_template_dir, files, tmp_path, capsys):
    files["csv"].write_text("text,label\ngood,1\nbad,0\n", encoding="utf-8")
    minilm = bundled_model_dir()
    out = ["--output-dir", tmp_path / "out"]
    cases = [
        (["--packing"], "is a TRL setting; add `--trainer sft`"),
        (["--lora-r", "4"], "add `--trainer sft, dpo, grpo, rloo, reward, kto or distill`"),
        ([llm_dir, "--trainer", "dpo", "--data", files["pairs"], "--packing"], "is for `--trainer sft`, not `--tra"),
        ([llm_dir, "--trainer", "dpo", "--data", files["pairs"], "--padding-free"], "DPOConfig has no such setting"),
        ([llm_dir, "--trainer", "sft", "--data", files["chat"], "--precompute-ref-log-probs"], "is for `--trainer dpo`"),
        ([llm_dir, "--trainer", "sft", "--data", files["chat"], "--label-column", "y"], "classification setting"),
        ([llm_dir, "--trainer", "sft", "--data", files["chat"], "--task", "mlm"], "does not go with `--trainer sft`"),
        (["--trainer", "sft"], "needs a model directory and --data"),
        ([llm_dir, "--trainer", "sft", "--data", files["csv"]], "is a CSV, the classification format"),
        ([llm_dir, "--trainer", "sft", "--data", files["cls_jsonl"]], "a classification dataset"),
        ([llm_dir, "--trainer", "sft", "--data", files["wrong"]], "columns `answer, question`; SFTTrainer's dataset needs"),
        ([llm_dir, "--trainer", "dpo", "--data", files["chat"]], "needs `prompt`, `chosen` and `rejected`"),
        ([llm_dir, "--trainer", "sft", "--data", files["mixed"]], "TRL needs all strings or all messages"),
        ([llm_dir, "--trainer", "sft", "--data", files["bad_msgs"]], "is not a non-empty list of"),
        ([llm_dir, "--trainer", "sft", "--data", files["chat"], "--completion-only-loss"],
         "`--completion-only-loss` needs prompt/completion data"),
        ([llm_dir, "--trainer", "sft", "--data", files["text"], "--assistant-only-loss"],
         "`--assistant-only-loss` needs conversational data"),
        ([llm_dir, "--trainer", "sft", "--data", files["text"], "--dataset-text-field", "body"], "SFTTrainer's dataset needs"),
        ([llm_dir, "--trainer", "sft", "--data", files["text"], "--max-length", "999"], "longer than the model's 128"),
        ([llm_dir, "--trainer", "sft", "--data", files["text"], "--lora-r", "0"], "must be a positive integer"),
        ([no_template_dir, "--trainer", "sft", "--data", files["chat"]], "has no chat template"),
        ([llm_dir, "--trainer", "sft", "--data", tmp_path / "nope.jsonl"], "does not exist"),
    ]
    if minilm:
        cases.append(([minilm, "--trainer", "sft", "--data", files["text"]], "`BertModel`, not a causal language"))
    for argv, match in cases:
        code, res = _run(argv + out, capsys)
        assert code == 2, (argv, res.err[-500:])
        assert match in res.err and res.err.count("\n") == 1, (argv, res.err[-500:])


def test_args_file_takes_the_trl_config_names(llm_dir, files, tmp_path, capsys, monkeypatch):
    """--args may use SFTConfig names with --trainer sft (a flag wins, with a note); a bad value is one line."""
    import memfit.commands.train_trl as tt

    seen = {}

    def stop(args, inputs):
        seen["targs"] = inputs.targs
        raise SystemExit(0)

    monkeypatch.setattr(tt, "build_trl_trainer", stop)
    args = tmp_path / "a.json"
    args.write_text(json.dumps({"trainer": "sft", "packing": True, "packing_strategy": "wrapped", "max_length": 64,
                                "dataset_text_field": "text", "bf16": False}))
    with pytest.raises(SystemExit):
        _run([llm_dir, "--trainer", "sft", "--data", files["text"], "--args", args, "--max-length", "32",
              "--output-dir", tmp_path / "o"], capsys)
    t = seen["targs"]
    assert (t.packing, t.packing_strategy, t.max_length, t.bf16) == (True, "wrapped", 32, False)
    args.write_text(json.dumps({"packing_strategy": "zigzag"}))
    code, res = _run([llm_dir, "--trainer", "sft", "--data", files["text"], "--args", args,
                      "--output-dir", tmp_path / "o"], capsys)
    assert code == 2 and "zigzag" in res.err and res.err.count("\n") == 1, res.err
    args.write_text(json.dumps({"trainer": "dpo"}))
    code, res = _run([llm_dir, "--trainer", "sft", "--data", files["text"], "--args", args,
                      "--output-dir", tmp_path / "o"], capsys)
    assert code == 2 and "differs from `--trainer sft`" in res.err


_ARG_NAMES = ["packing", "packing_strategy", "padding_free", "max_length", "completion_only_loss",
              "assistant_only_loss", "dataset_text_field", "precompute_ref_log_probs", "beta", "loss_type",
              "per_device_train_batch_size", "learning_rate", "bf16", "activation_offloading", "trainer", "seed"]
_VALUES = st.one_of(st.none(), st.booleans(), st.integers(-2, 10**6), st.floats(allow_nan=True),
                    st.text(max_size=8), st.sampled_from(["bfd", "wrapped", "sft", "dpo", "sigmoid", "text"]))


@settings(max_examples=40, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
@given(trainer=st.sampled_from(["sft", "dpo"]),
       data=st.dictionaries(st.sampled_from(_ARG_NAMES), _VALUES, min_size=1, max_size=4))
def test_fuzz_args_files(llm_dir, files, tmp_path_factory, trainer, data):
    """Any --args file: accepted (stopped before the data is read), or a one-line error, never a traceback."""
    d = tmp_path_factory.mktemp("fuzz")
    (d / "a.json").write_text(json.dumps(data))
    assert_accepted_or_one_line(["train", str(llm_dir), "--trainer", trainer, "--data", str(files["pairs"]),
                                 "--args", str(d / "a.json"), "--output-dir", str(d / "o")],
                                stop_at="read_trl_data", context=data)


def _report(out):
    return json.loads((out / "memfit-report.json").read_text())


def _checkpoints(out):
    return sorted(p.name for p in out.iterdir() if p.name.startswith("checkpoint-"))


@pytest.mark.slow
def test_sft_chat_packed_run(llm_dir, files, tmp_path, capsys):
    """Real SFTTrainer on chat messages, bfd packing (padding-free), under an emulated GPU: completes, checkpoint,
    report, the model saved."""
    out = tmp_path / "out"
    out.mkdir()
    (out / "README.md").write_text("the user's notes")  # TRL writes its model card there: memfit moves this aside
    code, res = _run([llm_dir, "--trainer", "sft", "--data", files["chat"], "--packing", "--batch-size", "4",
                      "--max-length", "32", "--max-steps", "2", "--budget", "400MiB", "--output-dir", out], capsys)
    assert code == 0, res.err[-2000:]
    r = _report(out)
    assert r["steps_completed"] == r["steps_expected"] == 2 and r["status"] == "completed"
    assert r["preflight"]["fits"] is True and r["phases"]["backward"]["measured_bytes"] > 0
    assert _checkpoints(out) == ["checkpoint-2"]
    assert (out / "model.safetensors").exists() and "TRL" in (out / "README.md").read_text()  # TRL's model card
    assert (out / "earlier-run-1" / "README.md").read_text() == "the user's notes"
    assert "with TRL's SFTTrainer" in res.out and "messages, conversational" in res.out and "steps 2/2" in res.out


@pytest.mark.slow
def test_sft_completion_only_lora_run_with_eval(llm_dir, files, tmp_path, capsys):
    """Prompt/completion data, loss on the completions, a LoRA adapter, evaluation every epoch on --eval-data."""
    out = tmp_path / "out"
    code, res = _run([llm_dir, "--trainer", "sft", "--data", files["pc"], "--eval-data", files["pc"],
                      "--completion-only-loss", "--lora-r", "4", "--batch-size", "4", "--epochs", "1",
                      "--eval-strategy", "epoch", "--budget", "400MiB", "--output-dir", out], capsys)
    assert code == 0, res.err[-2000:]
    r = _report(out)
    assert r["steps_completed"] == r["steps_expected"] == 2 and "eval_loss" in r["final_metrics"]
    assert r["phases"]["eval"]["measured_bytes"] > 0 and (out / "adapter_model.safetensors").exists()
    assert _checkpoints(out) == ["checkpoint-2"] and "eval loss" in res.out and "8 eval" in res.out


@pytest.mark.slow
def test_dpo_runs_with_reference_copy_and_with_lora(llm_dir, files, tmp_path, capsys, monkeypatch):
    """Real DPOTrainer: the reference loaded by TRL from the model directory (counted in the emulated GPU), then
    LoRA with precomputed reference log-probs (no reference model: the adapter-disabled model)."""
    counted = record_budget_models(monkeypatch)
    out = tmp_path / "ref"
    code, res = _run([llm_dir, "--trainer", "dpo", "--data", files["pairs"], "--batch-size", "2", "--max-length",
                      "16", "--max-steps", "2", "--budget", "400MiB", "--output-dir", out], capsys)
    assert code == 0, res.err[-2000:]
    r = _report(out)
    assert r["steps_completed"] == 2 and _checkpoints(out) == ["checkpoint-2"]
    # memfit.fit's emulated GPU holds the policy and TRL's reference copy (two distinct models)
    models = counted[-1]
    assert len(models) == 2 and models[0] is not models[1]
    assert sum(p.numel() for p in models[1].parameters()) == sum(p.numel() for p in models[0].parameters())
    lora = tmp_path / "lora"
    code, res = _run([llm_dir, "--trainer", "dpo", "--data", files["pairs"], "--batch-size", "2", "--max-length",
                      "16", "--max-steps", "2", "--lora-r", "4", "--precompute-ref-log-probs", "--budget", "400MiB",
                      "--output-dir", lora], capsys)
    assert code == 0, res.err[-2000:]
    assert _report(lora)["steps_completed"] == 2 and (lora / "adapter_model.safetensors").exists()
    assert _checkpoints(lora) == ["checkpoint-2"] and "LoRA r=4" in res.out


@pytest.mark.slow
def test_sft_run_recovers_from_oom_without_losing_steps(llm_dir, tmp_path, capsys):
    """A padded SFT batch holding one long example runs out of the emulated GPU part-way (on the CPU, TRL's
    chunked log-prob fallbacks allocate token x vocabulary fp32 tiles); memfit splits that micro-batch and
    goes on: every optimizer step done, the effective batch kept."""
    rows = [{"text": "a short answer"} for _ in range(12)]
    rows[6] = {"text": " ".join(["long"] * 60)}  # its batch is padded to 62 tokens
    data = _jsonl(tmp_path / "t.jsonl", rows)
    out = tmp_path / "out"
    code, res = _run([llm_dir, "--trainer", "sft", "--data", data, "--batch-size", "4", "--max-length", "128",
                      "--epochs", "1", "--budget", "150MiB", "--args", _no_bf16(tmp_path), "--output-dir", out],
                     capsys)
    assert code == 0, res.err[-2000:]
    r = _report(out)
    assert r["preflight"]["fits"] is True and r["plan_applied"] is None  # predicted to fit (CUDA kernels)
    assert r["oom_recoveries"] and {x["phase"] for x in r["oom_recoveries"]} == {"train"}
    assert r["steps_completed"] == r["steps_expected"] == 3 and r["effective_batch_size"] == 4
    assert r["micro_batch_chunks"] >= 2 and "OOM recoveries: " in res.out and "steps 3/3" in res.out
    assert _checkpoints(out) == ["checkpoint-3"]


def _no_bf16(tmp_path):
    p = tmp_path / "args.json"
    p.write_text(json.dumps({"bf16": False, "gradient_checkpointing": False}))
    return p


# -- TRL's activation offloading on the simulated TRL step (memfit.sim.trl_steps) ---------------------------

def _live_activations_after_forward(trace) -> int:
    live: dict[int, int] = {}
    for e in trace:
        if e.phase == "backward":
            break
        if e.action == "alloc" and e.category == "activations":
            live[e.id] = e.size_bytes
        elif e.action == "free":
            live.pop(e.id, None)
    return sum(live.values())


class _Stream:
    """A CPU copy is synchronous: TRL's stream events and waits have nothing to wait for."""

    def wait_event(self, ev):
        pass

    def wait_stream(self, s):
        pass

    def record_event(self):
        return None

    def synchronize(self):
        pass


class _CpuStreams:
    _s0 = _Stream()
    Stream = _Stream

    @staticmethod
    def stream(s):
        import contextlib

        return contextlib.nullcontext()

    @staticmethod
    def current_stream():
        return _CpuStreams._s0

    @staticmethod
    def empty_cache():
        pass


def _trl_real_offloading(model, tracker):
    """TRL's own OffloadActivations (get_act_offloading_ctx_manager, streams mode as on a GPU) on the CPU: it reads
    `torch.accelerator.current_accelerator().type` (None without an accelerator: patched to `cpu` while it is
    built) and CUDA streams (no-ops here). Its host copies are filed as `host`, as memfit files its own."""
    import contextlib

    import torch
    import trl.models.activation_offloading as ao

    original = torch.accelerator.current_accelerator
    torch.accelerator.current_accelerator = lambda *a, **k: torch.device("cpu")
    try:
        ctx = ao.get_act_offloading_ctx_manager(model, use_pin_memory=False, warn_if_no_head=False)
    finally:
        torch.accelerator.current_accelerator = original
    ctx.device_module, ctx.s1 = _CpuStreams, _Stream()

    @contextlib.contextmanager
    def factory():
        with ctx:
            yield
            for cpu_tensor, offloaded, *_ in ctx.tracker.values():
                rec = tracker.record_of(cpu_tensor) if offloaded else None
                if rec is not None:
                    rec.category = "host"
    return factory


@pytest.mark.slow
@pytest.mark.parametrize("trainer", ["sft", "dpo"])
def test_trl_activation_offloading_moves_what_trl_moves(trainer, monkeypatch):
    """`activation_offloading=True` on the TRL step: the activations left on the device after the forward are
    those TRL's own OffloadActivations leaves, on a real CPU run of the same step (real tensors), and the
    estimate is lower by what it moves."""
    from helpers import like_fake
    from transformers import LlamaConfig

    import memfit.sim.offload as offload
    from memfit import estimate
    from memfit.sim.engine import simulate
    from memfit.train_setup import TrainSetup

    cfg = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, vocab_size=1000, max_position_embeddings=64, bos_token_id=0,
                      eos_token_id=0)
    setup = TrainSetup(model=cfg, trainer=trainer, per_device_train_batch_size=2, max_length=64,
                       example_lengths=[64, 64], attn_implementation="sdpa")
    off_setup = setup.replace(activation_offloading=True)
    with like_fake():
        plain = _live_activations_after_forward(simulate(setup, splice=False, fake=False).trace)
        ours = _live_activations_after_forward(simulate(off_setup, splice=False, fake=False).trace)
        monkeypatch.setattr(offload, "trl_activation_offloading", _trl_real_offloading)
        trls = _live_activations_after_forward(simulate(off_setup, splice=False, fake=False).trace)
        monkeypatch.undo()
    fake = _live_activations_after_forward(simulate(off_setup, splice=False).trace)
    assert fake == ours  # FakeTensors: the same rule as on real tensors
    assert plain - ours > plain / 2  # most saved activations leave the device
    # TRL keeps two tensors of the fused head (8 and 126 bytes: under its min_offload_size) alive a little longer
    assert 0 <= trls - ours < offload.TRL_MIN_OFFLOAD_BYTES, (plain, ours, trls)
    est_plain, est_off = estimate(setup), estimate(off_setup)
    assert est_off.peak_allocated_bytes < est_plain.peak_allocated_bytes


def test_train_takes_the_trl_flags_of_estimate_and_plan(tmp_path):
    """`memfit train`'s TRL flags are those of `memfit estimate` / `plan`, with the same choices, and estimate's
    `--assistant-only-loss` reaches the TrainSetup."""
    import argparse

    from helpers import tiny_config

    from memfit.commands.estimate import add_setup_arguments, build_setup
    from memfit.commands.train import train_command_parser

    est = argparse.ArgumentParser()
    add_setup_arguments(est)
    train = train_command_parser(argparse.ArgumentParser().add_subparsers())
    names = ["--trainer", "--packing", "--padding-free", "--completion-only-loss", "--assistant-only-loss",
             "--precompute-ref-log-probs", "--lora-r", "--lora-target-modules", "--max-length", "--num-generations",
             "--max-completion-length", "--beta", "--steps-per-generation", "--generation-batch-size",
             "--num-iterations"]
    for name in names:
        a, b = (next(x for x in p._actions if name in x.option_strings) for p in (est, train))
        assert (a.dest, a.choices, a.nargs, a.const) == (b.dest, b.choices, b.nargs, b.const), name
    tiny_config("llama").save_pretrained(tmp_path)
    args = est.parse_args([str(tmp_path), "--trainer", "sft", "--assistant-only-loss"])
    setup = build_setup(args)[0]
    assert setup.trainer == "sft" and setup.assistant_only_loss is True


def test_liger_on_a_trl_trainer_applies_its_layer_kernels_only():
    """SFTTrainer / DPOTrainer (TRL 1.16 __init__) apply Liger with fused_linear_cross_entropy=False and refuse it
    when asked: the simulation did apply Liger's fused loss, whose forward dropped TRL's fused head (an
    AttributeError on `log_probs`)."""
    pytest.importorskip("liger_kernel")
    from helpers import tiny_config

    from memfit import TrainSetup, estimate
    from memfit.errors import MemfitError

    base = dict(model=tiny_config("llama"), trainer="sft", max_length=16, per_device_train_batch_size=2)
    report = estimate(TrainSetup(**base, use_liger_kernel=True))
    plain = estimate(TrainSetup(**base))
    assert report.peak_allocated_bytes != plain.peak_allocated_bytes  # Liger's RMSNorm / SwiGLU kernels ran
    with pytest.raises(MemfitError, match="TRL refuses it"):
        estimate(TrainSetup(**base, use_liger_kernel=True, liger_kernel_config={"fused_linear_cross_entropy": True}))
