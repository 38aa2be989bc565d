"""Parsing real OOM messages (tests/data/oom/corpus.json), whole logs, and the formatter."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from helpers import DATA_DIR
from memfit.oom_text import (
    BACKENDS,
    FORMATS,
    OOM_FRAGMENTS,
    decode_log,
    find_ooms,
    format_oom_message,
    is_oom_text,
    normalize_log,
    parse_oom,
)
from memfit.units import GiB, KiB, MiB, parse_size

DATA = DATA_DIR / "oom"
CORPUS = json.loads((DATA / "corpus.json").read_text(encoding="utf-8"))


def _b(size: str) -> int:
    return parse_size(size.replace(" ", ""))


def test_corpus_is_large_and_covers_every_format_and_unit():
    assert len(CORPUS) >= 20
    assert all(case["source"] for case in CORPUS)
    assert {c["format"] for c in CORPUS} == set(FORMATS) - {"truncated"}
    units = " ".join(v for c in CORPUS for v in c["expect"].values() if isinstance(v, str))
    for unit in ("bytes", "KiB", "MiB", "GiB"):
        assert unit in units


@pytest.mark.parametrize("case", CORPUS, ids=[c["id"] for c in CORPUS])
def test_corpus_message_parses_to_its_printed_numbers(case):
    m = parse_oom(case["text"])
    assert m is not None
    assert m.format == case["format"]
    e = case["expect"]
    assert m.device == e.get("device")
    if "tried" in e:
        assert m.tried_to_allocate_bytes == _b(e["tried"])
    for key, field in (("total", "total_bytes"), ("free", "free_bytes"), ("allowed", "allowed_bytes"),
                       ("process", "process_used_bytes"), ("unalloc", "reserved_unallocated_bytes")):
        if key == "unalloc" and "reserved" in e:
            continue  # derived below
        assert getattr(m, field) == (_b(e[key]) if key in e else None), key
    private = _b(e.get("private", "0 bytes"))
    assert m.private_pool_bytes == private
    if "printed_allocated" in e:
        assert m.allocated_bytes == _b(e["printed_allocated"]) - private
    elif "allocated" in e:
        assert m.allocated_bytes == _b(e["allocated"])
    if "reserved" in e:  # legacy: printed; unallocated derived
        assert m.reserved_bytes == _b(e["reserved"])
        assert m.reserved_unallocated_bytes == max(0, _b(e["reserved"]) - _b(e["allocated"]))
    elif "unalloc" in e and m.allocated_bytes is not None:  # current: reserved derived
        assert m.reserved_bytes == m.allocated_bytes + private + _b(e["unalloc"])
    assert m.other_processes == tuple((pid, _b(s)) for pid, s in e.get("others", []))
    assert m.backend == e["backend"] and (m.backend is None or m.backend in BACKENDS)
    if "mps_allocated" in e:
        assert m.reserved_bytes == _b(e["mps_allocated"]) and m.allocated_bytes is None
    assert m.other_allocations_bytes == (_b(e["other_allocations"]) if "other_allocations" in e else None)
    assert len(find_ooms(case["text"])) == 1
    assert "\n" not in m.raw and "[rank" not in m.raw


def test_seed_message_numbers():
    m = parse_oom("CUDA out of memory. Tried to allocate 2.00 MiB (GPU 0; 15.78 GiB total capacity; "
                  "14.31 GiB already allocated; 2.75 MiB free; 14.78 GiB reserved in total by PyTorch)")
    assert m.format == "legacy_reserved"
    assert m.reserved_unallocated_bytes == _b("14.78GiB") - _b("14.31GiB")
    assert abs(m.non_pytorch_bytes / GiB - (15.78 - 14.78 - 2.75 / 1024)) < 0.001


def test_units_including_tib_and_bytes():
    m = parse_oom("CUDA out of memory. Tried to allocate 512 bytes (GPU 3; 1.50 TiB total capacity; "
                  "1.00 KiB already allocated; 1024 bytes free; 2.00 KiB reserved in total by PyTorch)")
    assert (m.device, m.tried_to_allocate_bytes, m.total_bytes) == (3, 512, int(1.5 * 1024 * GiB))
    assert (m.allocated_bytes, m.free_bytes, m.reserved_bytes) == (KiB, 1024, 2 * KiB)


def test_message_without_figures_is_truncated_format():
    m = parse_oom("ERROR: CUDA out of memory.")
    assert m.format == "truncated" and m.tried_to_allocate_bytes is None


# ------------------------------------------------------------------ whole logs


def _seed(n: int) -> str:
    return (f"torch.OutOfMemoryError: CUDA out of memory. Tried to allocate {n}.00 MiB. GPU 0 has a total "
            "capacity of 23.55 GiB of which 20.00 MiB is free. Of the allocated memory 22.00 GiB is allocated "
            "by PyTorch, and 1.00 GiB is reserved by PyTorch but unallocated.")


def test_long_log_with_ansi_crlf_and_several_errors_takes_the_last():
    lines = [f"\x1b[32m{i:5d}/9000\x1b[0m [00:{i % 60:02d}<00:10, 1.5it/s] loss=2.{i % 10}" for i in range(3000)]
    lines[1000] = "\x1b[31m" + _seed(10) + "\x1b[0m"
    lines[2000] = "RuntimeError: CUDA error: CUBLAS_STATUS_ALLOC_FAILED when calling `cublasCreate(handle)`"
    lines[2990] = "\x1b[1;31m" + _seed(30) + "\x1b[0m"
    log = "\r\n".join(lines) + "\r\n"
    found = find_ooms(log)
    assert [m.format for m in found] == ["current", "cublas_alloc_failed", "current"]
    last = parse_oom(log)
    assert last.tried_to_allocate_bytes == 30 * MiB and last.free_bytes == 20 * MiB
    assert "\x1b" not in last.raw and "\r" not in last.raw
    assert "loss=" not in last.raw  # the next log line is not part of the message


def test_tqdm_carriage_returns_are_line_breaks():
    log = "10%|█         | 1/10\r20%|██        | 2/10\r" + _seed(5) + "\r\n"
    assert normalize_log(log).count("\n") == 3
    assert parse_oom(log).tried_to_allocate_bytes == 5 * MiB


def test_no_oom_in_ordinary_text():
    assert find_ooms("epoch 1 done\nTried to allocate 3 chairs, but only 2 were available\n") == []
    assert parse_oom("") is None


# ------------------------------------------------------------------ formatter


def test_format_matches_pytorch_source_text_exactly():
    text = format_oom_message(device=0, tried_to_allocate_bytes=22 * MiB, total_bytes=int(23.65 * GiB),
                              free_bytes=int(11.06 * MiB), process_used_bytes=int(23.60 * GiB),
                              allocated_bytes=int(22.90 * GiB), reserved_unallocated_bytes=int(194.87 * MiB))
    expected = next(c["text"] for c in CORPUS if c["id"] == "pt16417c")
    assert "torch.cuda.OutOfMemoryError: " + text == expected


def test_format_private_pools_allowed_and_other_processes():
    text = format_oom_message(device=1, tried_to_allocate_bytes=546 * MiB, total_bytes=16 * GiB,
                              free_bytes=514 * MiB, process_used_bytes=None, allocated_bytes=13 * GiB,
                              reserved_unallocated_bytes=700 * MiB, other_processes=[(562167, 15 * GiB)],
                              allowed_bytes=15 * GiB, private_pool_bytes=46 * MiB)
    assert ("GPU 1 has a total capacity of 16.00 GiB of which 514.00 MiB is free. Process 562167 has 15.00 GiB "
            "memory in use. 15.00 GiB allowed; Of the allocated memory 13.04 GiB is allocated by PyTorch, with "
            "46.00 MiB allocated in private pools (e.g., CUDA Graphs), and 700.00 MiB is reserved") in text
    assert "this process" not in text


def _tol(n: int) -> float:
    """Half a unit in the second decimal of PyTorch's format_size for a value of n bytes."""
    if n <= 1024:
        return 0
    scale = KiB if n <= MiB else MiB if n <= GiB else GiB
    return 0.005 * scale + 1


_sizes = st.integers(min_value=0, max_value=200 * GiB)


@settings(max_examples=300, deadline=None)
@given(device=st.integers(0, 15), tried=_sizes, total=_sizes, free=_sizes, proc=st.none() | _sizes,
       alloc=_sizes, unalloc=_sizes, private=_sizes, allowed=st.none() | _sizes,
       others=st.lists(st.tuples(st.integers(1, 4_000_000), _sizes), max_size=3))
def test_formatted_messages_parse_back(device, tried, total, free, proc, alloc, unalloc, private, allowed, others):
    text = format_oom_message(device=device, tried_to_allocate_bytes=tried, total_bytes=total, free_bytes=free,
                              process_used_bytes=proc, allocated_bytes=alloc, reserved_unallocated_bytes=unalloc,
                              other_processes=others, allowed_bytes=allowed, private_pool_bytes=private)
    m = parse_oom("torch.OutOfMemoryError: " + text)
    assert m.format == "current" and m.device == device
    for got, want in ((m.tried_to_allocate_bytes, tried), (m.total_bytes, total), (m.free_bytes, free),
                      (m.reserved_unallocated_bytes, unalloc)):
        assert abs(got - want) <= _tol(want)
    assert (m.process_used_bytes is None) == (proc is None)
    if proc is not None:
        assert abs(m.process_used_bytes - proc) <= _tol(proc)
    assert (m.allowed_bytes is None) == (allowed is None)
    if allowed is not None:
        assert abs(m.allowed_bytes - allowed) <= _tol(allowed)
    assert abs(m.private_pool_bytes - private) <= _tol(private)
    assert abs(m.allocated_bytes - alloc) <= _tol(alloc + private) + _tol(private) if private else \
        abs(m.allocated_bytes - alloc) <= _tol(alloc)
    assert [pid for pid, _ in m.other_processes] == [pid for pid, _ in others]
    for (_, got), (_, want) in zip(m.other_processes, others):
        assert abs(got - want) <= _tol(want)


@settings(max_examples=300, deadline=None)
@given(st.text())
def test_arbitrary_text_never_crashes(text):
    for m in find_ooms(text):
        assert m.format in FORMATS


@settings(max_examples=200, deadline=None)
@given(st.lists(st.sampled_from([
    "CUDA out of memory.", " Tried to allocate ", "2.00", " MiB", " (GPU ", "0", "; ", "GPU ", " has a total capacity of ",
    " of which ", " is free. ", "Process ", "12", " has ", " memory in use. ", "\n", "\r\n", "\x1b[31m", "0 bytes",
    " reserved in total by PyTorch)", "CUDA error: out of memory", "CUBLAS_STATUS_ALLOC_FAILED", "cached)",
    "DefaultCPUAllocator: can't allocate memory: you tried to allocate ", "99 bytes", " allowed; ", "\x00"]),
    max_size=40))
def test_fragments_of_messages_never_crash(parts):
    for m in find_ooms("".join(parts)):
        assert m.format in FORMATS


# ------------------------------------------------------------------ backends, launchers, encodings


def test_mps_sizes_before_torch_2_2_are_binary():
    m = parse_oom("RuntimeError: MPS backend out of memory (MPS allocated: 5.56 GB, other allocations: 1.10 GB, "
                  "max allowed: 6.80 GB). Tried to allocate 768.00 MB on private pool. Use "
                  "PYTORCH_MPS_HIGH_WATERMARK_RATIO=0.0")  # Comfy-Org/ComfyUI#2489
    assert (m.format, m.backend) == ("mps", "mps")
    assert m.tried_to_allocate_bytes == 768 * MiB and m.reserved_bytes == _b("5.56GiB")
    assert m.total_bytes is None and m.free_bytes is None  # not printed: unknown
    assert m.raw.endswith("on private pool.")


def test_mps_without_the_watermark_has_no_allowed_figure():
    m = parse_oom("MPS backend out of memory (MPS allocated: 1.00 GiB, other allocations: 2.00 MiB). Tried to "
                  "allocate 3.00 GiB on shared pool.")  # MPSAllocator.mm, PYTORCH_MPS_HIGH_WATERMARK_RATIO=0.0
    assert m.allowed_bytes is None and m.other_allocations_bytes == 2 * MiB and m.tried_to_allocate_bytes == 3 * GiB


def test_xpu_hint_is_kept_out_of_the_figures():
    m = parse_oom("torch.OutOfMemoryError: XPU out of memory. Tried to allocate 20.00 MiB. GPU 0 has a total capacity "
                  "of 11.93 GiB of which 5.62 MiB is free. Of the allocated memory 10.43 GiB is allocated by PyTorch, "
                  "and 94.57 MiB is reserved by PyTorch but unallocated. Please use `empty_cache` to release all "
                  "unoccupied cached memory.\nnext log line 1.5 GiB")
    assert m.format == "xpu" and m.free_bytes == _b("5.62MiB") and m.raw.endswith("cached memory.")


def test_launcher_prefixes_are_removed_and_other_ranks_left_out():
    assert normalize_log("[rank0]: a\n[default3]:b\n[rank12]:  File x") == "a\nb\n File x"
    log = ("[rank0]: torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total\n"
           "[rank1]: capacity of 9.00 GiB and so on\n"
           "[rank0]: capacity of 79.15 GiB of which 1.00 GiB is free. Of the allocated memory 70.00 GiB is allocated\n"
           "[rank0]: by PyTorch, and 1.00 GiB is reserved by PyTorch but unallocated.")
    m = parse_oom(log)
    assert m.total_bytes == _b("79.15GiB") and m.reserved_unallocated_bytes == GiB and "9.00" not in m.raw


@pytest.mark.parametrize("encoding, bom", [("utf-16-le", b"\xff\xfe"), ("utf-16-be", b"\xfe\xff"),
                                           ("utf-8", b"\xef\xbb\xbf"), ("utf-16-le", b""), ("utf-8", b"")])
def test_decode_log_reads_what_windows_and_linux_write(encoding, bom):
    text = "Schritt 1 – ok\r\n" + _seed(7) + "\r\n"
    decoded = decode_log(bom + text.encode(encoding))
    assert decoded == text
    assert parse_oom(decoded).tried_to_allocate_bytes == 7 * MiB


def test_decode_log_replaces_undecodable_bytes():
    assert decode_log(b"ok \xc3\x28 tail") == "ok \ufffd( tail"
    assert decode_log(b"") == ""


def test_fragment_table_drives_detection():
    assert {f.kind for f in OOM_FRAGMENTS} >= {"alloc", "mps", "cuda_error", "cpu", "xpu_runtime"}
    for f in OOM_FRAGMENTS:
        sample = f.text if not f.pattern or f.kind != "alloc_bare" else "Tried to allocate 2.00 MiB (GPU 0; 1 GiB"
        assert is_oom_text("RuntimeError: " + sample) == f.certain, f.text
        assert find_ooms("RuntimeError: " + sample), f.text
    assert not is_oom_text("epoch 3: loss 0.1, memory 1.2 GiB")
