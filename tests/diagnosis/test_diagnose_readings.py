"""Diagnose where the figures allow more than one reading: DeepSpeed's parameter fetch says its pass in its
argument, a cut-off message's one process may be this one, and fragmentation that decides one allocation on a
full card does not decide the run.

Messages: the DeepSpeed frames are those of dhcode-cpp/X-R1#14 (a ZeRO-3 GRPO run out of memory on an A10),
pasted from the DeepSpeed hook down as users paste a traceback's tail, followed by an OOM line of the current
format whose figures are illustrative (the phase comes from the frames alone); the cut-off message has the figures of a
report to the memfit developers (a 14.75 GiB card, 3.78 GiB free, one process with 10.95 GiB, the text ending
there); the full-card messages are tests/data/oom/corpus.json's (sources there).
"""

from __future__ import annotations

import json

import pytest

from helpers import DATA_DIR
from memfit.diagnosis import detect_phase, diagnose
from memfit.units import GiB, MiB

CORPUS = {c["id"]: c["text"] for c in json.loads((DATA_DIR / "oom" / "corpus.json").read_text(encoding="utf-8"))}

_SITE = "/root/miniconda3/envs/open_r1/lib/python3.12/site-packages"
_DEEPSPEED_FETCH = f"""[rank0]:   File "{_SITE}/deepspeed/utils/nvtx.py", line 18, in wrapped_fn
[rank0]:     ret_val = func(*args, **kwargs)
[rank0]:               ^^^^^^^^^^^^^^^^^^^^^
[rank0]:   File "{_SITE}/deepspeed/runtime/zero/parameter_offload.py", line 288, in _pre_forward_module_hook
[rank0]:     self.pre_sub_module_forward_function(module)
[rank0]:   File "{_SITE}/torch/utils/_contextlib.py", line 116, in decorate_context
[rank0]:     return func(*args, **kwargs)
[rank0]:            ^^^^^^^^^^^^^^^^^^^^^
[rank0]:   File "{_SITE}/deepspeed/runtime/zero/parameter_offload.py", line 463, in pre_sub_module_forward_function
[rank0]:     param_coordinator.fetch_sub_module(sub_module, forward=True)
[rank0]:   File "{_SITE}/deepspeed/runtime/zero/partitioned_param_coordinator.py", line 306, in fetch_sub_module
[rank0]:     self.__all_gather_params(params_to_fetch, forward)
[rank0]: torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 260.00 MiB. GPU 0 has a total capacity of \
22.09 GiB of which 130.44 MiB is free. Including non-PyTorch memory, this process has 21.96 GiB memory in use. Of the \
allocated memory 20.93 GiB is allocated by PyTorch, and 602.21 MiB is reserved by PyTorch but unallocated.
"""


def test_deepspeed_parameter_fetch_names_its_pass():
    phase, frame = detect_phase(_DEEPSPEED_FETCH)
    assert phase == "forward" and "fetch_sub_module(sub_module, forward=True)" in frame
    assert diagnose(_DEEPSPEED_FETCH).phase == "forward"
    # the backward hook fetches with forward=False (parameter_offload.py pre_sub_module_backward_function)
    backward = (_DEEPSPEED_FETCH.replace("pre_sub_module_forward_function", "pre_sub_module_backward_function")
                .replace("_pre_forward_module_hook", "_run_before_backward_function")
                .replace("forward=True", "forward=False"))
    phase, frame = detect_phase(backward)
    assert phase == "backward" and "forward=False" in frame
    # without the argument, the hook's name says it
    no_code = "\n".join(ln for ln in _DEEPSPEED_FETCH.splitlines() if "fetch_sub_module(sub_module" not in ln)
    assert detect_phase(no_code)[0] == "forward"


CUT_OFF = ("torch.OutOfMemoryError: CUDA out of memory. Tried to allocate {tried}. GPU 0 has a total capacity of "
           "14.75 GiB of which 3.78 GiB is free. Process 2116 has 10.95 GiB memory in use.")


@pytest.mark.parametrize("tried", ["5.00 GiB", "20.00 MiB"])
def test_cut_off_message_with_one_process_holding_the_card_says_both_readings(tried):
    d = diagnose(CUT_OFF.format(tried=tried))
    primary = d.causes[0]
    assert primary.primary and primary.kind == "one_process" and primary.bytes == pytest.approx(10.95 * GiB, rel=1e-3)
    # 14.75 - 3.78 = 10.97 GiB in use, 10.95 of it PID 2116's: at most ~20 MiB (with rounding) is anyone else's
    assert "10.97 GiB in use" in primary.text and "PID 2116" in primary.text
    assert "this process" in primary.text and "another process" in primary.text and "container" in primary.text
    assert not any(c.kind == "other_processes" for c in d.causes)  # not blamed on other processes
    assert d.advice_ids[0] == "check_nvidia_smi" and "stop_other_processes" not in d.advice_ids[:1]
    if tried == "5.00 GiB":  # the first reading is a shortfall of 5.00 - 3.78 GiB
        assert "1.22 GiB more than is free" in primary.text
        assert any(c.kind == "shortfall" and c.bytes for c in d.causes)
    zh = diagnose(CUT_OFF.format(tried=tried), lang="zh")
    assert [c.kind for c in zh.causes] == [c.kind for c in d.causes] and "PID 2116" in zh.causes[0].text


def test_a_second_process_beside_the_listed_one_keeps_the_other_processes_reading():
    # 1 GiB in use beyond PID 2116's: room for this process's CUDA context and more, so PID 2116 is another one
    d = diagnose(CUT_OFF.format(tried="5.00 GiB").replace("3.78 GiB is free", "2.78 GiB is free"))
    assert not any(c.kind == "one_process" for c in d.causes)
    assert any(c.kind == "other_processes" for c in d.causes)


@pytest.mark.parametrize(("key", "unused"), [("pt16417c", "0.19 GiB"), ("ctrl_device", "20.00 MiB")])
def test_fragmentation_on_a_full_card_is_said_to_decide_one_allocation_not_the_run(key, unused):
    d = diagnose(CORPUS[key])
    m = d.message
    U, R, F, C = m.reserved_unallocated_bytes, m.reserved_bytes, m.free_bytes, m.total_bytes
    assert U < 0.02 * R and U + F < 0.02 * C  # pt16417c: 194.87 MiB of 23.09 GiB; 11.06 MiB free of 23.65 GiB
    frag = d.causes[0]
    assert frag.kind == "fragmentation" and frag.primary  # still true of this allocation
    assert "not the run" in frag.text and "effectively full" in frag.text
    assert frag.bytes == U and f"buys at most those {unused}," in frag.text


def test_fragmentation_with_room_on_the_card_stays_plain():
    # quoted_frag: 910.35 MiB unused (4% of the cache) and 115.69 MiB free for 158 MiB
    d = diagnose(CORPUS["quoted_frag"])
    assert d.causes[0].kind == "fragmentation" and "would have fit" in d.causes[0].text
    assert "effectively full" not in d.causes[0].text
    assert d.message.reserved_unallocated_bytes > 900 * MiB
