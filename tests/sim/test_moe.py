"""Mixture-of-experts models in the simulation (memfit.sim.moe).

The central check is the simulator's usual one (tests/sim/test_exactness.py): the same training step on
real zero-filled CPU tensors and on FakeTensors gives the same allocation trace, event for event. The
real runs are made with two fixed routings, set on the experts' `top_k_index` in place (no allocation):
every token to the same top-k experts (the worst case) and a round robin that gives every expert
T * k / E tokens (uniform). Both real traces equal the one fake trace: transformers' grouped_mm
experts allocate the same whatever the routing, which is why one fake run stands for both.
"""

from __future__ import annotations

import contextlib

import pytest
import torch
import transformers

from memfit.errors import MemfitError
from memfit.sim import moe
from memfit.sim.engine import simulate
from memfit.train_setup import TrainSetup
from helpers import like_fake, trace_key

B, SEQ = 2, 16
TOKENS = B * SEQ


def _mixtral(**kw):
    return transformers.MixtralConfig(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, num_local_experts=4,
                                      num_experts_per_tok=2, **kw)


def _qwen3_moe(**kw):
    return transformers.Qwen3MoeConfig(vocab_size=128, hidden_size=32, intermediate_size=64, moe_intermediate_size=16,
                                       num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                                       num_experts=8, num_experts_per_tok=2, **kw)


def _olmoe(**kw):
    return transformers.OlmoeConfig(vocab_size=128, hidden_size=32, intermediate_size=16, num_hidden_layers=2,
                                    num_attention_heads=4, num_key_value_heads=4, num_experts=8, num_experts_per_tok=2, **kw)


def _deepseek_v2(**kw):
    """Layer 0 dense, layer 1 MoE with 2 shared experts, MLA attention (kv_lora_rank), as DeepSeek-V2-Lite."""
    return transformers.DeepseekV2Config(vocab_size=128, hidden_size=32, intermediate_size=64, moe_intermediate_size=16,
                                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4,
                                         n_routed_experts=8, n_shared_experts=2, num_experts_per_tok=2,
                                         first_k_dense_replace=1, kv_lora_rank=16, q_lora_rank=None, qk_rope_head_dim=8,
                                         qk_nope_head_dim=8, v_head_dim=8, **kw)


def _gpt_oss(**kw):
    """Transposed expert weights with biases (`@use_experts_implementation(is_transposed=True, has_bias=True)`)."""
    return transformers.GptOssConfig(vocab_size=128, hidden_size=32, intermediate_size=32, num_hidden_layers=2,
                                     num_attention_heads=4, num_key_value_heads=2, head_dim=8, num_local_experts=4,
                                     num_experts_per_tok=2, layer_types=["sliding_attention", "full_attention"], **kw)


CONFIGS = {"mixtral": _mixtral, "qwen3_moe": _qwen3_moe, "olmoe": _olmoe, "deepseek_v2": _deepseek_v2, "gpt_oss": _gpt_oss}


def _setup(arch: str, **kw) -> TrainSetup:
    return TrainSetup(model=CONFIGS[arch](), task="causal-lm", per_device_train_batch_size=B, max_length=SEQ, **kw)


_like_fake = like_fake  # tests/helpers.py: masking_utils treats real tensors as FakeTensors


def _routing(kind: str, experts: int, top_k: int) -> torch.Tensor:
    if kind == "worst":  # every token to experts 0..k-1
        return torch.arange(top_k).repeat(TOKENS, 1)
    flat = torch.arange(TOKENS * top_k) % experts  # round robin: each expert gets T * k / E pairs
    return flat.view(TOKENS, top_k)


@contextlib.contextmanager
def _fixed_routing(kind: str, experts: int, top_k: int):
    """Overwrite every experts call's `top_k_index` in place with a routing built before the run."""
    pattern = _routing(kind, experts, top_k)
    seen: list[torch.Tensor] = []

    def pre_hook(module, args):
        if isinstance(module, EXPERTS):
            with torch.no_grad():
                args[1].data.copy_(pattern)  # .data: topk saved these indices; no version bump
            seen.append(pattern)  # no clone: the tracker would record it

    handle = torch.nn.modules.module.register_module_forward_pre_hook(pre_hook)
    try:
        yield seen
    finally:
        handle.remove()


EXPERTS = (transformers.models.mixtral.modeling_mixtral.MixtralExperts,
           transformers.models.qwen3_moe.modeling_qwen3_moe.Qwen3MoeExperts,
           transformers.models.olmoe.modeling_olmoe.OlmoeExperts,
           transformers.models.deepseek_v2.modeling_deepseek_v2.DeepseekV2Experts,
           transformers.models.gpt_oss.modeling_gpt_oss.GptOssExperts)


_key = trace_key  # tests/helpers.py


@pytest.fixture(scope="module", autouse=True)
def _warm_up():
    with _like_fake(), _fixed_routing("worst", 4, 2):
        simulate(_setup("mixtral", precision="bf16"), fake=False, splice=False)


CASES = [
    ("mixtral", dict(precision="bf16")),
    pytest.param("mixtral", dict(precision="fp32", gradient_checkpointing=True), marks=pytest.mark.slow),  # 8 s
    ("qwen3_moe", dict(precision="bf16", weights_dtype="bf16")),
    ("qwen3_moe", dict(precision="bf16", lora_r=4, lora_target_modules=["q_proj", "v_proj"])),
    ("olmoe", dict(precision="bf16")),
    ("deepseek_v2", dict(precision="bf16")),
    ("gpt_oss", dict(precision="bf16", weights_dtype="bf16")),
]


def _id(case) -> str:
    arch, kw = case.values if hasattr(case, "values") else case
    return f"{arch}-{'-'.join(f'{k}={v}' for k, v in kw.items())}"


@pytest.mark.parametrize("arch, kw", CASES, ids=[_id(c) for c in CASES])
def test_real_runs_with_fixed_routings_equal_the_fake_run(arch, kw):
    config = CONFIGS[arch]()
    experts = getattr(config, "num_local_experts", None) or getattr(config, "num_experts", None) or config.n_routed_experts
    fake = _key(simulate(_setup(arch, **kw), fake=True, splice=False).trace)
    for kind in ("worst", "uniform"):
        with _like_fake(), _fixed_routing(kind, experts, config.num_experts_per_tok) as seen:
            real = simulate(_setup(arch, **kw), fake=False, splice=False)
        assert seen, "the experts never ran"
        counts = torch.bincount(seen[0].reshape(-1), minlength=experts).tolist()
        if kind == "worst":
            assert counts[:2] == [TOKENS, TOKENS] and sum(counts) == 2 * TOKENS
        else:
            assert counts == [TOKENS * 2 // experts] * experts
        assert _key(real.trace) == fake, f"{arch} {kind}"


def test_the_fake_run_needs_the_cuda_grouped_mm():
    """Without memfit.sim.moe's grouped_mm, torch's meta kernel refuses the float32 GEMM an AMP run makes."""
    from memfit.sim import cuda_patches

    @contextlib.contextmanager
    def nothing():
        yield

    plain = moe.cuda_grouped_mm
    moe.cuda_grouped_mm = nothing
    try:
        with pytest.raises(RuntimeError, match="BF16"):
            simulate(_setup("mixtral", precision="bf16"), fake=True, splice=False)
    finally:
        moe.cuda_grouped_mm = plain
    assert cuda_patches.cuda_patches  # the patch is entered from cuda_patches


def test_routing_figures_and_note():
    from memfit.models.build import build_meta_model

    model = build_meta_model(_setup("qwen3_moe"))
    fig = moe.routing_figures(model, tokens=2048)
    assert (fig.experts, fig.top_k, fig.moe_layers) == (8, 2, 2)
    assert fig.expected_tokens_per_expert == 2048 * 2 / 8 and fig.worst_tokens_per_expert == 2048
    assert fig.dispatched_rows == 4096 and fig.experts_implementation == "grouped_mm"
    dense = build_meta_model(TrainSetup(model=transformers.LlamaConfig(
        vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4),
        task="causal-lm", max_length=16))
    assert moe.routing_figures(dense, tokens=16) is None
    r = simulate(_setup("mixtral"), fake=True)
    note = next(n for n in r.notes if n.startswith("MoE:"))
    assert f"{TOKENS * 2 / 4:g} expected" in note and f"{TOKENS} worst case" in note


def test_eager_experts_are_refused_in_one_line():
    config = _mixtral()
    config._experts_implementation = "eager"
    with pytest.raises(MemfitError, match="experts_implementation `eager`"):
        simulate(TrainSetup(model=config, task="causal-lm", per_device_train_batch_size=1, max_length=8), fake=True)


def test_expert_weights_are_counted():
    """Mixtral's experts are two 3-D parameters per layer: E x 2I x H and E x H x I."""
    r = simulate(_setup("mixtral"), fake=True)
    c = _mixtral()
    per_layer_experts = c.num_local_experts * 3 * c.intermediate_size * c.hidden_size
    router = c.num_local_experts * c.hidden_size
    attn = c.hidden_size * (c.hidden_size * 2 + 2 * (c.hidden_size // 4 * 2))
    norms = 2 * c.hidden_size
    expected = 2 * (per_layer_experts + router + attn + norms) + 2 * c.vocab_size * c.hidden_size + c.hidden_size
    assert r.params == expected
