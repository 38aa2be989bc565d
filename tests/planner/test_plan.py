"""`memfit plan`: plans fit by memfit's own estimate, keep the effective batch, respect consent."""

import json

import pytest

from conftest import save_bert_config
from memfit.cli import main
from memfit.errors import MemfitError
from memfit.estimator import estimate
from memfit.planner.search import plan
from memfit.train_setup import TrainSetup


@pytest.fixture(scope="module")
def small_bert(tmp_path_factory):
    return save_bert_config(tmp_path_factory, "bert8", hidden_size=256, num_hidden_layers=8, num_attention_heads=4,
                            intermediate_size=1024, vocab_size=8000)


def _setup(model, **kw):
    base = dict(model=model, per_device_train_batch_size=16, gradient_accumulation_steps=2, max_length=512,
                eval_strategy="epoch", per_device_eval_batch_size=16, eval_samples=64)
    base.update(kw)
    return TrainSetup(**base)


@pytest.fixture(scope="module")
def tight(small_bert):
    """A GPU size between the smallest plan and the setup as it is."""
    s = _setup(small_bert)
    as_is = estimate(s, gpu="A100-40GB")
    need = as_is.device_used_bytes
    gpu = f"{int(need * 0.8) // 2**20}MiB"
    return s, gpu, plan(s, gpu=gpu)


def test_plan_fits_by_memfits_own_estimate_and_keeps_effective_batch(tight):
    s, gpu, result = tight
    assert not result.fits_as_is
    assert result.chosen is not None
    chosen = result.plans[result.chosen]
    assert chosen.verified and chosen.fits
    changed = s.replace(**chosen.setup_changes)
    assert changed.effective_batch_size == s.effective_batch_size
    check = estimate(changed, gpu=gpu)
    assert check.device_used_bytes <= result.budget_bytes or chosen.env  # allocator env may be what makes it fit
    for p in result.plans:
        assert s.replace(**p.setup_changes).effective_batch_size == s.effective_batch_size


def test_never_truncates_or_changes_method_without_consent(tight):
    _, _, result = tight
    for p in result.plans:
        assert "max_length" not in p.setup_changes
        assert "lora_r" not in p.setup_changes
        assert "offload_optimizer_state" not in p.setup_changes
        assert "freeze_embeddings" not in p.setup_changes


@pytest.mark.slow
def test_nothing_fits_says_by_how_much_and_what_would(small_bert):
    s = _setup(small_bert, per_device_train_batch_size=1, gradient_accumulation_steps=1)
    result = plan(s, gpu="600MiB")
    assert result.chosen is None and not result.fits_as_is
    assert result.miss_bytes is not None and result.miss_bytes > 0
    assert any("allow `lora`" in x for x in result.suggestions)
    assert any("GPU with at least" in x for x in result.suggestions)


@pytest.mark.slow
def test_truncation_only_with_allow(small_bert):
    s = _setup(small_bert, per_device_train_batch_size=1, gradient_accumulation_steps=1,
               example_lengths=[100, 300, 512, 512, 480])
    as_is = estimate(s, gpu="A100-40GB")
    gpu = f"{int(as_is.device_used_bytes * 0.97) // 2**20}MiB"
    result = plan(s, gpu=gpu, allow=["truncation"], max_plans=60)
    cut = [p for p in result.plans if "max_length" in p.setup_changes]
    assert cut, "truncation variants are searched when allowed"
    assert any("examples are longer than" in line for p in cut for line in p.code)


@pytest.mark.parametrize("kwargs, fragment", [
    ({"allow": ["teleport"]}, "teleport"),
    ({"margin": 0.9}, "margin"),
    ({"gpu": "Z80"}, "Z80"),
])
def test_bad_inputs(small_bert, kwargs, fragment):
    args = {"gpu": "T4", **kwargs}
    with pytest.raises(MemfitError, match=fragment):
        plan(_setup(small_bert), **args)


def test_cli_json_schema(small_bert, capsys):
    code = main(["plan", small_bert, "--batch-size", "4", "--max-length", "64", "--gpu", "T4", "--json"])
    data = json.loads(capsys.readouterr().out)
    assert code == 0
    assert data["fits_as_is"] is True
    for key in ("plans", "chosen", "baseline", "budget_bytes"):
        assert key in data
    for p in data["plans"]:
        for key in ("changes", "env", "peak_reserved_bytes", "device_used_bytes", "relative_step_time", "fits"):
            assert key in p


def test_cli_needs_a_gpu(small_bert, capsys):
    assert main(["plan", small_bert]) == 2
    assert "--gpu" in capsys.readouterr().err


def test_contradictory_flags(small_bert, capsys):
    assert main(["plan", small_bert, "--precision", "bf16", "--gpu", "T4"]) == 2
    assert "bf16" in capsys.readouterr().err


@pytest.mark.slow
@pytest.mark.parametrize("max_length", [512, 4096])
def test_seed_case(max_length):
    """shared/seed-summary.md: xlnet-large-cased, batch 1 x accumulation 16, V100-16GB; at 512 tokens and
    at the length an untruncated XLNet dataset reaches."""
    from memfit.commands.estimate import SEED_CASE

    s = TrainSetup.from_kwargs("xlnet-large-cased", training_args=SEED_CASE["training_args"], max_length=max_length)
    result = plan(s, gpu="V100-16GB")
    assert result.fits_as_is == (max_length == 512)
    assert result.chosen is not None
    chosen = result.plans[result.chosen]
    assert chosen.verified and chosen.fits
    changed = s.replace(**chosen.setup_changes)
    assert changed.effective_batch_size == 16
    assert changed.sequence_length == max_length  # never truncated without consent
    assert "bf16" not in chosen.changes  # a V100 has no bf16
    if max_length == 4096:
        # XLNet has no Hugging Face checkpointing: the plan must hand over memfit's own
        assert any("enable_checkpointing" in line for line in chosen.code)
        assert "gradient_checkpointing" not in chosen.changes


@pytest.mark.slow
def test_freeze_opt_in_offers_embeddings_and_lower_blocks(small_bert):
    s = _setup(small_bert, per_device_train_batch_size=1, gradient_accumulation_steps=1)
    result = plan(s, gpu="A100-40GB", allow=["freeze"], max_plans=80)
    frozen = [p for p in result.plans if p.setup_changes.get("freeze_embeddings")]
    assert frozen and any(p.setup_changes.get("freeze_layers") == 4 for p in frozen)
    assert all(any("requires_grad_(False)" in line for line in p.code) for p in frozen)


def test_describe_takes_an_allocator_setting_that_is_no_trainsetup_field():
    """A verified plan with `alloc_conf` (remedies.allocator) is described: alloc_conf is not a TrainSetup field
    (it raised AttributeError in `_describe` when a plan's replay needed expandable_segments)."""
    from memfit.planner.search import _describe
    from memfit.train_setup import TrainSetup

    names, args, env, code = _describe(TrainSetup(), {"alloc_conf": "expandable_segments:True"}, None)
    assert env == {"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"} and names


def test_the_as_is_line_of_a_run_that_does_not_fit_says_by_how_much(small_bert, capsys):
    """Verdicts that read against their own numbers: a failing run's nvidia-smi figure is the one up to
    its running out of the budget; the line says the shortfall and that the figure stops there."""
    assert main(["plan", small_bert, "--batch-size", "64", "--max-length", "512", "--gpu", "600MiB"]) in (0, 1)
    out = " ".join(capsys.readouterr().out.split())  # rich wraps at the terminal's width
    first = out[out.index("As is"):out.index("budget with")]
    assert "does not fit, short by" in first and "until the budget runs out" in first, first
