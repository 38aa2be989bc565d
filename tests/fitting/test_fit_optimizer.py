"""Out-of-memory errors in the optimizer step: undone, retried in a lower-memory mode, same update."""

import types

import pytest
import torch

from memfit.errors import MemfitError
from memfit.fitting.optimizer_step import MODES, OptimizerStepGuard
from memfit.fitting.recovery import Meter
from memfit.testing import memory_budget


def _model():
    torch.manual_seed(0)
    return torch.nn.Sequential(*[torch.nn.Linear(64, 64, bias=False) for _ in range(4)])


def _grads(model, step):
    g = torch.Generator().manual_seed(100 + step)
    for p in model.parameters():
        p.grad = torch.randn(p.shape, generator=g)


def _run(steps, budget_bytes=None, snapshot="auto", **opt_kw):
    """`steps` AdamW steps on fixed gradients, each under the budget; returns weights, guard, optimizer."""
    model = _model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, **opt_kw)
    trainer = types.SimpleNamespace(optimizer=opt, state=types.SimpleNamespace(global_step=0))
    budget = None
    recoveries, changes = [], []
    guard = None
    for step in range(steps):
        _grads(model, step)
        if budget_bytes is not None:
            budget = memory_budget(budget_bytes, count=(model, opt))
            if guard is None:
                guard = OptimizerStepGuard(trainer, meter=Meter(budget), recoveries=recoveries,
                                           on_change=changes.append, snapshot=snapshot)
            guard.meter = Meter(budget)
            guard.install()
            with budget:
                opt.step()
        else:
            opt.step()
        trainer.state.global_step += 1
    return [p.detach().clone() for p in model.parameters()], guard, opt, recoveries


def _step_peak(**opt_kw):
    """Peak live bytes of the first AdamW step, measured under a large budget."""
    model = _model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, **opt_kw)
    _grads(model, 0)
    with memory_budget(1 << 30, count=(model, opt)) as b:
        opt.step()
    return b.peak_bytes


W = 4 * 64 * 64 * 4  # bytes of the four weights (and of their gradients)


def test_foreach_temporaries_recovered_by_stepping_per_parameter():
    base, _, _, _ = _run(3, foreach=True)
    peak = _step_peak(foreach=True)  # weights + grads + state + a temporary the size of the group
    assert peak >= 4 * W + W // 2
    weights, guard, opt, recoveries = _run(3, budget_bytes=peak - W // 2, foreach=True)
    assert guard.mode == MODES[1]
    assert [r.phase for r in recoveries] == ["optimizer"]
    assert all(torch.equal(a, b) for a, b in zip(base, weights))  # same update, bitwise
    assert all(int(s["step"]) == 3 for s in opt.state.values())
    assert isinstance(opt.param_groups, list) and type(opt.param_groups) is list  # per-parameter groups put back


def test_modified_state_without_a_copy_is_not_retried():
    peak = _step_peak(foreach=True)
    # step 1 fits as built; step 2 would too, but make step 2's temporaries fail after the in-place moment updates
    with pytest.raises(torch.OutOfMemoryError, match="optimizer_snapshot='always'"):
        _run(2, budget_bytes=peak - W // 2, snapshot="never", foreach=True)


def test_a_copy_makes_a_modifying_failure_retryable():
    base, _, _, _ = _run(3, foreach=True)
    peak = _step_peak(foreach=True)
    weights, guard, _, recoveries = _run(3, budget_bytes=peak - W // 2, snapshot="always", foreach=True)
    assert guard.mode == MODES[1] and len(recoveries) == 1
    assert all(torch.equal(a, b) for a, b in zip(base, weights))


def test_state_that_does_not_fit_raises_with_the_state_put_back():
    """A bare torch optimizer (no accelerate wrapper) is not replaced: the error says why, nothing changed."""
    model = _model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, fused=True)
    _grads(model, 0)
    before = [p.detach().clone() for p in model.parameters()]
    trainer = types.SimpleNamespace(optimizer=opt, state=types.SimpleNamespace(global_step=0),
                                    args=types.SimpleNamespace(optim="adamw_torch_fused"))
    budget = memory_budget(3 * W, count=(model, opt))
    recoveries = []
    guard = OptimizerStepGuard(trainer, meter=Meter(budget), recoveries=recoveries, on_change=lambda s: None,
                               snapshot="never")
    guard.install()
    with pytest.raises(torch.OutOfMemoryError, match="does not fit next to the weights") as err, budget:
        opt.step()
    assert "not accelerate's AcceleratedOptimizer" in str(err.value)
    assert not recoveries and guard.mode == MODES[0]  # the fused step has no temporaries to avoid
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
    assert not opt.state  # the partially created state was dropped (proven untouched, no copy needed)
    guard.uninstall()
    assert "step" not in vars(opt)


# -- a real Trainer: the first step cannot create AdamW's state --------------------------------------------

from helpers import bigger_trainer as _bigger_trainer  # noqa: E402


@pytest.mark.slow
def test_trainer_switches_to_a_smaller_optimizer_before_any_state_exists(tmp_path):
    import memfit.fitting.run as mf

    ada = _bigger_trainer(tmp_path / "ada", "adafactor")
    ada_report = mf.fit(ada, plan=False, budget_bytes=1 << 30)
    adamw = _bigger_trainer(tmp_path / "adamw", "adamw_torch_fused")
    adamw_report = mf.fit(adamw, plan=False, budget_bytes=1 << 30)
    ada_peak = max(v["measured_bytes"] for v in ada_report.phases.values() if v["measured_bytes"])
    adamw_step = adamw_report.phases["optimizer"]["measured_bytes"]
    budget = (ada_peak + adamw_step) // 2
    assert ada_peak < budget < adamw_step

    t = _bigger_trainer(tmp_path / "run", "adamw_torch_fused")
    report = mf.fit(t, plan=False, budget_bytes=budget)
    assert [(r["phase"], r["step"]) for r in report.oom_recoveries] == [("optimizer", 0)]
    assert "Adafactor" in report.oom_recoveries[0]["change"]
    assert str(t.args.optim.value if hasattr(t.args.optim, "value") else t.args.optim) == "adafactor"
    assert report.steps_completed == report.steps_expected == ada_report.steps_completed
    # from step 0 on it is the Adafactor run: same learning rates, same updates
    assert all(torch.equal(a, b) for a, b in zip(ada.model.parameters(), t.model.parameters()))
    assert max(v["measured_bytes"] or 0 for v in report.phases.values()) <= budget


def test_trainer_without_switch_permission_stops_with_the_fix(tmp_path):
    import memfit.fitting.run as mf

    probe = _bigger_trainer(tmp_path / "probe", "adamw_torch_fused")
    step_peak = mf.fit(probe, plan=False, budget_bytes=1 << 30).phases["optimizer"]["measured_bytes"]
    t = _bigger_trainer(tmp_path / "run", "adamw_torch_fused")
    with pytest.raises(torch.OutOfMemoryError, match="allow_optimizer_switch=False"):
        mf.fit(t, plan=False, budget_bytes=int(step_peak * 0.8), allow_optimizer_switch=False)


def test_bad_snapshot_policy_is_a_clear_error():
    from memfit.fitting.run import fit

    with pytest.raises(MemfitError, match="optimizer_snapshot `'sometimes'`"):
        fit(object(), optimizer_snapshot="sometimes")
    with pytest.raises(MemfitError, match="allow_optimizer_switch `'no'` is not a bool"):
        fit(object(), allow_optimizer_switch="no")
