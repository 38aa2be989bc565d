"""`memfit plan`'s text output: a table on a wide terminal; on a pipe, a log or a terminal under 120 columns each
row as lines, its changes whole (no cell cut to `attn_impl…`)."""

import pytest

from conftest import save_bert_config
from memfit.commands.plan import WIDE_COLUMNS, render, render_parallel, short
from memfit.estimator import estimate
from memfit.planner.parallel_plan import plan_parallel
from memfit.planner.search import plan
from memfit.train_setup import TrainSetup


@pytest.fixture(scope="module")
def bert(tmp_path_factory):
    return save_bert_config(tmp_path_factory, "bert4o", hidden_size=128, num_hidden_layers=4, num_attention_heads=4,
                            intermediate_size=512, vocab_size=4000)


@pytest.fixture(scope="module")
def single(bert):
    """A GPU 80 % of what the setup needs: several plans, each a few changes."""
    s = TrainSetup(model=bert, per_device_train_batch_size=16, gradient_accumulation_steps=1, max_length=256,
                   eval_strategy="no")
    need = estimate(s, gpu="A100-40GB").device_used_bytes
    return plan(s, gpu=f"{int(need * 0.8) // 2**20}MiB", cache=False, workers=1)


@pytest.fixture(scope="module")
def parallel(bert):
    s = TrainSetup(model=bert, per_device_train_batch_size=4, gradient_accumulation_steps=2, max_length=64,
                   eval_strategy="no")
    return plan_parallel(s, gpus="2xA100-40GB", strategies=("ddp",))


pytestmark = pytest.mark.slow  # three plans (about 30 s of CPU on 2 cores)


def _out(capsys, monkeypatch, fn, result, *, columns: int, terminal: bool) -> str:
    monkeypatch.setenv("COLUMNS", str(columns))
    if terminal:
        monkeypatch.setenv("FORCE_COLOR", "1")  # rich: a terminal
    else:
        monkeypatch.delenv("FORCE_COLOR", raising=False)
        monkeypatch.delenv("TTY_COMPATIBLE", raising=False)
    capsys.readouterr()
    fn(result)
    return capsys.readouterr().out


def _block(out: str, title: str) -> list[str]:
    """The lines of the plans block: from its title to the first line after it that is not a row."""
    lines = out.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith(title))
    while lines[start + 1].startswith(" ") or not lines[start].rstrip().endswith(")"):  # the wrapped title
        start += 1
    block = []
    for line in lines[start + 1:]:
        if not line.startswith((" ", ">")) and not line[:1].isdigit() and not line.startswith(("as is", "start")):
            break
        block.append(line)
    return block


@pytest.mark.parametrize("terminal", [False, True])
def test_a_pipe_or_80_columns_gets_each_plan_as_whole_lines(single, capsys, monkeypatch, terminal):
    out = _out(capsys, monkeypatch, render, single, columns=80, terminal=terminal)
    assert "…" not in out and "┃" not in out and "│" not in out  # no table, no cut cell
    block = _block(out, "Plans (")
    lines = out.splitlines()
    title = lines[next(i for i, line in enumerate(lines) if line.startswith("Plans (")):lines.index(block[0])]
    assert len(title) >= 2 and all(len(line) <= 80 for line in title)  # the title wrapped too
    assert all(len(line) <= 80 for line in block), [line for line in block if len(line) > 80]
    assert len(single.plans) >= 2
    text = " ".join(line.strip() for line in block)
    for p in single.plans:  # every plan's changes, each whole
        for change in short(p.setup_changes, p.env).split(", "):
            assert change in text
    assert any(line.startswith(">") for line in block) == (single.chosen is not None)
    assert "as is: peak reserved" in block[0]


def test_a_wide_terminal_gets_the_table(single, capsys, monkeypatch):
    out = _out(capsys, monkeypatch, render, single, columns=WIDE_COLUMNS + 40, terminal=True)
    assert "┃" in out or "│" in out
    assert "changes: " not in out


def test_the_parallel_candidates_as_lines_when_piped(parallel, capsys, monkeypatch):
    out = _out(capsys, monkeypatch, render_parallel, parallel, columns=80, terminal=False)
    assert "…" not in out and "│" not in out
    block = _block(out, "Candidates simulated")
    assert all(len(line) <= 80 for line in block), [line for line in block if len(line) > 80]
    heads = [line for line in block if not line.startswith(" ")]
    assert len(heads) == len(parallel.candidates)
    assert heads[parallel.chosen].startswith(f">{parallel.chosen} DDP: per GPU ")
    wide = _out(capsys, monkeypatch, render_parallel, parallel, columns=WIDE_COLUMNS, terminal=True)
    assert "│" in wide or "┃" in wide


def _hand_plan(changes: dict, *, reserved: int, fits: bool, verified: bool = True):
    from memfit.planner.search import Plan

    return Plan(remedies=list(changes), setup_changes=changes, changes={}, env={}, code=[],
                peak_allocated_bytes=reserved, peak_reserved_bytes=reserved, device_used_bytes=reserved,
                headroom_bytes=2**30 - reserved, relative_step_time=1.0, fits=fits, verified=verified)


@pytest.mark.parametrize("fix_alone_chosen", [True, False])
def test_a_started_plan_shows_the_start_once(capsys, monkeypatch, fix_alone_chosen):
    """When the change the search started from is itself the chosen plan 0, the table has its row once (plan 0),
    not a `start` row repeated as plan 0; when a faster plan is chosen, the start keeps its own row."""
    from memfit.planner.search import PlanResult

    fix = {"weights_dtype": "fp32", "precision": "fp16"}
    base = _hand_plan(fix, reserved=2**29, fits=True)
    other = _hand_plan({**fix, "gradient_checkpointing": True}, reserved=2**28, fits=True)
    plans, chosen = ([base, other], 0) if fix_alone_chosen else ([other], 0)
    result = PlanResult(fits_as_is=False, baseline=base, plans=plans, chosen=chosen,
                        gpu={"name": "T4", "total_bytes": 2**30}, margin=0.05, budget_bytes=2**30, miss_bytes=None,
                        suggestions=[], not_applicable={}, elapsed_s=0.0, simulations=1,
                        started_from={"changes": fix, "flags": "--weights-dtype fp32 --precision fp16",
                                      "cause": "float16 weights meet float32 inputs", "why": "no bf16 on a T4"})
    out = _out(capsys, monkeypatch, render, result, columns=80, terminal=False)
    labels = [line.split(":")[0] for line in _block(out, "Plans (") if not line.startswith(" ")]
    assert labels == ([">0*", "1*"] if fix_alone_chosen else ["start", ">0*"])
