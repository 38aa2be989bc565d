"""Find, parse and print PyTorch out-of-memory messages.

Every message format PyTorch has printed is recognised (sources cited next to each
pattern below); numbers come back in bytes. `format_oom_message` prints PyTorch's
current caching-allocator message from numbers, byte for byte, so the allocator model
can show what PyTorch would print.

Formats (``OomMessage.format``):

``legacy_cached``
    torch 1.0-1.3, aten/src/THC/THCCachingAllocator.cpp then c10/cuda/CUDACachingAllocator.cpp
    (pytorch/pytorch#13751): ``CUDA out of memory. Tried to allocate 12.50 MiB (GPU 0;
    10.92 GiB total capacity; 8.57 MiB already allocated; 9.28 GiB free; 4.68 MiB cached)``
``legacy_reserved``
    torch 1.4-2.0, c10/cuda/CUDACachingAllocator.cpp: ``... (GPU 0; 15.78 GiB total capacity;
    14.31 GiB already allocated; 2.75 MiB free; [14.60 GiB allowed; ]14.78 GiB reserved in
    total by PyTorch)`` and from 1.10 on the hint ``If reserved memory is >> allocated memory
    try setting max_split_size_mb to avoid fragmentation.``
``v2_1``
    torch 2.1, c10/cuda/CUDACachingAllocator.cpp after pytorch/pytorch#99699 (NVML process
    list): ``Tried to allocate 138.00 MiB. GPU 0 has a total capacty of 15.90 GiB`` (sic)
    ``of which 8.44 MiB is free. Process 1246069 has 577.00 MiB memory in use. Including
    non-PyTorch memory, this process has 15.32 GiB memory in use. Of the allocated memory
    14.12 GiB is allocated by PyTorch, and 410.41 MiB is reserved by PyTorch but
    unallocated. If reserved but unallocated memory is large try setting max_split_size_mb``
``current``
    torch >= 2.2, c10/cuda/CUDACachingAllocator.cpp ``DeviceCachingAllocator::malloc``,
    ``TORCH_CHECK_WITH(OutOfMemoryError, ...)``: ``total capacity of``, optional
    ``X allowed; `` and ``with C allocated in private pools (e.g., CUDA Graphs), ``, hint
    ``PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True``. Processes come in NVML order
    (``reportProcessMemoryInfo``), so ``this process`` may sit between other processes.
    When ``c10::DeviceIndex`` (int8) was streamed as a char, device 0 became a NUL that
    cut the message after ``GPU `` (pytorch/pytorch#123984, 2.3 nightlies); other
    devices printed a control character. Both parse, with ``device=None``.
``cuda_error``
    ``CUDA error: out of memory`` (``cudaErrorMemoryAllocation`` raised by
    ``C10_CUDA_CHECK`` outside the caching allocator; ``torch.AcceleratorError`` in 2.8+).
``cublas_alloc_failed`` / ``cudnn_alloc_failed``
    ``CUBLAS_STATUS_ALLOC_FAILED when calling `cublasCreate(handle)``` and ``cuDNN error:
    CUDNN_STATUS_ALLOC_FAILED``: the library could not get its workspace.
``cudnn_not_supported``
    ``cuDNN error: CUDNN_STATUS_NOT_SUPPORTED. This error may appear if you passed in a
    non-contiguous input.`` Often a batch too large for cuDNN's kernels; not always memory.
``cpu_allocator``
    c10/core/impl/alloc_cpu.cpp (pytorch/pytorch#20618): ``DefaultCPUAllocator: can't
    allocate memory: you tried to allocate 132426121216 bytes. Error code 12 (Cannot
    allocate memory)``; Windows: ``DefaultCPUAllocator: not enough memory: you tried to
    allocate N bytes.``; before 1.2 ``you tried to allocate 5GB. Buy new RAM!``.

``truncated``
    ``CUDA out of memory.`` with none of the figures (a logger or UI cut the message).

``HIP out of memory.`` (ROCm builds) parses like ``CUDA out of memory.``.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from memfit.units import GiB, format_size_torch, parse_size

__all__ = [
    "OomMessage",
    "FORMATS",
    "normalize_log",
    "parse_oom",
    "find_ooms",
    "format_oom_message",
]

FORMATS = (
    "legacy_cached",
    "legacy_reserved",
    "v2_1",
    "current",
    "cuda_error",
    "cublas_alloc_failed",
    "cudnn_alloc_failed",
    "cudnn_not_supported",
    "cpu_allocator",
    "truncated",
)

#: Formats that carry the caching allocator's numbers.
ALLOCATOR_FORMATS = ("legacy_cached", "legacy_reserved", "v2_1", "current")


@dataclass(frozen=True, slots=True)
class OomMessage:
    """One out-of-memory message; sizes in bytes, None where the message does not say.

    ``allocated_bytes`` is PyTorch's ``allocated_bytes`` statistic: the current format
    prints it plus ``private_pool_bytes``; this field has the private pools taken out
    again. ``reserved_bytes`` = allocated + private pools + reserved-but-unallocated.
    ``other_processes`` are ``(pid, bytes)`` as NVML reported them, in message order.
    ``raw`` is the message text (ANSI codes removed, whitespace collapsed);
    ``offset`` where it starts in `normalize_log` of the searched text.
    """

    format: str
    raw: str
    offset: int = 0
    device: int | None = None
    tried_to_allocate_bytes: int | None = None
    total_bytes: int | None = None
    free_bytes: int | None = None
    allocated_bytes: int | None = None
    reserved_bytes: int | None = None
    reserved_unallocated_bytes: int | None = None
    process_used_bytes: int | None = None
    other_processes: tuple[tuple[int, int], ...] = ()
    allowed_bytes: int | None = None
    private_pool_bytes: int = 0

    @property
    def has_numbers(self) -> bool:
        """True for the caching-allocator formats that report memory figures."""
        return self.format in ALLOCATOR_FORMATS and self.total_bytes is not None

    @property
    def non_pytorch_bytes(self) -> int | None:
        """Device memory outside this process's PyTorch cache: total - free - reserved.

        CUDA context, cuBLAS/cuDNN workspaces, NCCL buffers, other processes. Negative
        values (Windows WDDM spilling into shared system memory) are clamped to 0.
        """
        if self.total_bytes is None or self.free_bytes is None or self.reserved_bytes is None:
            return None
        return max(0, self.total_bytes - self.free_bytes - self.reserved_bytes)


# --------------------------------------------------------------------------- text clean-up

_ANSI_RE = re.compile(r"\x1b\[[0-?]*[ -/]*[@-~]|\x1b\][^\x07\x1b]*(?:\x07|\x1b\\)|\x1b[@-Z\\-_]")


def normalize_log(text: str) -> str:
    """Remove ANSI colour codes; turn Windows (CRLF) and tqdm (CR) line ends into LF."""
    text = _ANSI_RE.sub("", text)
    return text.replace("\r\n", "\n").replace("\r", "\n")


# --------------------------------------------------------------------------- patterns

_NUM = r"\d+(?:\.\d+)?"
_UNIT = r"(?:bytes|B|KiB|MiB|GiB|TiB)"
_SIZE = rf"({_NUM}\s?{_UNIT})\b"

# Where a message starts. Alternation order matters: the longest form wins at a position.
_ANCHOR_RE = re.compile(
    r"(?P<alloc>(?:CUDA|HIP) out of memory\.(?:\s*Tried to allocate)?)"
    # legacy text quoted without its first sentence: "Tried to allocate 20.00 MiB (GPU 0; ..."
    rf"|(?P<alloc_bare>Tried to allocate {_NUM} ?{_UNIT} \(GPU)"
    r"|(?P<cuda_error>CUDA error: out of memory)"
    r"|(?P<cublas>CUBLAS_STATUS_ALLOC_FAILED)"
    r"|(?P<cudnn_alloc>CUDNN_STATUS_ALLOC_FAILED)"
    r"|(?P<cudnn_ns>CUDNN_STATUS_NOT_SUPPORTED)"
    r"|(?P<cpu>DefaultCPUAllocator: (?:can't allocate memory|not enough memory))",
)
# A message ends at a blank line, the next traceback or frame, or a chained exception.
_END_RE = re.compile(r"\n\s*\n|\nTraceback \(most recent call last\)|\n\s*File \"|\nDuring handling")
# ... or, once collapsed, after its last sentence.
_TAIL_RE = re.compile(
    r"reserved by PyTorch but unallocated\.|reserved in total by PyTorch\)?|cached\)"
    r"|GPU [^\sA-Za-z]?\s*$",  # message cut at the device index (pytorch#123984)
    re.IGNORECASE,
)
_HINT_RE = re.compile(
    r"\s*If reserved (?:but unallocated )?memory is .*?(?:Memory Management"
    r"(?:\s*\(https?://[^\s)]*\)|\s+and PYTORCH_CUDA_ALLOC_CONF\.?)?|$)",
    re.IGNORECASE,
)
_WINDOW_CHARS = 2000

_F = {
    "tried": re.compile(rf"Tried to allocate {_SIZE}", re.I),
    "dev_legacy": re.compile(r"\(GPU ([^;)]*)[;)]", re.I),
    "dev_current": re.compile(r"GPU (\S*)\s*has a total capac", re.I),
    "total_legacy": re.compile(rf"{_SIZE} total capacity", re.I),
    "total_current": re.compile(rf"total capaci?ty of {_SIZE}", re.I),
    "free_legacy": re.compile(rf"{_SIZE} free\s*[;)]", re.I),
    "free_current": re.compile(rf"of which {_SIZE} is free", re.I),
    "alloc_legacy": re.compile(rf"{_SIZE} already allocated", re.I),
    "alloc_current": re.compile(rf"Of the allocated memory {_SIZE} is allocated by PyTorch", re.I),
    "reserved_legacy": re.compile(rf"{_SIZE} reserved in total by PyTorch", re.I),
    "cached_legacy": re.compile(rf"{_SIZE} cached", re.I),
    "unalloc": re.compile(rf"and {_SIZE} is reserved by PyTorch but unallocated", re.I),
    "private": re.compile(rf"with {_SIZE} allocated in private pools", re.I),
    "allowed": re.compile(rf"{_SIZE} allowed;", re.I),
    "this_process": re.compile(rf"this process has {_SIZE} memory in use", re.I),
    "process": re.compile(rf"Process (\d+) has {_SIZE} memory in use", re.I),
    "cpu_bytes": re.compile(r"you tried to allocate (\d+)\s*(bytes|GB)", re.I),
}


def _size(m: re.Match[str] | None, group: int = 1) -> int | None:
    if m is None:
        return None
    return parse_size(m.group(group).replace(" ", ""))


def _device(text: str | None) -> int | None:
    if text is None:
        return None
    text = text.strip()
    return int(text) if text.isdigit() else None


# --------------------------------------------------------------------------- parsing


def _parse_allocator(window: str, offset: int) -> OomMessage:
    """Parse a caching-allocator message (any of the four allocator formats)."""
    text = " ".join(window.split())
    tail = _TAIL_RE.search(text)
    if tail:
        hint = _HINT_RE.match(text, tail.end())
        text = text[: hint.end() if hint else tail.end()]
    tried = _size(_F["tried"].search(text))
    if _F["total_current"].search(text) or re.search(r"\. GPU", text):
        fmt = "v2_1" if re.search(r"total capacty", text, re.I) else "current"
        if fmt == "current" and re.search(r"max_split_size_mb", text) and not re.search(r"expandable", text):
            fmt = "v2_1"  # 2.1 builds with the typo fixed but still the old hint
        dev_m = _F["dev_current"].search(text)
        device = _device(dev_m.group(1)) if dev_m else None
        total = _size(_F["total_current"].search(text))
        free = _size(_F["free_current"].search(text))
        printed_alloc = _size(_F["alloc_current"].search(text))
        unalloc = _size(_F["unalloc"].search(text))
        private = _size(_F["private"].search(text)) or 0
        allocated = None if printed_alloc is None else max(0, printed_alloc - private)
        reserved = None
        if printed_alloc is not None and unalloc is not None:
            reserved = printed_alloc + unalloc
        this = _size(_F["this_process"].search(text))
        others = tuple(
            (int(m.group(1)), parse_size(m.group(2).replace(" ", "")))
            for m in _F["process"].finditer(text)
        )
    elif not re.search(r"\(GPU", text):
        return OomMessage(format="truncated", raw=text, offset=offset, tried_to_allocate_bytes=tried)
    else:
        cached = _F["reserved_legacy"].search(text) is None and _F["cached_legacy"].search(text)
        fmt = "legacy_cached" if cached else "legacy_reserved"
        dev_m = _F["dev_legacy"].search(text)
        device = _device(dev_m.group(1)) if dev_m else None
        total = _size(_F["total_legacy"].search(text))
        free = _size(_F["free_legacy"].search(text))
        allocated = _size(_F["alloc_legacy"].search(text))
        reserved = _size(_F["cached_legacy" if cached else "reserved_legacy"].search(text))
        if cached and reserved is not None and allocated is not None:
            # torch <= 1.3 printed the *cached but unused* bytes, not the whole cache.
            unalloc, reserved = reserved, allocated + reserved
        else:
            unalloc = None if reserved is None or allocated is None else max(0, reserved - allocated)
        private, this, others = 0, None, ()
    return OomMessage(
        format=fmt,
        raw=text,
        offset=offset,
        device=device,
        tried_to_allocate_bytes=tried,
        total_bytes=total,
        free_bytes=free,
        allocated_bytes=allocated,
        reserved_bytes=reserved,
        reserved_unallocated_bytes=unalloc,
        process_used_bytes=this,
        other_processes=others,
        allowed_bytes=_size(_F["allowed"].search(text)),
        private_pool_bytes=private,
    )


def _line_around(text: str, start: int, end: int) -> str:
    lo = text.rfind("\n", 0, start) + 1
    hi = text.find("\n", end)
    return " ".join(text[lo : len(text) if hi < 0 else hi].split())


def _parse_at(text: str, m: re.Match[str], limit: int) -> OomMessage:
    kind = m.lastgroup
    start = m.start()
    window = text[start:limit]
    end = _END_RE.search(window)
    if end:
        window = window[: end.start()]
    if kind in ("alloc", "alloc_bare"):
        return _parse_allocator(window, start)
    raw = _line_around(text, start, m.end())
    if kind == "cpu":
        cm = _F["cpu_bytes"].search(window)
        n = None
        if cm:
            n = int(cm.group(1)) * (GiB if cm.group(2).upper() == "GB" else 1)
        return OomMessage(format="cpu_allocator", raw=raw, offset=start, tried_to_allocate_bytes=n)
    fmt = {
        "cuda_error": "cuda_error",
        "cublas": "cublas_alloc_failed",
        "cudnn_alloc": "cudnn_alloc_failed",
        "cudnn_ns": "cudnn_not_supported",
    }[kind or ""]
    return OomMessage(format=fmt, raw=raw, offset=start)


def find_ooms(log_text: str) -> list[OomMessage]:
    """Every out-of-memory message in a whole log or traceback, in order of appearance.

    ANSI colours and CR/CRLF line ends are removed first (`normalize_log`); offsets refer
    to that normalized text. A message wrapped over several lines is joined. The same
    exception printed twice (e.g. once by a logger, once in the traceback) counts twice.
    """
    text = normalize_log(log_text)
    matches = list(_ANCHOR_RE.finditer(text))
    found = []
    for i, m in enumerate(matches):
        limit = matches[i + 1].start() if i + 1 < len(matches) else len(text)
        limit = min(limit, m.start() + _WINDOW_CHARS)
        found.append(_parse_at(text, m, limit))
    return found


def parse_oom(text: str) -> OomMessage | None:
    """The last out-of-memory message in `text` (a message, traceback or log), or None."""
    found = find_ooms(text)
    return found[-1] if found else None


# --------------------------------------------------------------------------- formatting


def format_oom_message(
    *,
    device: int,
    tried_to_allocate_bytes: int,
    total_bytes: int,
    free_bytes: int,
    process_used_bytes: int | None,
    allocated_bytes: int,
    reserved_unallocated_bytes: int,
    other_processes: tuple[tuple[int, int], ...] | list[tuple[int, int]] = (),
    allowed_bytes: int | None = None,
    private_pool_bytes: int = 0,
) -> str:
    """PyTorch's current OOM message, exactly as ``DeviceCachingAllocator::malloc`` prints it.

    Source: c10/cuda/CUDACachingAllocator.cpp (torch >= 2.2; text verified at
    pytorch/pytorch 001074d2), ``TORCH_CHECK_WITH(OutOfMemoryError, ...)``.
    ``allocated_bytes`` is the allocator's ``allocated_bytes`` stat; like PyTorch the
    message prints it plus ``private_pool_bytes``. ``reserved_unallocated_bytes`` is
    ``reserved - allocated - private pools``. ``other_processes`` (pid, bytes) are printed
    first, then this process (``reportProcessMemoryInfo`` prints NVML's order; pass
    ``process_used_bytes=None`` and no others to mimic a build without NVML).
    The exception's ``str()`` is this text; tracebacks prefix ``torch.OutOfMemoryError: ``.
    """
    fs = format_size_torch
    proc_info = "".join(f"Process {pid} has {fs(int(b))} memory in use. " for pid, b in other_processes)
    if process_used_bytes is not None:
        proc_info += f"Including non-PyTorch memory, this process has {fs(process_used_bytes)} memory in use. "
    allowed_info = f"{fs(allowed_bytes)} allowed; " if allowed_bytes is not None else ""
    private_msg = (
        f"with {fs(private_pool_bytes)} allocated in private pools (e.g., CUDA Graphs), "
        if private_pool_bytes > 0
        else ""
    )
    return (
        f"CUDA out of memory. Tried to allocate {fs(tried_to_allocate_bytes)}. GPU {int(device)} "
        f"has a total capacity of {fs(total_bytes)} of which {fs(free_bytes)} is free. "
        f"{proc_info}{allowed_info}"
        f"Of the allocated memory {fs(allocated_bytes + private_pool_bytes)} is allocated by PyTorch, "
        f"{private_msg}and {fs(reserved_unallocated_bytes)} is reserved by PyTorch but unallocated."
        " If reserved but unallocated memory is large try setting"
        " PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True to avoid"
        " fragmentation.  See documentation for Memory Management "
        " (https://pytorch.org/docs/stable/notes/cuda.html#environment-variables)"
    )
