"""`diagnose`: explain an out-of-memory error: where it happened, why, and what helps.

`diagnose` is pure: text, a log file's path or an exception in, a frozen `Diagnosis` out;
the CLI prints it. It finds the last OOM message (memfit.oom_text), the traceback that belongs
to it and the phase it points at (memfit.diagnosis.phase), the operation that allocated
(memfit.diagnosis.operations), the message's causes (memfit.diagnosis.causes) and the advice,
ranked (memfit.diagnosis.advice); with a setup, the plan for the GPU the message describes
(memfit.diagnosis.gpu_match).
"""

from __future__ import annotations

import os
import traceback
from dataclasses import dataclass
from pathlib import Path

from memfit.diagnosis import gpu_match
from memfit.diagnosis.advice import advice_text, rank_advice, remedies_of
from memfit.diagnosis.causes import MONITOR_TOOLS, Cause, message_causes, operation_causes
from memfit.diagnosis.model_part import model_part
from memfit.diagnosis.operations import Operation, detect_operation, nccl_oom_line
from memfit.diagnosis.phase import detect_phase, traceback_for
from memfit.diagnosis.strings import t
from memfit.errors import MemfitError
from memfit.oom_text import OomMessage, decode_log, find_ooms, normalize_log
from memfit.trace import UNKNOWN

__all__ = ["Diagnosis", "diagnose", "read_log"]


@dataclass(frozen=True, slots=True)
class Diagnosis:
    """What `diagnose` found. `advice` is ranked, most effective first."""

    is_oom: bool
    message: OomMessage | None
    phase: str  #: one of memfit.trace.DIAGNOSED_PHASES
    causes: tuple[Cause, ...]
    advice: tuple[str, ...]
    oom_count: int
    advice_ids: tuple[str, ...] = ()
    phase_frame: str = ""  #: the traceback frame that decided the phase
    lang: str = "en"
    plan: object = None  #: memfit.planner.search.PlanResult when a setup was given
    operation: str = "unknown"  #: memfit.diagnosis.operations.OPERATIONS: what allocated
    operation_frame: str = ""  #: the frame (or code line) that decided the operation
    operation_context: tuple[str, ...] = ()  #: operations further out in the traceback, innermost first
    #: the part of an image or speech model the error happened in (memfit.diagnosis.model_part.PARTS), or ""
    model_part: str = ""
    model_part_frame: str = ""  #: the frame whose call named the part

    @property
    def non_pytorch_bytes(self) -> int | None:
        return self.message.non_pytorch_bytes if self.message else None

    @property
    def remedies(self) -> tuple[str, ...]:
        """The memfit.remedies the advice recommends, in its order (the names `memfit plan` uses)."""
        return remedies_of(self.advice_ids)


def read_log(path: str | os.PathLike[str]) -> str:
    """The text of a log file in any encoding `memfit.oom_text.decode_log` reads (UTF-8, UTF-16 with BOM, ...)."""
    p = Path(path)
    if not p.exists():
        raise MemfitError(f"log file `{p}` does not exist; pass the path of the training log or traceback")
    if p.is_dir():
        raise MemfitError(f"`{p}` is a directory; pass the log file inside it (e.g. `{p}/train.log`)")
    try:
        return decode_log(p.read_bytes())
    except OSError as err:
        raise MemfitError(f"cannot read log file `{p}` ({err.strerror}); check its permissions") from err


def _source_text(source: object) -> str:
    if isinstance(source, BaseException):
        return "".join(traceback.format_exception(type(source), source, source.__traceback__))
    if isinstance(source, os.PathLike):
        return read_log(source)
    if isinstance(source, bytes):
        return decode_log(source)
    text = str(source)
    if "\n" not in text and 0 < len(text) < 4096:
        try:
            if Path(text).is_file():
                return read_log(text)
        except (OSError, ValueError):  # not a usable path (too long, NUL byte): it is text
            pass
    return text


def diagnose(source: str | os.PathLike[str] | bytes | BaseException, *, lang: str = "en",
             setup: object = None) -> Diagnosis:
    """Diagnose the last out-of-memory error in a log, a traceback, a message or an exception.

    Args:
        source: the text of a log, traceback or message; or the path of a log file (a
            `str` that names an existing file, or a `pathlib.Path`), read in any encoding a
            log comes in (UTF-8, UTF-16 with BOM as Windows PowerShell writes it); or the
            log's bytes; or the exception itself.
        lang: language of the texts, one of `memfit.diagnosis.strings.LANGS`.
        setup: a TrainSetup (the model and arguments of the run that failed): the
            diagnosis is then handed to the planner (memfit.planner.search) for the GPU the message
            describes. Its total capacity picks the GPU (a catalog entry of that size, else a
            generic GPU of that size) and the memory it shows outside PyTorch's cache replaces
            memfit's estimate of it. The result is in `Diagnosis.plan`.
    """
    t("title", lang)  # validates lang
    raw = _source_text(source)
    text = normalize_log(raw)
    ooms = find_ooms(raw)
    if not ooms:
        nccl = nccl_oom_line(text)
        if nccl is None:
            return Diagnosis(False, None, UNKNOWN, (), (), 0, lang=lang)
        offset, line, n = nccl
        ooms = [OomMessage(format="nccl", raw=line, offset=offset, backend="cuda", tried_to_allocate_bytes=n)]
    m = ooms[-1]
    prev_end = ooms[-2].offset + 1 if len(ooms) > 1 else 0
    phase_tb = traceback_for(text, m, prev_end, len(text))
    phase, frame = detect_phase(phase_tb)
    op = _operation_for(text, m, prev_end, phase_tb)

    found = message_causes(m, lang, raw)
    part, part_frame = model_part(phase_tb)
    ids = rank_advice(found, phase, op, part)
    causes = found.causes + operation_causes(m, op, setup, lang)
    pids = ", ".join(str(pid) for pid, _ in m.other_processes) or "?"
    tool = MONITOR_TOOLS.get(m.backend, "nvidia-smi")
    advice = tuple(advice_text(a, lang, pids=pids, tool=tool, log_text=text, setup=setup) for a in ids)
    planned = gpu_match.plan_for(setup, m) if setup is not None else None
    return Diagnosis(True, m, phase, tuple(causes), advice, len(ooms), tuple(ids), frame, lang, planned,
                     op.name, op.frame, op.context, part, part_frame)


def _operation_for(text: str, m: OomMessage, previous_end: int, phase_traceback: str) -> Operation:
    """The operation of the lines just before `m` (from the last traceback header, if any, up to the
    message's own line), else of the traceback the phase was read from."""
    before = text[previous_end : m.offset]
    before = before[: before.rfind("\n") + 1] if "\n" in before else ""
    head = before.rfind("Traceback (most recent call last)")
    region = before[head:] if head >= 0 else before[-20000:]
    op = detect_operation(region, nccl=m.format == "nccl")
    if op.name == "unknown" and phase_traceback != region:
        op = detect_operation(phase_traceback, nccl=m.format == "nccl")
    return op

