"""`PYTORCH_ALLOC_CONF` / `PYTORCH_CUDA_ALLOC_CONF` parsing, with PyTorch's own validation.

Mirrors `c10::CachingAllocator::AcceleratorAllocatorConfig::parseArgs`
(c10/core/AllocatorConfig.cpp) for the options that change the caching allocator's
behaviour, and `CUDAAllocatorConfig::parseArgs` (c10/cuda/CUDAAllocatorConfig.cpp)
for the CUDA-only keys, which are accepted and ignored with a note:

* tokens: the string is split at `,` `:` `[` `]`, spaces are dropped
  (`ConfigTokenizer`, formerly `AllocatorConfig::lexArgs`);
* `max_split_size_mb` and `max_non_split_rounding_mb`: integer MiB, must be
  `>= kLargeBuffer / kMB = 20` (`parseMaxSplitSize`, `parseMaxNonSplitRoundingSize`);
* `garbage_collection_threshold`: a float in the open interval (0.0, 1.0)
  (`parseGarbageCollectionThreshold`);
* `roundup_power2_divisions`: either one power of two for every size, or
  `[boundary_mb:divisions,...,>:divisions]` with power-of-two boundaries (in MiB) and
  divisions that are a power of two or 0 (`parseRoundUpPower2Divisions`);
* `expandable_segments`: `True` / `False` (`ConfigTokenizer::toBool`);
* an unknown key is an error ("Unrecognized key ... in CUDA allocator config").

Environment precedence (torch >= 2.9, `AcceleratorAllocatorConfig::instance`):
`PYTORCH_ALLOC_CONF` is read first; `PYTORCH_CUDA_ALLOC_CONF` only when the former is
unset (and torch warns it is deprecated). Torch <= 2.8 reads only
`PYTORCH_CUDA_ALLOC_CONF`.

Known limitations:

* `backend:cudaMallocAsync` is recorded but the allocator model always replays the
  native caching allocator (cudaMallocAsync's pool is driver-managed and not modelled).
* Pinned-memory and locking options (`pinned_*`, `release_lock_on_cudamalloc`,
  `graph_capture_record_stream_reuse`) do not change device memory and are ignored.
* `PYTORCH_NO_CUDA_MEMORY_CACHING` (no caching at all) is not modelled.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, field

from memfit.allocator.constants import K_LARGE_BUFFER, ROUNDUP_INTERVALS
from memfit.errors import MemfitError
from memfit.units import MiB

__all__ = ["AllocConf", "parse_alloc_conf", "alloc_conf_from_env", "ROUNDUP_INTERVALS"]


_CUDA_IGNORED_KEYS = {
    "release_lock_on_cudamalloc", "release_lock_on_hipmalloc",
    "pinned_use_cuda_host_register", "pinned_use_hip_host_register",
    "pinned_num_register_threads", "pinned_reserve_segment_size_mb",
    "graph_capture_record_stream_reuse", "pinned_use_background_threads",
}
_KNOWN_KEYS = (
    "max_split_size_mb", "max_non_split_rounding_mb", "garbage_collection_threshold",
    "roundup_power2_divisions", "expandable_segments", "backend",
    *sorted(_CUDA_IGNORED_KEYS),
)


def _is_pow2(n: int) -> bool:
    return n > 0 and (n & (n - 1)) == 0


@dataclass(frozen=True)
class AllocConf:
    """The caching-allocator settings the model honours.

    `roundup_power2_divisions` may be given as one int (all sizes) or as a sequence of
    16 ints, one per power-of-two interval starting at 1 MiB (index 0: sizes < 2 MiB,
    index k: [2**k MiB, 2**(k+1) MiB), index 15: >= 32 GiB), as PyTorch stores it.
    """

    max_split_size_bytes: int | None = None
    max_non_split_rounding_bytes: int = K_LARGE_BUFFER
    roundup_power2_divisions: int | tuple[int, ...] = 0
    expandable_segments: bool = False
    garbage_collection_threshold: float | None = None
    backend: str = "native"
    notes: tuple[str, ...] = field(default=(), compare=False)

    def __post_init__(self) -> None:
        divs = self.roundup_power2_divisions
        if isinstance(divs, int):
            divs = (divs,) * ROUNDUP_INTERVALS
        divs = tuple(int(d) for d in divs)
        if len(divs) != ROUNDUP_INTERVALS:
            raise MemfitError(
                f"roundup_power2_divisions `{divs}` must have {ROUNDUP_INTERVALS} entries; "
                "give one int or the per-interval list"
            )
        object.__setattr__(self, "roundup_power2_divisions", divs)

    def divisions_for(self, size_bytes: int) -> int:
        """`AcceleratorAllocatorConfig::roundup_power2_divisions(size)`."""
        log_size = size_bytes.bit_length() - 1  # 63 - countLeadingZeros(size)
        index = max(0, log_size - 20)  # intervals start at 1 MiB = 2**20
        return self.roundup_power2_divisions[min(index, ROUNDUP_INTERVALS - 1)]  # type: ignore[index]

    @property
    def max_split_size_effective(self) -> int:
        """`max_split_size()`: SIZE_MAX when unset."""
        return self.max_split_size_bytes if self.max_split_size_bytes is not None else (1 << 64) - 1


_TOKEN_RE = re.compile(r"[,:\[\]]|[^,:\[\]]+")


def _tokenize(text: str) -> list[str]:
    # ConfigTokenizer: separators are their own tokens; spaces are removed everywhere.
    return [t for t in _TOKEN_RE.findall(text.replace(" ", "")) if t]


class _Tokens:
    def __init__(self, text: str) -> None:
        self.text = text
        self.toks = _tokenize(text)

    def __len__(self) -> int:
        return len(self.toks)

    def get(self, i: int, what: str) -> str:
        if i >= len(self.toks):
            raise MemfitError(
                f"allocator config `{self.text}` ends early: expected {what}; "
                "write e.g. `max_split_size_mb:128,expandable_segments:True`"
            )
        return self.toks[i]

    def expect(self, i: int, sep: str) -> None:
        tok = self.get(i, f"`{sep}`")
        if tok != sep:
            raise MemfitError(
                f"allocator config `{self.text}`: expected `{sep}` but found `{tok}`; "
                "write `key:value` pairs separated by commas"
            )

    def to_int(self, i: int, key: str) -> int:
        tok = self.get(i, f"a value for {key}")
        if not tok.isdigit():
            raise MemfitError(f"{key} value `{tok}` is not a non-negative integer; write e.g. `{key}:128`")
        return int(tok)

    def to_bool(self, i: int, key: str) -> bool:
        tok = self.get(i, f"True/False for {key}")
        if tok not in ("True", "False"):
            raise MemfitError(f"{key} value `{tok}` must be `True` or `False` (capitalised, as PyTorch requires)")
        return tok == "True"


def _parse_divisions(t: _Tokens, i: int) -> tuple[int, tuple[int, ...]]:
    """`parseRoundUpPower2Divisions`; returns (last index consumed, 16 divisions)."""
    key = "roundup_power2_divisions"
    divs = [0] * ROUNDUP_INTERVALS
    if t.get(i, f"a value for {key}") != "[":
        value = t.to_int(i, key)
        if not _is_pow2(value):
            raise MemfitError(f"{key} `{value}` must be a power of 2 (e.g. `4`), as PyTorch requires")
        return i, (value,) * ROUNDUP_INTERVALS
    first, last_index = True, 0
    i += 1
    while i < len(t) and t.toks[i] != "]":
        boundary_tok = t.toks[i]
        t.expect(i + 1, ":")
        value = t.to_int(i + 2, key)
        i += 2
        if value != 0 and not _is_pow2(value):
            raise MemfitError(f"{key} divisions `{value}` must be a power of 2 or 0 (0 disables the roundup)")
        if boundary_tok == ">":
            # fill every interval after the last named one (torch >= 2.9: last_index + 1)
            for k in range(last_index + 1, ROUNDUP_INTERVALS):
                divs[k] = value
        else:
            if not boundary_tok.isdigit() or not _is_pow2(int(boundary_tok)):
                raise MemfitError(
                    f"{key} interval `{boundary_tok}` must be a power of 2 in MiB (e.g. `[256:1,512:2,>:4]`)"
                )
            index = min(max(int(boundary_tok).bit_length() - 1, 0), ROUNDUP_INTERVALS - 1)
            if first:
                for k in range(index):
                    divs[k] = value
                first = False
            divs[index] = value
            last_index = index
        if i + 1 < len(t) and t.toks[i + 1] != "]":
            t.expect(i + 1, ",")
            i += 1
        i += 1
    if i >= len(t):
        raise MemfitError(f"{key} list in `{t.text}` has no closing `]`; write e.g. `[256:1,512:2,>:4]`")
    return i, tuple(divs)


def parse_alloc_conf(text: str | None) -> AllocConf:
    """Parse an allocator config string such as `max_split_size_mb:128,expandable_segments:True`."""
    if text is None or not text.strip():
        return AllocConf()
    t = _Tokens(text)
    values: dict[str, object] = {}
    notes: list[str] = []
    i = 0
    while i < len(t):
        key = t.toks[i]
        if key in ("max_split_size_mb", "max_non_split_rounding_mb"):
            t.expect(i + 1, ":")
            mb = t.to_int(i + 2, key)
            i += 2
            if mb < K_LARGE_BUFFER // MiB:
                raise MemfitError(
                    f"{key} `{mb}` is too small: PyTorch requires >= 20 (kLargeBuffer, 20 MiB); "
                    f"use e.g. `{key}:128`"
                )
            field_name = "max_split_size_bytes" if key == "max_split_size_mb" else "max_non_split_rounding_bytes"
            values[field_name] = mb * MiB
        elif key == "garbage_collection_threshold":
            t.expect(i + 1, ":")
            tok = t.get(i + 2, f"a value for {key}")
            i += 2
            try:
                thr = float(tok)
            except ValueError:
                raise MemfitError(f"{key} `{tok}` is not a number; write e.g. `{key}:0.6`") from None
            if not 0.0 < thr < 1.0:
                raise MemfitError(f"{key} `{tok}` must lie strictly between 0.0 and 1.0, e.g. `0.6`")
            values["garbage_collection_threshold"] = thr
        elif key == "roundup_power2_divisions":
            t.expect(i + 1, ":")
            i, divs = _parse_divisions(t, i + 2)
            values["roundup_power2_divisions"] = divs
        elif key == "expandable_segments":
            t.expect(i + 1, ":")
            values["expandable_segments"] = t.to_bool(i + 2, key)
            i += 2
        elif key == "backend":
            t.expect(i + 1, ":")
            backend = t.get(i + 2, "a backend name")
            i += 2
            if backend not in ("native", "cudaMallocAsync"):
                raise MemfitError(f"backend `{backend}` is unknown; PyTorch accepts `native` or `cudaMallocAsync`")
            values["backend"] = backend
            if backend == "cudaMallocAsync":
                notes.append("backend:cudaMallocAsync is not modelled; replaying the native caching allocator")
        elif key in _CUDA_IGNORED_KEYS:
            t.expect(i + 1, ":")
            t.get(i + 2, f"a value for {key}")
            i += 2
            notes.append(f"{key} does not change device memory use; ignored")
        else:
            raise MemfitError(
                f"allocator option `{key}` is not recognised by PyTorch; known options: {', '.join(_KNOWN_KEYS)}"
            )
        if i + 1 < len(t):
            t.expect(i + 1, ",")
            i += 1
        i += 1
    if values.get("garbage_collection_threshold") is not None:
        notes.append(
            "garbage_collection_threshold only acts after torch.cuda.set_per_process_memory_fraction "
            "(CUDACachingAllocator.cpp: `set_fraction && garbage_collection_threshold() > 0`)"
        )
    return AllocConf(**values, notes=tuple(notes))  # type: ignore[arg-type]


def alloc_conf_from_env(environ: Mapping[str, str]) -> AllocConf:
    """The config PyTorch would read: `PYTORCH_ALLOC_CONF`, else `PYTORCH_CUDA_ALLOC_CONF`."""
    if environ.get("PYTORCH_ALLOC_CONF") is not None:
        return parse_alloc_conf(environ["PYTORCH_ALLOC_CONF"])
    if environ.get("PYTORCH_CUDA_ALLOC_CONF") is not None:
        return parse_alloc_conf(environ["PYTORCH_CUDA_ALLOC_CONF"])
    return AllocConf()
