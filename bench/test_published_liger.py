"""bench/published_liger.py: the records of Liger-Kernel's end-to-end examples and what memfit runs for them.

The simulations themselves (7B-8B models on 4 FSDP ranks, a minute each) are the bench script's job; these
tests check the records' provenance and that each run is expressed as the examples ran it."""

from __future__ import annotations

import importlib.util
import inspect
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _bench():
    spec = importlib.util.spec_from_file_location("bench_published_liger", ROOT / "bench" / "published_liger.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules.setdefault("bench_published_liger", module)
    spec.loader.exec_module(module)
    return module


def test_records_carry_their_source_and_one_figure_or_an_oom():
    records = _bench().load_records()
    assert len(records) == 16 and len({r["id"] for r in records}) == 16
    for r in records:
        assert r["source_url"].startswith("https://github.com/linkedin/Liger-Kernel/blob/" + r["source_commit"])
        assert r["metric"] == "allocated" and r["max_seq_length"] == 512
        assert (r["value_mib"] is None) == r["oom"], r["id"]
        if r["use_liger"]:
            assert {"rope", "fused_linear_cross_entropy"} <= set(r["liger_patched"]), r["id"]
    # the Qwen chart is the one with labels: its figures are exact, the others read from pixels
    assert all(r["read_tolerance_mib"] is None for r in records if r["run"] == "qwen")


@pytest.mark.parametrize("record_id, config", [
    ("llama-bs32-liger", {"rms_norm": False, "swiglu": False}),  # classes swapped after the model was built
    ("qwen-bs48-liger", {"rms_norm": False, "swiglu": False}),
    ("gemma-bs64-liger", {}),  # AutoLigerKernelForCausalLM: patched before building, all four kernels
])
def test_liger_runs_patch_what_the_examples_patched(record_id, config):
    bench = _bench()
    record = next(r for r in bench.load_records() if r["id"] == record_id)
    folders: dict[str, str] = {}
    setup, parallel = bench.setup_of(record, folders)
    assert setup.use_liger_kernel and dict(setup.liger_kernel_config or {}) == config
    assert (parallel.strategy, parallel.fsdp_version, parallel.world_size) == ("fsdp", 1, 4)
    assert parallel.param_dtype == "bf16" and setup.gradient_checkpointing and setup.max_length == 512
    import liger_kernel.transformers.monkey_patch as mp

    apply = {"llama": mp.apply_liger_kernel_to_llama, "qwen": mp.apply_liger_kernel_to_qwen2,
             "gemma": mp.apply_liger_kernel_to_gemma}[record["run"]]
    assert set(config) <= set(inspect.signature(apply).parameters)  # the keywords exist in the installed Liger
