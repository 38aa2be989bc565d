"""Liger kernels in the simulation (memfit.sim.kernels.liger): the installed source's chunking rule, FLCE's
allocations (no N x V logits), the module patches undone, and the effect on a Llama-like estimate."""

from __future__ import annotations

import inspect

import pytest
import torch
from transformers import LlamaConfig

pytest.importorskip("liger_kernel")

from memfit.sim import _torch_adapter as adapter  # noqa: E402
from memfit.sim.engine import simulate  # noqa: E402
from memfit.sim.kernels import liger as lg  # noqa: E402
from memfit.sim.tracker import StorageTracker  # noqa: E402
from memfit.train_setup import TrainSetup  # noqa: E402
from helpers import trace_peak_bytes


def test_installed_flce_chunking_rule_is_the_one_memfit_models():
    """Reads the installed liger-kernel: an upgrade that changes the chunking rule fails here."""
    import liger_kernel.ops.fused_linear_cross_entropy as flce

    src = inspect.getsource(flce.fused_linear_cross_entropy_forward)
    assert "inc_factor = triton.cdiv(V, chunk_mem_const * H)" in src
    assert "chunk_size = triton.next_power_of_2(triton.cdiv(BT, inc_factor))" in src
    assert "chunk_size = min(chunk_size, BT)" in src
    assert "torch.empty((chunk_size, V), dtype=_input.dtype" in src  # the one logits buffer
    assert flce._CHUNK_MEM_CONST == 1
    assert lg.flce_chunk_size(4096, 4096, 128256) == 128  # Llama 3 8B: cdiv(128256, 4096) = 32 -> 4096/32
    assert lg.flce_chunk_size(4096, 256, 32000) == 64  # inc 125 -> cdiv 33 -> next power of 2
    assert lg.flce_chunk_size(100, 4096, 1000) == 100  # one chunk, capped at BT


def _llama(vocab=32000, layers=2):
    return LlamaConfig(hidden_size=256, intermediate_size=512, num_hidden_layers=layers, num_attention_heads=8,
                       num_key_value_heads=2, vocab_size=vocab, max_position_embeddings=4096)


def test_flce_allocates_one_chunk_of_logits_not_n_by_v():
    """LigerForCausalLMLoss on (BT, H) hidden states: Liger's own buffers, the logits only (chunk, V)."""
    from liger_kernel.transformers.model.loss_utils import LigerForCausalLMLoss
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(_llama(), dtype=torch.bfloat16)
    BT, H, V = 4096, 256, 32000
    tracker = StorageTracker()
    log: list[str] = []
    with lg.liger_emulation([model], None, num_sms=108, compute_capability=(8, 0), log=log), \
            adapter.new_fake_mode(), tracker:
        hidden = torch.empty(1, BT, H, dtype=torch.bfloat16, requires_grad=True)
        weight = torch.empty(V, H, dtype=torch.bfloat16)  # frozen head (LoRA)
        labels = torch.zeros(1, BT, dtype=torch.long)
        start = len(tracker.events)
        loss = LigerForCausalLMLoss(hidden, weight, labels, hidden_size=H)
        sizes = [rec.size_bytes for a, rec, _, _ in tracker.events[start:] if a == "alloc"]
        loss.backward()
    chunk = lg.flce_chunk_size(BT, H, V)
    assert chunk * V * 2 in sizes  # logits_storage (chunk, V) bf16
    assert max(sizes) == chunk * V * 2 < BT * V * 2 // 32
    assert BT * H * 2 in sizes  # grad_input computed in the forward (saved for backward)
    assert "liger:fused_linear_cross_entropy" in log


def test_module_patches_are_undone_after_the_simulation():
    from transformers.models.llama import modeling_llama

    before = (modeling_llama.apply_rotary_pos_emb, modeling_llama.LlamaRMSNorm, modeling_llama.LlamaMLP,
              torch.nn.functional.cross_entropy)
    setup = TrainSetup(model=_llama(vocab=1000), task="causal-lm", per_device_train_batch_size=1, max_length=128,
                       precision="bf16", use_liger_kernel=True)
    sim = simulate(setup)
    assert {"liger:fused_linear_cross_entropy", "liger:rms_norm", "liger:rope", "liger:swiglu"} <= set(sim.attn_kernels)
    after = (modeling_llama.apply_rotary_pos_emb, modeling_llama.LlamaRMSNorm, modeling_llama.LlamaMLP,
             torch.nn.functional.cross_entropy)
    assert after == before


_peak = trace_peak_bytes  # tests/helpers.py


def test_liger_removes_the_logits_from_the_peak():
    """Full fine-tuning, 2 x 1024 tokens, V = 32000: without Liger the fp32 logits (2048 x 32000) and their
    gradient are the largest tensors; with Liger nothing reaches (N x V)."""
    runs = {}
    for liger in (False, True):
        setup = TrainSetup(model=_llama(), task="causal-lm", per_device_train_batch_size=2, max_length=1024,
                           precision="bf16", attn_implementation="flash_attention_2", use_liger_kernel=liger)
        sim = simulate(setup)
        runs[liger] = (_peak(sim.trace), max(e.size_bytes for e in sim.trace if e.action == "alloc"))
    n_by_v_fp32 = 2 * 1024 * 32000 * 4
    assert runs[False][1] >= n_by_v_fp32  # ForCausalLMLoss: logits.float()
    assert runs[True][1] == 32000 * 256 * 4  # the largest tensor is now a (V, H) fp32 weight / its Adam state
    assert runs[True][0] < runs[False][0] / 2


def test_unsupported_model_type_is_a_clear_error():
    from memfit.errors import MemfitError

    setup = TrainSetup(model="bert-base-uncased", task="seq-cls", per_device_train_batch_size=1, max_length=32,
                       use_liger_kernel=True)
    with pytest.raises(MemfitError, match="Liger has no kernels for model type `bert`.*drop `--liger`"):
        simulate(setup)


def test_liger_kernel_config_keys_are_checked():
    from memfit.errors import MemfitError

    with pytest.raises(MemfitError, match="`liger_kernel_config` key `rmsnorm` is not modelled.*rms_norm"):
        TrainSetup(model=_llama(), task="causal-lm", use_liger_kernel=True, liger_kernel_config={"rmsnorm": False})
    s = TrainSetup.from_kwargs(_llama(), task="causal-lm", training_args={"use_liger_kernel": True})
    assert s.use_liger_kernel and not any("not modelled" in n for n in s.notes)


def test_supported_model_types_read_from_source_match_liger_imported():
    """The liger check reads `MODEL_TYPE_TO_APPLY_LIGER_FN`'s keys from the installed source without importing it
    (the import cost 0.8 s of a seed plan); the keys must be exactly the imported dict's, and a fresh
    process must not import liger_kernel.transformers to answer."""
    import subprocess
    import sys

    from liger_kernel.transformers.monkey_patch import MODEL_TYPE_TO_APPLY_LIGER_FN

    from_source = lg._model_types_from_source()
    assert from_source is not None and list(from_source) == sorted(MODEL_TYPE_TO_APPLY_LIGER_FN)
    assert "llama" in from_source and "xlnet" not in from_source
    code = ("import sys; from memfit.sim.kernels.liger import liger_supported_model_types as f; "
            "names = f(); print(len(names), 'liger_kernel.transformers' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert out.stdout.split() == [str(len(MODEL_TYPE_TO_APPLY_LIGER_FN)), "False"]


def test_supported_model_types_fall_back_to_the_import_when_the_literal_is_not_found(monkeypatch):
    from liger_kernel.transformers.monkey_patch import MODEL_TYPE_TO_APPLY_LIGER_FN

    monkeypatch.setattr(lg, "_model_types_from_source", lambda: None)
    assert lg.liger_supported_model_types() == sorted(MODEL_TYPE_TO_APPLY_LIGER_FN)


@pytest.mark.parametrize("text, expected", [
    ('x = 1\nMODEL_TYPE_TO_APPLY_LIGER_FN = {\n    "llama": f,\n    "qwen2": g,\n}\n', ("llama", "qwen2")),
    ('\nMODEL_TYPE_TO_APPLY_LIGER_FN = {\n    "llama": f,\n}\nMODEL_TYPE_TO_APPLY_LIGER_FN["x"] = h\n', None),
    ('\nMODEL_TYPE_TO_APPLY_LIGER_FN = {\n    "llama": f,\n}\nMODEL_TYPE_TO_APPLY_LIGER_FN.update(more)\n', None),
    ('\nMODEL_TYPE_TO_APPLY_LIGER_FN = {\n    NAME: f,\n}\n', None),  # a key that is not a string literal
    ('\nMODEL_TYPE_TO_APPLY_LIGER_FN = dict(llama=f)\n', None),
    ('\nMODEL_TYPE_TO_APPLY_LIGER_FN = {\n    "llama": f,\n}\nif X:\n    MODEL_TYPE_TO_APPLY_LIGER_FN = {}\n', None),
])
def test_the_source_reader_takes_only_a_literal_nothing_changes_later(text, expected):
    """What the reader cannot be sure of (the dict changed later, keys that are not literals) falls back to the
    import (None here), so a liger-kernel version that builds the dict differently is still answered right."""
    assert lg.model_types_in_source(text) == expected
