"""Diagnose verdicts checked against each message's own arithmetic.

The corpus (tests/data/oom/corpus.json, real messages from GitHub issues) names the primary
cause of every message; every allocator message, and messages generated from random figures,
must also obey the invariants the figures imply: fragmentation is never ruled out when the
unused cache plus free memory covers the request, the GPU is never "full" when free memory
exceeds the request, the failing process is never taken for another one, an unprinted figure
is unknown and never 0, and no two causes contradict each other.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from helpers import DATA_DIR
from memfit.cli import main
from memfit.diagnosis import detect_phase, diagnose
from memfit.diagnosis.causes import (
    ALLOCATION_HEADROOM_MIN_BYTES,
    CAUSE_KINDS,
    ALLOCATION_HEADROOM_SHARE,
    XPU_MAX_SINGLE_ALLOCATION_BYTES,
)
from memfit.errors import MemfitError
from memfit.fitting.recovery import OOM_FRAGMENTS as RECOVERY_FRAGMENTS
from memfit.fitting.recovery import is_oom_error
from memfit.diagnosis.strings import LANGS, MESSAGES
from memfit.oom_text import OOM_FRAGMENTS, find_ooms, format_oom_message, is_oom_text, parse_oom
from memfit.units import GiB, MiB, parse_size

DATA = DATA_DIR / "oom"
CORPUS = json.loads((DATA / "corpus.json").read_text(encoding="utf-8"))
BY_ID = {c["id"]: c for c in CORPUS}

ISSUE_FRAG = BY_ID["quoted_frag"]["text"]
ISSUE_FREE = BY_ID["quoted_free"]["text"]
ISSUE_SELF = BY_ID["quoted_self"]["text"]
ISSUE_MPS = ("MPS backend out of memory (MPS allocated: 9.57 GiB, other allocations: 17.35 GiB, max allowed: "
             "27.20 GiB). Tried to allocate 292.50 MiB on private pool.")
K_SMALL_BUFFER = 2 * MiB  # c10/cuda/CUDACachingAllocator.cpp kSmallBuffer


def _tol(*values) -> int:
    """Rounding of printed figures: half a unit of the second decimal each."""
    tol = 0
    for n in values:
        if n is not None and n > 1024:
            tol += int(0.005 * (1024 if n <= MiB else MiB if n <= GiB else GiB)) + 1
    return tol


def _primary(d):
    return [c for c in d.causes if c.primary]


def _text(d) -> str:
    return " ".join(c.text for c in d.causes)


def check_invariants(m, d) -> None:
    """What the message's figures imply for any diagnosis of it (computed here, not taken from memfit)."""
    T, C, F = m.tried_to_allocate_bytes, m.total_bytes, m.free_bytes
    U, R = m.reserved_unallocated_bytes, m.reserved_bytes
    assert len(_primary(d)) == 1, [c.kind for c in d.causes]
    assert all(c.kind in CAUSE_KINDS for c in d.causes)
    primary = _primary(d)[0].kind
    frag = [c for c in d.causes if c.kind == "fragmentation"]
    frag_text = frag[0].text if frag else ""
    text = _text(d)
    if F is not None and C is not None and F > C + _tol(F, C):
        F = None  # not a measurement of this device; memfit says so and does not use it
        assert any(c.kind == "inconsistent_free" for c in d.causes)
    exceeds_total = T is not None and C is not None and T > C

    # Fragmentation is never ruled out when the unused cache plus free memory covers the request
    # (with free memory above the request, only a cached piece of the request's size would count).
    if None not in (T, F, U) and U + F >= T and not (F >= T and U < T):
        assert not frag_text.startswith("Not fragmentation"), frag_text
    # ... and decides when free memory alone was short of a large-pool request that the cache covers.
    if None not in (T, F, U) and not exceeds_total and F < T <= U + F and T > K_SMALL_BUFFER:
        assert primary in ("fragmentation", "memory_cap", "backend_limit"), primary
        assert "allocator" in d.advice_ids[:2]

    # The GPU is never full, and memory never short, when free memory exceeds the request.
    if T is not None and F is not None and F >= T:
        assert "True shortfall" not in text and "GPU is full" not in text and "needed at least" not in text
        assert "too little for a new segment" not in text
    headroom = max(ALLOCATION_HEADROOM_MIN_BYTES, int(ALLOCATION_HEADROOM_SHARE * (T or 0)))
    if T is not None and F is not None and F >= T + headroom and not exceeds_total:
        assert primary in ("free_exceeds_request", "memory_cap", "backend_limit", "other_processes"), primary
        assert "would have fit" not in frag_text
    # A shortfall is only claimed with less free memory than the request plus headroom.
    if primary == "shortfall" and not exceeds_total:
        assert F is not None and F < T + headroom
    # Never both "it would have fit" and "it could not".
    assert not ("would have fit" in text and ("True shortfall" in text or "GPU is full" in text))

    # The failing process is never taken for another one.
    if m.process_used_bytes is None and R and C is not None and F is not None:
        must_be_self = [pid for pid, b in m.other_processes
                        if R - _tol(b, R) <= b <= C and b + R > C - F + _tol(b, R, C, F)]
        if must_be_self:  # it holds this process's cache: the two cannot both fit in what is in use
            selves = [c for c in d.causes if c.kind == "self_pid"]
            assert len(selves) == 1
            pid = next(p for p in must_be_self if f"Process {p} " in selves[0].text)
            others = [c for c in d.causes if c.kind == "other_processes"]
            assert not any(f"PID {pid} " in c.text for c in others)

    # Figures the message does not print are unknown, never 0.
    if m.has_numbers and m.free_bytes is None:
        outside = [c for c in d.causes if c.kind == "non_pytorch"]
        assert all(c.bytes is None for c in outside)
        assert "unknown" in text or "cannot" in text
    if m.has_numbers and None not in (C, F, R) and C - F - R >= 0:
        outside = [c for c in d.causes if c.kind == "non_pytorch"]
        assert outside and outside[0].bytes == C - F - R


ALLOCATOR_CASES = [c for c in CORPUS if parse_oom(c["text"]).has_numbers]


@pytest.mark.parametrize("case", CORPUS, ids=[c["id"] for c in CORPUS])
def test_corpus_primary_cause_and_the_arithmetic(case):
    d = diagnose(case["text"])
    assert d.is_oom
    assert _primary(d)[0].kind == case["primary"] and d.causes[0].primary
    check_invariants(d.message, d)
    if "self_pid" in case:
        pid = case["self_pid"]
        assert any(c.kind == "self_pid" and str(pid) in c.text for c in d.causes)
        assert not any(c.kind == "other_processes" and str(pid) in c.text for c in d.causes)
        assert "stop_other_processes" not in d.advice_ids


def test_corpus_spans_every_backend_and_the_new_formats():
    backends = {c["expect"]["backend"] for c in CORPUS}
    assert {"cuda", "rocm", "xpu", "mps", "cpu", None} <= backends
    sources = [c["source"] for c in CORPUS]
    assert sum(s.startswith("https://github.com/") for s in sources) >= 60
    assert len(ALLOCATOR_CASES) >= 50


_sizes = st.integers(min_value=0, max_value=100 * GiB)


@settings(max_examples=250, deadline=None)
@given(tried=st.integers(min_value=512, max_value=100 * GiB), total=st.integers(min_value=GiB, max_value=200 * GiB),
       free_share=st.floats(0, 1), alloc=_sizes, unalloc=_sizes, proc=st.none() | _sizes,
       others=st.lists(st.tuples(st.integers(1, 4_000_000), _sizes), max_size=2, unique_by=lambda pb: pb[0]),
       allowed=st.none() | _sizes, hip=st.booleans())
def test_generated_messages_obey_their_arithmetic(tried, total, free_share, alloc, unalloc, proc, others, allowed,
                                                  hip):
    text = format_oom_message(device=0, tried_to_allocate_bytes=tried, total_bytes=total,
                              free_bytes=int(free_share * total), process_used_bytes=proc, allocated_bytes=alloc,
                              reserved_unallocated_bytes=unalloc, other_processes=others, allowed_bytes=allowed)
    if hip:
        text = text.replace("CUDA out of memory", "HIP out of memory")
    d = diagnose("torch.OutOfMemoryError: " + text)
    check_invariants(d.message, d)
    zh = diagnose(text, lang="zh")
    assert zh.advice_ids == d.advice_ids and [c.kind for c in zh.causes] == [c.kind for c in d.causes]


# ------------------------------------------------------------------ the issue's bullets, one test each


def test_fragmentation_is_judged_by_unused_cache_plus_free_not_by_its_share():
    d = diagnose(ISSUE_FRAG)  # 910.35 MiB unused (4% of the cache) + 115.69 MiB free >= 158 MiB
    assert d.causes[0].kind == "fragmentation" and d.causes[0].primary
    assert "would have fit" in d.causes[0].text
    assert d.advice_ids[0] == "allocator"
    assert "Not fragmentation" not in _text(d)
    shortfall = next(c for c in d.causes if c.kind == "shortfall")
    assert "True shortfall" not in shortfall.text  # the deficit is explained, not contradicted


def test_free_above_the_request_is_never_a_full_gpu():
    d = diagnose(ISSUE_FREE)  # 10 MiB requested with 1.57 GiB free
    assert d.causes[0].kind == "free_exceeds_request" and d.causes[0].primary
    text = _text(d)
    assert "GPU is full" not in text and "too little for a new segment" not in text and "True shortfall" not in text
    assert "per-process limit" in text and "WDDM" in text
    assert d.advice_ids[0] == "check_driver.cuda"


def test_rocm_free_above_the_request_names_the_hip_allocator_and_does_not_contradict_itself():
    d = diagnose(BY_ID["pt175431"]["text"])  # 2 MiB requested, 203.49 GiB free, ROCm
    text = _text(d)
    assert d.causes[0].kind == "free_exceeds_request" and "HIP allocator" in d.causes[0].text
    assert not ("would have fit" in text and "full" in text)
    assert d.advice_ids[0] == "check_driver.rocm"


def test_windows_log_explains_free_above_the_request_by_wddm():
    log = ('  File "C:\\Users\\me\\train.py", line 3, in <module>\n    loss.backward()\n' + ISSUE_FREE)
    d = diagnose(log)
    assert d.causes[0].kind == "free_exceeds_request" and "WDDM" in d.causes[0].text
    assert d.advice_ids[0] == "check_driver.windows"


def test_a_single_allocation_above_the_xpu_limit_is_named():
    d = diagnose(BY_ID["xpuops3011"]["text"])  # 4.66 GiB with 5.65 GiB free on an Intel GPU
    assert d.message.tried_to_allocate_bytes > XPU_MAX_SINGLE_ALLOCATION_BYTES
    assert d.causes[0].kind == "backend_limit" and "max_mem_alloc_size" in d.causes[0].text
    assert d.advice_ids[0] == "split_allocation.xpu"
    small = BY_ID["xpuops3011"]["text"].replace("4.66 GiB.", "192.00 MiB.")  # the estimate total - reserved
    d = diagnose(small)
    assert d.causes[0].kind == "free_exceeds_request" and "estimate" in d.causes[0].text


def test_the_failing_process_is_not_taken_for_another_one():
    d = diagnose(ISSUE_SELF)  # 76.92 GiB + this process's 74.87 GiB reserved > the 79.32 GiB card
    kinds = [c.kind for c in d.causes]
    assert "self_pid" in kinds and "other_processes" not in kinds
    assert "stop_other_processes" not in d.advice_ids
    self_cause = next(c for c in d.causes if c.kind == "self_pid")
    assert "105400" in self_cause.text and "151.79 GiB" in self_cause.text and "76.92 GiB" in self_cause.text
    outside = next(c for c in d.causes if c.kind == "non_pytorch")
    assert "something else holds GPU memory" not in outside.text  # it is this process's own 2.05 GiB


def test_unprinted_figures_are_unknown_not_zero():
    old_xpu = BY_ID["ipex629"]["text"]  # no free figure: the 15.56 GiB is not "outside PyTorch"
    d = diagnose(old_xpu)
    assert d.message.free_bytes is None and d.non_pytorch_bytes is None
    assert d.causes[0].kind == "unknown_free"
    assert "0 B free" not in _text(d)  # before: "About 15.39 GiB (15.56 GiB total − 0 B free − ...) outside"
    outside = next(c for c in d.causes if c.kind == "non_pytorch")
    assert outside.bytes is None and "unknown" in outside.text
    assert "cannot be told" in d.causes[0].text


def test_cli_table_shows_unknown_figures(capsys):
    assert main(["diagnose", "--text", BY_ID["ipex846"]["text"]]) == 0
    out = capsys.readouterr().out
    assert "Intel XPU" in out and "free on the device" in out and "unknown (not in the message)" in out


def test_mps_messages_are_recognised_and_read_with_their_arithmetic(capsys):
    d = diagnose(ISSUE_MPS)
    assert d.is_oom and d.message.backend == "mps"
    assert d.causes[0].kind == "mps_watermark" and "27.21 GiB" in d.causes[0].text  # 9.57 + 17.35 + 0.29
    assert any(c.kind == "mps_other_allocations" and c.bytes == parse_size("17.35GiB") for c in d.causes)
    assert main(["diagnose", "--text", ISSUE_MPS]) == 0
    out = capsys.readouterr().out
    assert "Apple MPS" in out and "other Metal allocations" in out and "No out-of-memory" not in out
    below = ISSUE_MPS.replace("17.35 GiB", "1.35 GiB")  # under the watermark: Metal itself refused
    assert diagnose(below).causes[0].kind == "mps_system"


def test_current_xpu_messages_are_recognised():
    d = diagnose(BY_ID["xpuops3157"]["text"])
    assert d.is_oom and d.message.format == "xpu" and d.message.free_bytes == parse_size("9.01GiB")
    assert d.causes[0].kind == "shortfall" and "larger than the whole GPU" in d.causes[0].text


def test_utf16_log_files_are_read(tmp_path, capsys):
    text = "Traceback (most recent call last):\r\n  File \"C:\\t.py\", line 1, in <module>\r\n    loss.backward()\r\n"
    log = tmp_path / "train.log"
    log.write_bytes(b"\xff\xfe" + (text + ISSUE_FRAG + "\r\n").encode("utf-16-le"))  # PowerShell 5 `>`
    assert main(["diagnose", str(log), "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["is_oom"] and out["phase"] == "backward" and out["tried_to_allocate_bytes"] == 158 * MiB
    assert diagnose(log).message.tried_to_allocate_bytes == 158 * MiB  # a Path
    assert diagnose(str(log)).phase == "backward"  # a str naming a file


def test_the_python_api_reads_a_log_path(tmp_path):
    log = tmp_path / "train.log"
    log.write_text("step 1\n" + ISSUE_SELF + "\n", encoding="utf-8")
    assert diagnose(str(log)).is_oom and diagnose(log).oom_count == 1
    with pytest.raises(MemfitError, match="does not exist"):
        diagnose(tmp_path / "missing.log")
    with pytest.raises(MemfitError, match="is a directory"):
        diagnose(tmp_path)
    assert not diagnose("no/such/file.log").is_oom  # a str that is no file is text


def test_a_message_wrapped_over_rank_prefixed_lines_keeps_its_figures():
    wrapped = ISSUE_SELF.replace("Process 105400 has ", "Process 105400 has\n").replace("Of the", "\nOf the")
    log = "\n".join("[rank3]: " + line for line in ("Traceback (most recent call last):", *wrapped.split("\n")))
    log = log.replace("[rank3]: Of the", "[rank0]: step 9 loss 1.2\n[rank3]: Of the")  # another rank interleaved
    m = parse_oom(log)
    assert m.other_processes == ((105400, parse_size("76.92GiB")),)
    assert m.allocated_bytes == parse_size("73.28GiB") and "step 9" not in m.raw and "[rank" not in m.raw
    assert any(c.kind == "self_pid" for c in diagnose(log).causes)


@pytest.mark.parametrize("name, phase", [("deepspeed_step.log", "optimizer"), ("deepspeed_backward.log", "backward")])
def test_deepspeed_tracebacks_give_the_phase(name, phase):
    d = diagnose((DATA / name).read_text(encoding="utf-8"))
    assert d.phase == phase and "deepspeed" in d.phase_frame


DS = "/usr/lib/python3/site-packages/deepspeed/runtime"


@pytest.mark.parametrize("frames, phase", [
    ([(f"{DS}/engine.py", "step"), (f"{DS}/engine.py", "_take_model_step"), (f"{DS}/zero/stage3.py", "step"),
      (f"{DS}/zero/stage3.py", "_optimizer_step")], "optimizer"),
    ([(f"{DS}/engine.py", "step"), (f"{DS}/zero/stage_1_and_2.py", "step"),
      (f"{DS}/zero/stage_1_and_2.py", "scaled_global_norm")], "optimizer"),
    ([("/x/deepspeed/ops/adam/fused_adam.py", "step")], "optimizer"),
    ([(f"{DS}/engine.py", "allreduce_gradients"), (f"{DS}/zero/stage_1_and_2.py", "reduce_gradients")], "backward"),
    ([(f"{DS}/zero/stage3.py", "reduce_partition_and_remove_grads")], "backward"),
])
def test_deepspeed_frames_without_source_lines(frames, phase):
    tb = "Traceback (most recent call last):\n" + "".join(f'  File "{f}", line 1, in {fn}\n' for f, fn in frames)
    assert detect_phase(tb)[0] == phase


def test_generic_advice_does_not_mention_xlnet():
    for case in CORPUS:
        assert "XLNet" not in " ".join(diagnose(case["text"]).advice)
    tb = ('Traceback (most recent call last):\n  File "/x/transformers/models/xlnet/modeling_xlnet.py", line 1, '
          "in forward\n    h = self.layer(h)\n" + BY_ID["cads4"]["text"])
    advice = " ".join(diagnose(tb).advice)
    assert "XLNet" in advice and "enable_checkpointing" in advice


def test_one_table_of_oom_fragments_for_detection_parsing_and_recovery():
    assert RECOVERY_FRAGMENTS is OOM_FRAGMENTS
    for case in CORPUS:
        found = find_ooms(case["text"])
        assert found  # parsing finds every corpus message ...
        certain = case["format"] != "cudnn_not_supported"
        assert is_oom_text(case["text"]) == certain  # ... and detection agrees with it
        assert is_oom_error(RuntimeError(case["text"])) == certain
    # texts the two lists used to disagree on
    assert is_oom_error(RuntimeError(BY_ID["papers10"]["text"]))  # Windows CPU allocator
    assert find_ooms("RuntimeError: XPU out of memory. Tried to allocate 2.00 GiB")
    assert find_ooms(ISSUE_MPS)
    assert not is_oom_error(RuntimeError("CUDNN_STATUS_NOT_SUPPORTED"))  # not certainly memory
    assert all(f.source for f in OOM_FRAGMENTS)


def test_plan_file_that_is_binary_is_a_one_line_error(tmp_path, capsys):
    log = tmp_path / "train.log"
    log.write_text(ISSUE_FRAG)
    plan = tmp_path / "binary.json"
    plan.write_bytes(bytes(range(256)))
    assert main(["diagnose", str(log), "--plan", str(plan)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "binary.json" in err and "not UTF-8 text" in err and "`" in err
    plan.write_text("{not json")
    assert main(["diagnose", str(log), "--plan", str(plan)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "not valid JSON" in err
    assert main(["diagnose", str(log), "--plan", str(tmp_path)]) == 2
    assert "directory" in capsys.readouterr().err


@pytest.mark.parametrize("cid", ["comfy7440", "xpuops3011", "ipex629", "pt175431", "therock4598", "quoted_self",
                                 "pt141909", "xpuops1598"])
def test_chinese_output_for_the_new_verdicts(cid, capsys):
    assert main(["diagnose", "--text", BY_ID[cid]["text"], "--lang", "zh"]) == 0
    out = capsys.readouterr().out
    assert sum("\u4e00" <= ch <= "\u9fff" for ch in out) > 40
    for key, row in MESSAGES.items():
        assert set(row) == set(LANGS), key


def test_chinese_strings_use_the_same_figures_as_english():
    import string

    fields = lambda text: {name for _, name, _, _ in string.Formatter().parse(text) if name}  # noqa: E731
    for key, row in MESSAGES.items():
        assert fields(row["zh"]) == fields(row["en"]), key


def test_gpu_from_message_takes_the_closest_card_and_names_the_others():
    from memfit.diagnosis import gpu_from_message
    from memfit.oom_text import find_ooms

    msg = ("torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total capacity of "
           "44.42 GiB of which 1.00 GiB is free. Of the allocated memory 40.00 GiB is allocated by PyTorch, and "
           "1.00 GiB is reserved by PyTorch but unallocated.")
    spec = gpu_from_message(find_ooms(msg)[0])
    assert spec.name == "L40S"  # 44.42 GiB exactly; L40 (44.40) and RTX 6000 Ada (44.43) are near too
    assert spec.total_bytes == find_ooms(msg)[0].total_bytes
    assert any("RTX-6000-Ada" in n and "L40" in n for n in spec.notes)
