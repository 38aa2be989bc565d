"""Find, parse and print PyTorch out-of-memory messages.

Every message format PyTorch (and the libraries under it) has printed is recognised,
CUDA, ROCm (HIP), Intel XPU, Apple MPS and the CPU allocator; sources are cited next to
each pattern. `OOM_FRAGMENTS` is the one table of the texts that mark an out-of-memory
error: `is_oom_text` (used by memfit.fit's recovery) and `find_ooms` (used by
`memfit diagnose`) both read it. Numbers come back in bytes; a figure a message does not
print is None, never 0. `format_oom_message` prints PyTorch's current caching-allocator
message from numbers, byte for byte, so the allocator model can show what PyTorch would
print.

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
    devices printed a control character. Both parse, with ``device=None``. ROCm builds
    print the same text hipified: ``HIP out of memory.``, ``(e.g., HIP Graphs)``,
    ``PYTORCH_HIP_ALLOC_CONF`` (backend ``rocm``).
``xpu``
    c10/xpu/XPUCachingAllocator.cpp ``DeviceCachingAllocator::malloc``: ``XPU out of memory.
    Tried to allocate X. GPU 0 has a total capacity of T of which F is free. [A allowed; ]Of
    the allocated memory ... is reserved by PyTorch but unallocated. Please use `empty_cache`
    to release all unoccupied cached memory.`` When the SYCL runtime lacks the
    ``ext_intel_free_memory`` aspect the printed free figure is PyTorch's estimate
    ``total - reserved``, not a measurement (same function).
``xpu_no_free``
    The same file before the free figure was printed: ``... GPU 0 has a total capacity of
    15.11 GiB. Of the allocated memory ...`` (intel/intel-extension-for-pytorch#846, #863).
``ipex_legacy``
    intel-extension-for-pytorch's allocator, legacy layout without a free figure: ``XPU out
    of memory. Tried to allocate 1.71 GiB (GPU 0; 15.56 GiB total capacity; 0 bytes already
    allocated; 0 bytes reserved in total by PyTorch)`` (intel/intel-extension-for-pytorch#629).
``ipex_4gb``
    The same allocator refusing one block above the device's single-allocation limit:
    ``Current platform can NOT allocate memory block with size larger than 4GB! Tried to
    allocate 6.85 GiB (GPU  0; 15.56 GiB total capacity; ...)`` (ibid.).
``mps``
    aten/src/ATen/mps/MPSAllocator.mm ``MPSHeapAllocatorImpl::alloc_buffer_block``: ``MPS
    backend out of memory (MPS allocated: A, other allocations: O[, max allowed: L]). Tried
    to allocate X on private pool.`` ``MPS allocated`` is the allocator's heaps (what it
    holds, like the CUDA cache), ``other allocations`` the rest of what Metal holds for the
    process (``current_allocated_size() - m_total_allocated_memory``; MPSAllocator.h:
    "implicit allocations from MPS/MPSGraph frameworks"), ``max allowed`` the high
    watermark (PYTORCH_MPS_HIGH_WATERMARK_RATIO x recommendedMaxWorkingSetSize, default
    ratio 1.7); it is printed only when the watermark is on. Up to torch 2.1 the allocator's
    own ``format_size`` printed ``KB``/``MB``/``GB`` for binary units (1024-based).
``mps_buffer_size``
    The same function, ``TORCH_CHECK(size < m_max_buffer_size, "Invalid buffer size: ", ...)``:
    one buffer above Metal's ``maxBufferLength``.
``cuda_error``
    ``CUDA error: out of memory`` (``cudaErrorMemoryAllocation`` raised by
    ``C10_CUDA_CHECK`` outside the caching allocator; ``torch.AcceleratorError`` in 2.8+),
    ROCm's ``HIP error: out of memory``, and torch <= 1.0's ``cuda runtime error (2) : out
    of memory`` (THCudaCheck, jiesutd/NCRFpp#121).
``xpu_runtime_error``
    ``Native API failed. Native API returns: 39 (UR_RESULT_ERROR_OUT_OF_DEVICE_MEMORY)``: the
    Level Zero runtime outside PyTorch's allocator (intel/torch-xpu-ops#1598, pytorch#177714).
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
    ``CUDA out of memory.`` (or HIP/XPU) with none of the figures (a logger or UI cut it).

Logs: `decode_log` reads bytes in any encoding a training log comes in (UTF-8, and the
UTF-16 with BOM that Windows PowerShell's ``>`` and ``Tee-Object`` write);
`normalize_log` removes ANSI colours, CR/CRLF line ends and the per-line prefixes of
distributed launchers (``[rank3]: `` from torch.distributed's excepthook,
``[default0]:`` from torchrun's log tee), so a message wrapped over prefixed lines
keeps its figures.
"""

from __future__ import annotations

import bisect
import codecs
import re
from dataclasses import dataclass

from memfit.units import GiB, format_size_torch, parse_size

__all__ = [
    "OomMessage",
    "OomFragment",
    "OOM_FRAGMENTS",
    "FORMATS",
    "BACKENDS",
    "is_oom_text",
    "decode_log",
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
    "xpu",
    "xpu_no_free",
    "ipex_legacy",
    "ipex_4gb",
    "mps",
    "mps_buffer_size",
    "cuda_error",
    "xpu_runtime_error",
    "cublas_alloc_failed",
    "cudnn_alloc_failed",
    "cudnn_not_supported",
    "cpu_allocator",
    "truncated",
)

#: Formats of a caching allocator (CUDA, HIP, XPU) that report device figures.
ALLOCATOR_FORMATS = ("legacy_cached", "legacy_reserved", "v2_1", "current", "xpu", "xpu_no_free",
                     "ipex_legacy", "ipex_4gb")

BACKENDS = ("cuda", "rocm", "xpu", "mps", "cpu")

_NUM = r"\d+(?:\.\d+)?"
_UNIT = r"(?:bytes|B|KiB|MiB|GiB|TiB|KB|MB|GB)"
_SIZE = rf"({_NUM}\s?{_UNIT})\b"


@dataclass(frozen=True, slots=True)
class OomFragment:
    """One text that marks an out-of-memory error, as the library prints it.

    ``kind`` names the parser that reads the message from there, ``backend`` the device
    family the text belongs to (None: the text alone does not say), ``certain`` whether the
    text always means memory ran out (memfit.fit's recovery acts only on those), ``source``
    where it is printed. ``pattern`` is the anchor regex when it is more than the literal text.
    """

    text: str
    kind: str
    backend: str | None
    certain: bool
    source: str
    pattern: str = ""

    @property
    def regex(self) -> str:
        return self.pattern or re.escape(self.text)


#: The one table of out-of-memory texts. Order matters only where two start at one position.
OOM_FRAGMENTS: tuple[OomFragment, ...] = (
    OomFragment("CUDA out of memory", "alloc", "cuda", True,
                "c10/cuda/CUDACachingAllocator.cpp DeviceCachingAllocator::malloc; THCCachingAllocator.cpp (<= 1.0)",
                r"CUDA out of memory\.?(?:\s*Tried to allocate)?"),
    OomFragment("HIP out of memory", "alloc", "rocm", True,
                "the same allocator hipified in ROCm builds (c10/hip/HIPCachingAllocator.cpp)",
                r"HIP out of memory\.?(?:\s*Tried to allocate)?"),
    OomFragment("XPU out of memory", "alloc", "xpu", True,
                "c10/xpu/XPUCachingAllocator.cpp DeviceCachingAllocator::malloc; intel-extension-for-pytorch",
                r"XPU out of memory\.?(?:\s*Tried to allocate)?"),
    OomFragment("Current platform can NOT allocate memory block with size larger than 4GB", "ipex_4gb", "xpu", True,
                "intel-extension-for-pytorch's allocator (intel/intel-extension-for-pytorch#629)",
                r"Current platform can NOT allocate memory block with size larger than 4GB!?(?:\s*Tried to allocate)?"),
    # A legacy message quoted without its first sentence: "Tried to allocate 20.00 MiB (GPU 0; ..."
    OomFragment("Tried to allocate", "alloc_bare", None, True,
                "c10/cuda/CUDACachingAllocator.cpp (torch <= 2.0), quoted without `CUDA out of memory.`",
                rf"Tried to allocate {_NUM} ?{_UNIT} \(GPU"),
    OomFragment("MPS backend out of memory", "mps", "mps", True,
                "aten/src/ATen/mps/MPSAllocator.mm MPSHeapAllocatorImpl::alloc_buffer_block"),
    OomFragment("Invalid buffer size:", "mps_buffer", "mps", True,
                "aten/src/ATen/mps/MPSAllocator.mm alloc_buffer_block: size >= maxBufferLength"),
    OomFragment("CUDA error: out of memory", "cuda_error", "cuda", True,
                "c10/cuda/CUDAException.cpp c10_cuda_check_implementation (cudaErrorMemoryAllocation)"),
    OomFragment("HIP error: out of memory", "cuda_error", "rocm", True,
                "the same check hipified (hipErrorOutOfMemory)"),
    OomFragment("cuda runtime error (2) : out of memory", "cuda_error", "cuda", True,
                "THCudaCheck in torch <= 1.0 (jiesutd/NCRFpp#121)"),
    OomFragment("UR_RESULT_ERROR_OUT_OF_DEVICE_MEMORY", "xpu_runtime", "xpu", True,
                "the Level Zero adapter of the Unified Runtime (intel/torch-xpu-ops#1598)"),
    OomFragment("CUBLAS_STATUS_ALLOC_FAILED", "cublas", "cuda", True,
                "at::cuda::getCurrentCUDABlasHandle: cublasCreate could not allocate"),
    OomFragment("CUDNN_STATUS_ALLOC_FAILED", "cudnn_alloc", "cuda", True,
                "aten/src/ATen/cudnn/Exceptions.h AT_CUDNN_CHECK"),
    OomFragment("CUDNN_STATUS_NOT_SUPPORTED", "cudnn_ns", "cuda", False,
                "aten/src/ATen/cudnn/Exceptions.h: often a batch too large for cuDNN, not always memory"),
    OomFragment("DefaultCPUAllocator: can't allocate memory", "cpu", "cpu", True,
                "c10/core/impl/alloc_cpu.cpp alloc_cpu (POSIX)"),
    OomFragment("DefaultCPUAllocator: not enough memory", "cpu", "cpu", True,
                "c10/core/impl/alloc_cpu.cpp alloc_cpu (Windows; before 1.2 everywhere)"),
)

_CERTAIN_RE = re.compile("|".join(f.regex for f in OOM_FRAGMENTS if f.certain))


def is_oom_text(text: str) -> bool:
    """True when `text` holds one of the `OOM_FRAGMENTS` that always mean memory ran out."""
    return _CERTAIN_RE.search(text) is not None


@dataclass(frozen=True, slots=True)
class OomMessage:
    """One out-of-memory message; sizes in bytes, None where the message does not say.

    ``allocated_bytes`` is PyTorch's ``allocated_bytes`` statistic: the current format
    prints it plus ``private_pool_bytes``; this field has the private pools taken out
    again. ``reserved_bytes`` = allocated + private pools + reserved-but-unallocated
    (on MPS: the allocator's heaps, ``MPS allocated``). ``other_processes`` are
    ``(pid, bytes)`` as NVML reported them, in message order. ``other_allocations_bytes``
    is MPS's ``other allocations``. ``backend`` is cuda, rocm, xpu, mps or cpu (None when
    the text does not say). ``raw`` is the message text (ANSI codes and launcher prefixes
    removed, whitespace collapsed); ``offset`` where it starts in `normalize_log` of the
    searched text.
    """

    format: str
    raw: str
    offset: int = 0
    backend: str | None = None
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
    other_allocations_bytes: int | None = None

    @property
    def has_numbers(self) -> bool:
        """True for the caching-allocator formats that report device figures."""
        return self.format in ALLOCATOR_FORMATS and self.total_bytes is not None

    @property
    def non_pytorch_bytes(self) -> int | None:
        """Device memory outside this process's PyTorch cache: total - free - reserved.

        CUDA context, cuBLAS/cuDNN workspaces, NCCL buffers, other processes. None when
        the message lacks one of the three figures. Negative values (Windows WDDM spilling
        into shared system memory, or a free figure above the capacity) are clamped to 0.
        """
        if self.total_bytes is None or self.free_bytes is None or self.reserved_bytes is None:
            return None
        return max(0, self.total_bytes - self.free_bytes - self.reserved_bytes)


# --------------------------------------------------------------------------- text clean-up

_ANSI_RE = re.compile(r"\x1b\[[0-?]*[ -/]*[@-~]|\x1b\][^\x07\x1b]*(?:\x07|\x1b\\)|\x1b[@-Z\\-_]")
# Per-line prefixes of distributed launchers:
#   "[rank3]: "   torch/distributed/distributed_c10d.py init_process_group -> _distributed_excepthook
#   "[default0]:" torch/distributed/elastic/multiprocessing/tail_log.py TailLog (f"[{name}{local_rank}]:")
_LINE_PREFIX_RE = re.compile(r"^\[(rank\d+|[A-Za-z_]+\d+)\]: ?", re.M)

_BOMS = ((codecs.BOM_UTF32_LE, "utf-32-le"), (codecs.BOM_UTF32_BE, "utf-32-be"), (codecs.BOM_UTF8, "utf-8"),
         (codecs.BOM_UTF16_LE, "utf-16-le"), (codecs.BOM_UTF16_BE, "utf-16-be"))


def decode_log(data: bytes) -> str:
    """The text of a log file's bytes, whatever encoding wrote it.

    A byte-order mark decides (UTF-8, UTF-16 LE/BE as Windows PowerShell 5's ``>`` and
    ``Out-File`` write, UTF-32). Without one, text whose odd (or even) bytes are mostly NUL
    is UTF-16 without a BOM; anything else is UTF-8, undecodable bytes replaced.
    """
    for bom, codec in _BOMS:
        if data.startswith(bom):
            return data[len(bom):].decode(codec, errors="replace")
    sample = data[:4096]
    if len(sample) >= 4:
        odd, even = sample[1::2].count(0), sample[0::2].count(0)
        if odd > 0.4 * (len(sample) // 2) and even == 0:
            return data.decode("utf-16-le", errors="replace")
        if even > 0.4 * (len(sample) // 2) and odd == 0:
            return data.decode("utf-16-be", errors="replace")
    return data.decode("utf-8", errors="replace")


def _clean(text: str) -> tuple[str, list[int], list[str | None]]:
    """`normalize_log`'s text, the offset where each of its lines starts, and each line's launcher tag."""
    text = _ANSI_RE.sub("", text.lstrip("\ufeff"))
    text = text.replace("\r\n", "\n").replace("\r", "\n")
    starts, tags, out, pos = [], [], [], 0
    for line in text.split("\n"):
        m = _LINE_PREFIX_RE.match(line)
        tag = m.group(1) if m else None
        line = line[m.end():] if m else line
        starts.append(pos)
        tags.append(tag)
        out.append(line)
        pos += len(line) + 1
    return "\n".join(out), starts, tags


def normalize_log(text: str) -> str:
    """Remove ANSI colour codes and launcher line prefixes; turn CRLF and tqdm's CR into LF."""
    return _clean(text)[0]


# --------------------------------------------------------------------------- patterns

# Where a message starts: every fragment of the table. The longest form wins at a position.
_KINDS = {f"k{i}": f for i, f in enumerate(OOM_FRAGMENTS)}
_ANCHOR_RE = re.compile("|".join(f"(?P<{name}>{f.regex})" for name, f in _KINDS.items()))
# A message ends at a blank line, the next traceback or frame, or a chained exception.
_END_RE = re.compile(r"\n\s*\n|\nTraceback \(most recent call last\)|\n\s*File \"|\nDuring handling")
# ... or, once collapsed, after its last sentence.
_TAIL_RE = re.compile(
    r"reserved by PyTorch but unallocated\.|reserved in total by PyTorch\)?|cached\)"
    r"|GPU [^\sA-Za-z]?\s*$",  # message cut at the device index (pytorch#123984)
    re.IGNORECASE,
)
_HINT_RE = re.compile(
    r"\s*(?:If reserved (?:but unallocated )?memory is .*?(?:Memory Management"
    r"(?:\s*\(https?://[^\s)]*\)|\s+and PYTORCH_(?:CUDA|HIP)_ALLOC_CONF\.?)?|$)"
    r"|Please use `?empty_cache`? to release all unoccupied cached memory\.)",
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
    "mps_allocated": re.compile(rf"MPS allocated: {_SIZE}", re.I),
    "mps_other": re.compile(rf"other allocations: {_SIZE}", re.I),
    "mps_allowed": re.compile(rf"max allowed: {_SIZE}", re.I),
    "mps_tail": re.compile(r"on (?:shared|private) pool\.?", re.I),
    "mps_buffer": re.compile(rf"Invalid buffer size: {_SIZE}", re.I),
}

# MPSHeapAllocatorImpl::format_size (torch <= 2.1) printed KB/MB/GB for 1024-based units.
_MPS_UNITS = {"KB": "KiB", "MB": "MiB", "GB": "GiB"}


def _size(m: re.Match[str] | None, group: int = 1, *, binary: bool = False) -> int | None:
    if m is None:
        return None
    text = m.group(group).replace(" ", "")
    if binary:
        text = re.sub(r"([KMG])B$", lambda u: _MPS_UNITS[u.group(0)], text)
    return parse_size(text)


def _device(text: str | None) -> int | None:
    if text is None:
        return None
    text = text.strip()
    return int(text) if text.isdigit() else None


# --------------------------------------------------------------------------- parsing


def _parse_allocator(window: str, offset: int, backend: str | None, kind: str) -> OomMessage:
    """Parse a caching-allocator message (CUDA, HIP or XPU, any layout)."""
    text = " ".join(window.split())
    tail = _TAIL_RE.search(text)
    if tail:
        hint = _HINT_RE.match(text, tail.end())
        text = text[: hint.end() if hint else tail.end()]
    tried = _size(_F["tried"].search(text))
    if _F["total_current"].search(text) or re.search(r"\. GPU", text):
        if backend == "xpu":
            fmt = "xpu" if _F["free_current"].search(text) else "xpu_no_free"
        else:
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
        return OomMessage(format="truncated", raw=text, offset=offset, backend=backend, tried_to_allocate_bytes=tried)
    else:
        cached = _F["reserved_legacy"].search(text) is None and _F["cached_legacy"].search(text)
        if backend == "xpu":
            fmt = "ipex_4gb" if kind == "ipex_4gb" else "ipex_legacy"
        else:
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
        backend=backend,
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


def _parse_mps(window: str, offset: int) -> OomMessage:
    """``MPS backend out of memory (MPS allocated: A, other allocations: O[, max allowed: L]). Tried to allocate X on private pool.``"""
    text = " ".join(window.split())
    tail = _F["mps_tail"].search(text)
    if tail:
        text = text[: tail.end()]
    return OomMessage(
        format="mps",
        raw=text,
        offset=offset,
        backend="mps",
        tried_to_allocate_bytes=_size(_F["tried"].search(text), binary=True),
        reserved_bytes=_size(_F["mps_allocated"].search(text), binary=True),
        other_allocations_bytes=_size(_F["mps_other"].search(text), binary=True),
        allowed_bytes=_size(_F["mps_allowed"].search(text), binary=True),
    )


def _line_around(text: str, start: int, end: int) -> str:
    lo = text.rfind("\n", 0, start) + 1
    hi = text.find("\n", end)
    return " ".join(text[lo : len(text) if hi < 0 else hi].split())


def _window(text: str, start: int, limit: int, starts: list[int], tags: list[str | None]) -> str:
    """The text from `start` to `limit`, without the lines another rank's launcher prefix marks."""
    first = bisect.bisect_right(starts, start) - 1
    tag = tags[first]
    if tag is None or all(t in (None, tag) for t in tags[first:bisect.bisect_right(starts, limit)]):
        return text[start:limit]
    parts, line = [], first
    while line < len(starts) and starts[line] < limit:
        lo = max(starts[line], start)
        hi = min(starts[line + 1] - 1 if line + 1 < len(starts) else len(text), limit)
        if tags[line] in (None, tag):
            parts.append(text[lo:hi])
        line += 1
    return "\n".join(parts)


def _parse_at(text: str, m: re.Match[str], limit: int, starts: list[int], tags: list[str | None]) -> OomMessage:
    frag = _KINDS[m.lastgroup or ""]
    kind, start = frag.kind, m.start()
    window = _window(text, start, limit, starts, tags)
    end = _END_RE.search(window)
    if end:
        window = window[: end.start()]
    if kind in ("alloc", "alloc_bare", "ipex_4gb"):
        backend = frag.backend
        if kind == "alloc_bare":
            backend = "xpu" if re.search(r"XPU out of memory", text[max(0, start - 200):start]) else None
        return _parse_allocator(window, start, backend, kind)
    if kind == "mps":
        return _parse_mps(window, start)
    raw = _line_around(text, start, m.end())
    if kind == "mps_buffer":
        return OomMessage(format="mps_buffer_size", raw=raw, offset=start, backend="mps",
                          tried_to_allocate_bytes=_size(_F["mps_buffer"].search(window), binary=True))
    if kind == "cpu":
        cm = _F["cpu_bytes"].search(window)
        n = None
        if cm:
            n = int(cm.group(1)) * (GiB if cm.group(2).upper() == "GB" else 1)
        return OomMessage(format="cpu_allocator", raw=raw, offset=start, backend="cpu", tried_to_allocate_bytes=n)
    fmt = {
        "cuda_error": "cuda_error",
        "xpu_runtime": "xpu_runtime_error",
        "cublas": "cublas_alloc_failed",
        "cudnn_alloc": "cudnn_alloc_failed",
        "cudnn_ns": "cudnn_not_supported",
    }[kind]
    return OomMessage(format=fmt, raw=raw, offset=start, backend=frag.backend)


def find_ooms(log_text: str) -> list[OomMessage]:
    """Every out-of-memory message in a whole log or traceback, in order of appearance.

    ANSI colours, CR/CRLF line ends and launcher prefixes (``[rank3]: ``) are removed
    first (`normalize_log`); offsets refer to that normalized text. A message wrapped over
    several lines is joined; lines another rank interleaved into it are left out. The same
    exception printed twice (e.g. once by a logger, once in the traceback) counts twice.
    """
    text, starts, tags = _clean(log_text)
    matches = list(_ANCHOR_RE.finditer(text))
    found = []
    for i, m in enumerate(matches):
        limit = matches[i + 1].start() if i + 1 < len(matches) else len(text)
        limit = min(limit, m.start() + _WINDOW_CHARS)
        found.append(_parse_at(text, m, limit, starts, tags))
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
