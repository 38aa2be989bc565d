"""Benchmark: memfit vs PyTorch's MemTracker on the same fake-tensor training step.

Run from the repository root (venv active):

    python bench/speed_vs_memtracker.py            # 3 repeats each (MemTracker: 1 if one run is slow)
    python bench/speed_vs_memtracker.py --repeats 5 --memtracker-repeats 3

Both sides simulate one Trainer training step of xlnet-large-cased (sequence
classification, 2 labels, batch 1, 512 tokens, fp32, `torch.optim.AdamW(foreach=True)`
over Trainer's two weight-decay groups, `clip_grad_norm_(max_norm=1.0, foreach=True)`):
weights on the device, forward, backward, clipping, optimizer.step(),
zero_grad(set_to_none=True), on FakeTensors (no data, no real memory).

- memfit: `memfit.sim.engine.simulate(setup, optimizer_steps=1)`, peak of the trace in raw
  tensor bytes (`peaks(trace, round_to=1)`).
- MemTracker: `torch.distributed._tools.mem_tracker.MemTracker` under
  `torch._subclasses.fake_tensor.FakeTensorMode`, on the model memfit builds
  (`memfit.models.build.build_meta_model`), materialised with `to_empty(device="cpu")` in the
  fake mode. MemTracker counts per-device storage bytes; on the (fake) CPU device it does
  not round to 512 bytes, so both sides count raw bytes.

The script checks that the two peaks agree within 1% (exit status 1 if not), prints both
breakdowns by category, the timings (medians), the full memfit estimate of the same setup
(2 optimizer steps + evaluation), and a 7B Llama estimate run in a child process (wall
time and max RSS of that process only). The last line is `speedup_vs_memtracker=<ratio>`
(median MemTracker wall time / median memfit wall time).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import resource
import statistics
import subprocess
import sys
import time
import warnings

TOLERANCE = 0.01

XLNET = dict(model="xlnet-large-cased", task="seq-cls", num_labels=2, per_device_train_batch_size=1,
             gradient_accumulation_steps=1, max_length=512, precision="fp32", optim="adamw_torch",
             eval_strategy="no")
LLAMA7B = dict(model="meta-llama/Llama-2-7b-hf", task="causal-lm", per_device_train_batch_size=1,
               gradient_accumulation_steps=1, max_length=512, precision="bf16", eval_strategy="no")


# -- memfit --------------------------------------------------------------------------------
def memfit_step(setup):
    """One training step with memfit; returns (raw peak bytes, breakdown at the peak, phase)."""
    from memfit.peaks import peaks
    from memfit.sim.engine import simulate

    sim = simulate(setup, optimizer_steps=1)
    p = peaks(sim.trace, round_to=1)
    return p.overall.bytes, dict(p.overall.breakdown), p.phase_of_peak


def memfit_full(setup):
    from memfit.peaks import peaks
    from memfit.sim.engine import simulate

    sim = simulate(setup)  # default: 2 optimizer steps (+ evaluation when eval_strategy != "no")
    return peaks(sim.trace).overall.bytes  # allocator-rounded, as `memfit estimate` reports


# -- MemTracker ----------------------------------------------------------------------------
def _trainer_param_groups(model, weight_decay: float):
    """Trainer.create_optimizer's two groups (decay / no decay), as Trainer computes them."""
    from transformers import Trainer

    decay = set(Trainer.get_decay_parameter_names(None, model))
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    groups = [
        {"params": [p for n, p in named if n in decay], "weight_decay": weight_decay},
        {"params": [p for n, p in named if n not in decay], "weight_decay": 0.0},
    ]
    return [g for g in groups if g["params"]]


def _peak_probe_class():
    from torch.distributed._tools.mem_tracker import MemTracker

    class PeakProbeMemTracker(MemTracker):
        """MemTracker that also notes how many optimizer states existed when its peak was last raised.

        Only observes: the peak itself is MemTracker's own. Needed to subtract the CPU `step`
        tensors that were alive at the peak (see `memtracker_step`).
        """

        def __init__(self, optimizer) -> None:
            super().__init__()
            self._probe_optimizer = optimizer
            self.states_at_peak = 0

        def _update_peak_stats(self, peak_state) -> None:
            before = sum(self._peak_mem.values())
            super()._update_peak_stats(peak_state)
            if sum(self._peak_mem.values()) != before:
                self.states_at_peak = len(self._probe_optimizer.state)

    return PeakProbeMemTracker


def memtracker_step(setup):
    """The same step under MemTracker; returns (aligned peak bytes, raw snapshot, step-tensor bytes)."""
    import torch
    from torch._subclasses.fake_tensor import FakeTensorMode

    from memfit.models.build import build_meta_model

    model = build_meta_model(setup)  # the exact module memfit simulates, on the meta device
    seq, batch_size = setup.max_length, setup.per_device_train_batch_size
    with FakeTensorMode(allow_non_fake_inputs=True):
        model.to_empty(device="cpu")  # model.to("cuda"): every parameter becomes an allocation
        # Trainer: optim="adamw_torch" -> torch.optim.AdamW(lr=5e-5, betas=(0.9, 0.999), eps=1e-8);
        # foreach=True is what CUDA picks by default (and what memfit simulates).
        optimizer = torch.optim.AdamW(_trainer_param_groups(model, setup.weight_decay), lr=5e-5,
                                      betas=(0.9, 0.999), eps=1e-8, foreach=True)
        mt = _peak_probe_class()(optimizer)
        mt.track_external(model, optimizer)  # weights/buffers exist before the tracker is entered
        with mt:
            # Trainer keeps the running loss on the device (memfit counts this 4-byte scalar too).
            tr_loss = torch.tensor(0.0)
            model.train()
            # DataCollatorWithPadding's batch moved to the device (memfit counts it as `inputs`).
            batch = {
                "input_ids": torch.zeros(batch_size, seq, dtype=torch.long),
                "attention_mask": torch.ones(batch_size, seq, dtype=torch.long),
                "token_type_ids": torch.zeros(batch_size, seq, dtype=torch.long),
                "labels": torch.zeros(batch_size, dtype=torch.long),
            }
            out = model(**batch)
            loss = out["loss"]
            del out, batch
            loss.backward()
            tr_loss = tr_loss + loss.detach()
            del loss
            grad_norm = None
            if setup.max_grad_norm > 0:
                # accelerator.clip_grad_norm_ -> torch.nn.utils.clip_grad_norm_ (foreach on CUDA).
                # Trainer keeps the returned total-norm tensor (`_grad_norm`, for logging) alive
                # through optimizer.step(); memfit does too (4 bytes).
                grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), setup.max_grad_norm, foreach=True)
            optimizer.step()
            model.zero_grad(set_to_none=True)
            del grad_norm, tr_loss
        snap = mt.get_tracker_snapshot("peak")
        # Non-fused, non-capturable torch.optim keeps `state["step"]` as a CPU tensor even on a
        # CUDA run (torch/optim/adam.py `_init_group`), so those bytes never reach the GPU and
        # memfit leaves them out of its trace (category "host"). Under FakeTensorMode on the CPU
        # MemTracker cannot tell them apart and counts them as optimizer state (Optstate). AdamW
        # initialises each param group's state right before updating that group, so only the
        # `step` tensors of the states that existed when the peak was reached are in the peak:
        # the probe notes that count, and they are subtracted (4 bytes each, a few hundred bytes).
        states = list(optimizer.state.values())[: mt.states_at_peak]
        step_bytes = sum(
            st["step"].untyped_storage().nbytes() for st in states if isinstance(st.get("step"), torch.Tensor)
        )
    devices = list(snap)
    if len(devices) != 1:
        raise RuntimeError(f"expected one device in MemTracker's peak snapshot, got {devices}")
    dev_snap = {str(getattr(k, "value", k)): v for k, v in snap[devices[0]].items()}
    total = dev_snap["Total"]
    return total - step_bytes, dev_snap, step_bytes


# -- timing helpers --------------------------------------------------------------------------
def timed(fn, *args):
    gc.collect()
    t0 = time.perf_counter()
    out = fn(*args)
    return time.perf_counter() - t0, out


def llama7b_child() -> None:
    """Run in a subprocess: wall time and max RSS of a 7B Llama estimate, as JSON on stdout."""
    t0 = time.perf_counter()
    from memfit.peaks import peaks
    from memfit.sim.engine import simulate
    from memfit.train_setup import TrainSetup

    t_import = time.perf_counter() - t0
    setup = TrainSetup(**LLAMA7B)
    t1 = time.perf_counter()
    sim = simulate(setup)
    t_sim = time.perf_counter() - t1
    peak = peaks(sim.trace).overall.bytes
    maxrss_kb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux
    print(json.dumps({"simulate_s": t_sim, "import_s": t_import, "process_s": time.perf_counter() - t0,
                      "maxrss_mb": maxrss_kb / 1024, "peak_bytes": peak}))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=3, help="memfit repeats (median reported)")
    ap.add_argument("--memtracker-repeats", type=int, default=3,
                    help="MemTracker repeats (median reported); cut to 1 if the first run exceeds --slow-s")
    ap.add_argument("--slow-s", type=float, default=60.0, help="a MemTracker run slower than this is not repeated")
    ap.add_argument("--skip-llama", action="store_true", help="skip the 7B Llama child process")
    ap.add_argument("--llama7b-child", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    warnings.simplefilter("ignore")
    if args.llama7b_child:
        llama7b_child()
        return 0

    from memfit.train_setup import TrainSetup

    setup = TrainSetup(**XLNET)
    setup_eval = TrainSetup(**{**XLNET, "eval_strategy": "epoch"})
    print(f"setup: {XLNET} max_grad_norm={setup.max_grad_norm} weight_decay={setup.weight_decay}")

    # Warm-up (imports, transformers module loading, config resolution) outside the timings.
    t_warm, _ = timed(memfit_step, setup)
    print(f"memfit warm-up run (imports, first use): {t_warm:.2f} s (not counted)")

    mf_times, mf_res = [], None
    for _ in range(max(1, args.repeats)):
        dt, mf_res = timed(memfit_step, setup)
        mf_times.append(dt)
    mf_peak, mf_breakdown, mf_phase = mf_res

    mt_times, mt_res = [], None
    for i in range(max(1, args.memtracker_repeats)):
        dt, mt_res = timed(memtracker_step, setup)
        mt_times.append(dt)
        if i == 0 and dt > args.slow_s and args.memtracker_repeats > 1:
            print(f"MemTracker is slow ({dt:.1f} s > {args.slow_s:.0f} s): 1 repeat only")
            break
    mt_peak, mt_snap, mt_step_bytes = mt_res

    full_times, full_peak = [], None
    for _ in range(max(1, args.repeats)):
        dt, full_peak = timed(memfit_full, setup_eval)
        full_times.append(dt)

    mf_s, mt_s, full_s = (statistics.median(x) for x in (mf_times, mt_times, full_times))
    rel = abs(mf_peak - mt_peak) / max(mt_peak, 1)

    print(f"memfit peak breakdown (raw bytes, phase {mf_phase}): {mf_breakdown}")
    print(f"MemTracker peak snapshot (raw bytes): {mt_snap}")
    print(f"MemTracker optimizer `step` tensors subtracted (host memory on CUDA): {mt_step_bytes} B")
    print(f"memfit_step_runs_s={[round(t, 3) for t in mf_times]}")
    print(f"memtracker_step_runs_s={[round(t, 3) for t in mt_times]}")
    print(f"memfit_step_s={mf_s:.3f}")
    print(f"memtracker_step_s={mt_s:.3f}")
    print(f"memtracker_repeats={len(mt_times)}")
    print(f"memfit_peak_bytes={mf_peak}")
    print(f"memtracker_peak_bytes={mt_peak}")
    print(f"memtracker_peak_bytes_unaligned={mt_snap['Total']}")
    print(f"peak_abs_diff_bytes={mf_peak - mt_peak}")
    print(f"peak_rel_diff={rel:.3e}")
    print(f"memfit_full_estimate_s={full_s:.3f}  (2 optimizer steps + eval_strategy=epoch; "
          f"runs {[round(t, 3) for t in full_times]}; peak {full_peak} B allocator-rounded)")

    if not args.skip_llama:
        proc = subprocess.run([sys.executable, os.path.abspath(__file__), "--llama7b-child"],
                              capture_output=True, text=True)
        if proc.returncode != 0:
            print(f"llama7b child failed (rc={proc.returncode}):\n{proc.stderr[-4000:]}")
        else:
            info = json.loads(proc.stdout.strip().splitlines()[-1])
            print(f"llama7b_s={info['simulate_s']:.3f}  (simulate(); whole child process "
                  f"{info['process_s']:.2f} s incl. {info['import_s']:.2f} s imports; target < 10 s)")
            print(f"llama7b_maxrss_mb={info['maxrss_mb']:.1f}  (target < 2048 MB)")
            print(f"llama7b_peak_bytes={info['peak_bytes']}")

    ok = rel <= TOLERANCE
    if not ok:
        print(f"PEAK MISMATCH: memfit {mf_peak} vs MemTracker {mt_peak} ({rel:.2%} > {TOLERANCE:.0%}); "
              "compare the breakdowns above")
    print(f"speedup_vs_memtracker={mt_s / mf_s:.2f}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
