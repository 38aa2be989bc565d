"""bench/published.py on small derived copies of the published records (tests/data/published).

The Liger-Kernel op benchmarks were measured on an A100 with `max_memory_allocated()`; memfit's
tracker on fake tensors plus its allocator model must reproduce them to the byte (all but the
three with 4 GiB logits, see `test_liger_op_benchmarks_to_the_byte`). The classification of records
memfit can and cannot express is checked on one record of each kind.
"""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DATA = ROOT / "tests" / "data" / "published"
MIB = 1024**2


def _bench():
    spec = importlib.util.spec_from_file_location("bench_published", ROOT / "bench" / "published.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules.setdefault("bench_published", module)
    spec.loader.exec_module(module)
    return module


published = _bench()
LIGER = json.loads((DATA / "liger_huggingface_memory.json").read_text())
SAMPLE = {r["record_id"]: r for r in json.loads((DATA / "records_sample.json").read_text())}


def _largest_buffer_bytes(case) -> int:
    """Bytes of the op's largest tensor (the logits for the two loss benchmarks)."""
    d = dict(case.dims)
    size = 4 if d.get("dtype") == "fp32" else 2
    if case.op == "cross_entropy":
        return d["rows"] * d["vocab"] * size
    if case.op == "lm_head_ce":
        return d["tokens"] * d["vocab"] * size
    if case.op == "rms_norm":
        return d["rows"] * d["hidden"] * 4  # the fp32 upcast
    return d["batch"] * d["seq"] * d["intermediate"] * size


@pytest.mark.parametrize("record", LIGER, ids=[str(r["record_id"]) for r in LIGER])
def test_liger_op_benchmarks_to_the_byte(record):
    case = published.express(record)
    assert isinstance(case, published.OpCase)
    from memfit.gpus.catalog import CATALOG
    from memfit.gpus.outside_pytorch import cublas_workspace_bytes

    build, step, matmul = published.OPS[case.op](dict(case.dims))
    workspace = 2 * cublas_workspace_bytes(CATALOG["a100-80gb"]) if matmul else 0
    predicted = published.simulate_op(build, step, workspace_bytes=workspace)
    measured = round(float(record["csv_y_value_50_mib"]) * MIB)
    if _largest_buffer_bytes(case) < 2**32:
        assert predicted == measured
    else:
        # The three records whose logits reach 4 GiB (CE at V=65536 and 131072, lm_head+CE at 32768
        # tokens) measured 1024 B (two 512-B blocks: two scalars alive at the peak) less than memfit;
        # the lm_head+CE record at 3.9 GiB of logits matches to the byte. Not explained without a GPU.
        assert predicted - measured == 1024


def test_without_the_workspaces_lm_head_is_short_by_exactly_them():
    """The cuBLAS workspaces are part of the measurement: without them memfit is 2 x 8.125 MiB short."""
    record = next(r for r in LIGER if "lm_head" in r["model"])
    case = published.express(record)
    build, step, _ = published.OPS[case.op](dict(case.dims))
    bare = published.simulate_op(build, step, workspace_bytes=0)
    measured = round(float(record["csv_y_value_50_mib"]) * MIB)
    assert measured - bare == 2 * (4096 * 1024 * 2 + 16 * 1024 * 8)


def test_last_iteration_counts_the_accumulated_grad():
    """Iteration 1 allocates .grad; from iteration 2 it persists: 5 logits-sized buffers, not 4."""
    record = next(r for r in LIGER if "CrossEntropyLoss" in r["model"])
    case = published.express(record)
    build, step, _ = published.OPS[case.op](dict(case.dims))
    d = dict(case.dims)
    logits = d["rows"] * d["vocab"] * 4
    first = published.simulate_op(build, step, iterations=1)
    second = published.simulate_op(build, step, iterations=2)
    assert second - first == logits


def test_classification_of_records():
    express = published.express
    full = express(SAMPLE[28])
    assert isinstance(full, published.TrainCase)
    fields = dict(full.setup_fields)
    assert fields["precision"] == "fp32" and fields["weights_dtype"] == "bf16"  # pure bf16, no autocast
    assert fields["max_length"] == 768 and fields["per_device_train_batch_size"] == 4
    assert full.measured_mib == SAMPLE[28]["extra"]["reserved_99th_pct_mib"]  # train-only, not the run max
    lora = dict(express(SAMPLE[46]).setup_fields)
    assert lora["lora_r"] == 32 and lora["lora_target_modules"] == ("q_proj", "v_proj")
    mlp = dict(express(SAMPLE[41]).setup_fields)
    assert mlp["lora_r"] == 10 and mlp["lora_target_modules"] == ("down_proj", "gate_proj", "up_proj")
    assert dict(express(SAMPLE[47]).setup_fields)["lora_r"] == 64  # rsLoRA: same memory as LoRA
    dora = dict(express(SAMPLE[43]).setup_fields)  # DoRA through the LoRA fields
    assert dora["use_dora"] is True and dora["lora_r"] == 32
    assert json.loads(dict(express(SAMPLE[14]).setup_fields)["peft_config"])["peft_type"] == "ADALORA"
    assert "LoRA-FA" in express(SAMPLE[44]).missing
    assert "cannot be simulated under fake tensors" in express(SAMPLE[69]).missing  # SHiRA
    assert "torchtune's own model code" in express(SAMPLE[81]).missing
    assert "lower bound" in express(SAMPLE[3]).missing


def test_untied_bytes_counts_the_copy_at_the_peak():
    from types import SimpleNamespace

    delta = 1000
    lora = SimpleNamespace(params=10_000 + delta, trainable_params=50, peak_phase="backward",
                           breakdown={"weights": 1, "gradients": 0, "optimizer_state": 400})
    assert published.untied_bytes(lora, 10_000) == 2 * delta  # frozen head: its weights only
    full = SimpleNamespace(params=10_000 + delta, trainable_params=10_000 + delta, peak_phase="optimizer",
                           breakdown={"gradients": 2 * 11_000, "optimizer_state": 4 * 11_000, "temporaries": 2 * 11_000})
    assert published.untied_bytes(full, 10_000) == 5 * 2 * delta  # weights, grad, 2 states, foreach sqrt
    assert published.untied_bytes(full, None) == 0
    assert published.untied_bytes(full, 20_000) == 0


def test_bad_data_file_is_a_one_line_error(tmp_path):
    with pytest.raises(SystemExit, match="does not exist"):
        published.load_records(tmp_path / "missing.json")
    bad = tmp_path / "bad.json"
    bad.write_text("{}")
    with pytest.raises(SystemExit, match="not a JSON list"):
        published.load_records(bad)


#: peft method records whose adapter memfit builds with peft on the meta Llama-3.2-3B.
PEFT_METHOD_RECORDS = [14, 19, 34, 39, 43, 52, 56, 59, 75]


@pytest.mark.parametrize("record_id", PEFT_METHOD_RECORDS)
def test_peft_method_records_build_the_runs_trainable_count(record_id):
    """The experiment's adapter_config.json, built by peft on memfit's meta Llama-3.2-3B, trains exactly the
    parameters the real L40S run counted (the record's `num_trainable_params`, peft's own count there)."""
    from memfit.models.build import build_meta_model
    from memfit.models.peft_methods import apply_peft
    from memfit.train_setup import TrainSetup

    case = published.express(SAMPLE[record_id])
    assert isinstance(case, published.TrainCase)
    fields = dict(case.setup_fields)
    if "lora_target_modules" in fields:
        fields["lora_target_modules"] = list(fields["lora_target_modules"])
    setup = TrainSetup(**fields)
    model = apply_peft(build_meta_model(setup), setup)
    trainable = {id(p): p.numel() for p in model.parameters() if p.requires_grad}
    assert sum(trainable.values()) == SAMPLE[record_id]["extra"]["num_trainable_params"]


def test_summary_separates_known_inputs_from_assumed_lengths():
    """The op benchmarks (fixed shapes) and the training runs (example lengths not published) get a line each."""
    Row = published.Row
    rows = [Row(0, "kernel_microbenchmark", "op", "m", 100.0, 101.0),
            Row(1, "peft_method_comparison_json", "run", "m", 100.0, 120.0),
            Row(2, "peft_method_comparison_json", "run", "m", 100.0, 90.0)]
    lines = published.summary(rows)
    assert lines[0] == "inputs fully known (fixed op shapes): median |error| 0.010000, max 0.010000 over 1"
    assert lines[1] == ("data lengths assumed (each batch padded to the configured maximum): median |error| 0.150000, "
                        "max 0.200000 over 2")
    assert lines[-1] == "published_median_abs_error=0.100000 over 3 records"


def test_multimodal_records_run_the_inputs_they_state():
    """Each vision-language / speech record is a training case built from its own `memfit.setup` (TrainSetup accepts
    it as given), compared with its `value_mib`, and says what was assumed and how the run differs."""
    from memfit.train_setup import TrainSetup

    records = published.load_multimodal()
    assert {r["source_kind"] for r in records} == set(published._GIVEN_KINDS)
    for record in records:
        case = published.express(record)
        assert isinstance(case, published.TrainCase)
        assert case.measured_mib == record["value_mib"]
        fields = dict(case.setup_fields)
        assert fields["model"] == record["memfit"]["setup"]["model"]
        if isinstance(fields.get("lora_target_modules"), tuple):
            fields["lora_target_modules"] = list(fields["lora_target_modules"])
        setup = TrainSetup(**fields)
        assert setup.task in ("image-text-to-text", "speech-seq2seq") or setup.trainer == "grpo"
        assert record["memfit"]["assumed"] and record["memfit"]["differs"]
        from memfit.gpus.catalog import CATALOG

        assert record["memfit"]["gpu"] in CATALOG  # the run's GPU, for the reserved and nvidia-smi figures
    vlm = dict(published.express(records[0]).setup_fields)
    assert json.loads(vlm["peft_config"])["modules_to_save"] == ["visual"]  # the run trains the ViT too
    grpo = next(r for r in records if r["source_kind"] == "trl_notebook_output")
    assert "max_memory_reserved" in grpo["notes"] and published.express(grpo).metric == "reserved"


def test_multimodal_records_file_errors_in_one_line(tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text("[]")
    with pytest.raises(SystemExit, match="no `records` list"):
        published.load_multimodal(bad)
    with pytest.raises(SystemExit, match="cannot read records file"):
        published.load_multimodal(tmp_path / "missing.json")


def test_multimodal_allocated_records_compare_the_allocated_peak():
    """A record of `max_memory_allocated()` is compared with memfit's peak allocated, its reserved twin (the same run)
    with the peak reserved; both come from one estimate of the same setup."""
    from types import SimpleNamespace

    records = published.load_multimodal()
    pair = [r for r in records if r["source_kind"] == "grpo_probe_jsonl"][:2]
    assert [r["metric"] for r in pair] == ["allocated", "reserved"]
    assert pair[0]["memfit"]["setup"] == pair[1]["memfit"]["setup"]
    report = SimpleNamespace(peak_allocated_bytes=100 * MIB, peak_reserved_bytes=200 * MIB,
                             device_used_bytes=300 * MIB, trainable_params=1)

    class Stub:
        def report(self, fields, gpu=None):
            assert gpu == pair[0]["memfit"]["gpu"]
            return report

    predicted = [published.predict_train(Stub(), published.express(r), r, records, False)[0] for r in pair]
    assert predicted == [100.0, 200.0]
