"""`memfit estimate MODEL`: peak GPU memory of fine-tuning MODEL, without a GPU or weights.

    memfit estimate                                   # the built-in example (xlnet-large-cased on a V100)
    memfit estimate bert-base-uncased --gpu T4 --check  # exit 1 when it does not fit (CI)
    memfit estimate xlnet-large-cased --task seq-cls --num-labels 2 --batch-size 1 --max-length 512
    memfit estimate meta-llama/Llama-3.2-1B --task causal-lm --precision bf16 --gpu A100-40GB --json
"""

from __future__ import annotations

import argparse
import json
import sys

from memfit.errors import MemfitError
from memfit.units import format_bytes

__all__ = ["estimate_command_parser", "estimate_command", "add_setup_arguments", "build_setup", "SEED_CASE",
           "SEED_CASE_TEXT", "check_line"]

#: The built-in default of `memfit estimate` / `memfit plan` without a model: fine-tuning xlnet-large-cased for
#: 2-label sequence classification, batch 1 x accumulation 16, 512 tokens, evaluation every epoch, on a 16 GB V100.
SEED_CASE = {
    "model": "xlnet-large-cased", "task": "seq-cls", "num_labels": 2,
    "training_args": {"evaluation_strategy": "epoch", "save_strategy": "epoch", "learning_rate": 2e-5,
                      "per_device_train_batch_size": 1, "per_device_eval_batch_size": 1,
                      "num_train_epochs": 3, "gradient_accumulation_steps": 16, "weight_decay": 0.01},
    "max_length": 512, "gpu": "V100-16GB",
}


def estimate_command_parser(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "estimate", help="peak GPU memory of a fine-tuning run (no GPU, no weights)",
        description="Simulate a Hugging Face Trainer fine-tuning run on fake tensors and report its peak GPU "
                    "memory per phase and by category. Without MODEL: a built-in example (fine-tuning "
                    "xlnet-large-cased on a 16 GB V100, batch 1 x accumulation 16, 512 tokens). Exit codes: 0 done, "
                    "1 does not fit (with --check), 2 bad input.",
    )
    add_setup_arguments(p)
    from memfit.commands._args import add_parallel_arguments  # multi-GPU flags

    add_parallel_arguments(p)
    p.add_argument("--list-models", action="store_true", help="list the bundled model ids and exit")
    p.add_argument("--snapshot", default=None, metavar="FILE.pickle",
                   help="also write the simulated run as a torch.cuda.memory snapshot (open it at pytorch.org/memory_viz)")
    p.add_argument("--html", default=None, metavar="FILE.html",
                   help="also write the memory timeline, the breakdown at the peak and what nvidia-smi shows as one "
                        "self-contained HTML file (works offline)")
    p.add_argument("--plot", default=None, metavar="FILE.png|FILE.svg",
                   help="also write the memory timeline as a static picture (matplotlib: the `viz` extra)")
    p.add_argument("--check", action="store_true",
                   help="exit 1 (with one line on stderr) when the run does not fit --gpu, for scripts and CI")
    p.add_argument("--no-cache", action="store_true",
                   help="simulate even when memfit's cache ($MEMFIT_CACHE_DIR, else ~/.cache/memfit) holds the result")
    p.set_defaults(func=estimate_command)
    return p


def add_setup_arguments(p: argparse.ArgumentParser, *, model_option: bool = False) -> None:
    """The model, the setup flags (memfit.commands._setup_flags: one per TrainSetup field) and `--args`, shared
    by `estimate`, `plan` and `diagnose`; `--gpu`, `--alloc-conf` and `--json` too unless `model_option`
    (diagnose, whose `--model` names the run that failed)."""
    from memfit.commands._setup_flags import add_setup_flags

    model_help = "hub id (bundled ones work offline), model directory, or config.json"
    if model_option:
        p.add_argument("--model", default=None, help=model_help + " of the run that failed")
    else:
        p.add_argument("model", nargs="?", help=model_help)
    add_setup_flags(p)
    p.add_argument("--args", dest="args_file", default=None, help="JSON file of TrainingArguments kwargs and memfit settings (\"model\", \"max_length\", ...); "
                        "legacy names are read with a note, unknown names are an error; a flag wins over the file")
    if model_option:
        return
    from memfit.commands._data import add_data_arguments

    add_data_arguments(p)  # --data FILE --tokenizer ID|DIR: the worst batch of the user's data
    p.add_argument("--gpu", default=None, help="V100-16GB, A100-80GB, ..., a size like 24GiB, or auto")
    p.add_argument("--alloc-conf", default=None, help="PYTORCH_CUDA_ALLOC_CONF to model (default: the environment's)")
    p.add_argument("--json", action="store_true", help="print the report as JSON (schema in README)")


def build_setup(args: argparse.Namespace):
    from memfit.commands._setup_flags import setup_fields
    from memfit.train_setup import TrainSetup

    fields = setup_fields(args)
    gpu = getattr(args, "gpu", None)
    # the task from memfit's cache, so a cached estimate or plan never imports transformers
    use_cache = getattr(getattr(args, "func", None), "__name__", None) in ("estimate_command", "plan_command") \
        and not getattr(args, "no_cache", False)
    if args.args_file:  # memfit.commands._args: the reader of every verb
        from memfit.commands._args import read_args

        data, notes = read_args(args.args_file, fields.get("trainer"))  # --trainer: that TRL config's names too
        from memfit.train_setup import ENGINE_ARG_NAMES

        # the engine (deepspeed, fsdp, ...) is read by commands._args.parallel_from_args, the same reader as the flags
        engine = [k for k in ENGINE_ARG_NAMES if data.get(k) not in (None, "", [], {}, False)]
        data = {k: v for k, v in data.items() if k not in ENGINE_ARG_NAMES}
        if engine and getattr(getattr(args, "func", None), "__name__", None) != "estimate_command":
            notes.append(f"`{engine[0]}` of `{args.args_file}` is read by `memfit estimate --gpus ...` (the engine of "
                         f"a run you have); `memfit {getattr(args, 'verb', None) or 'plan'}` does not use it")
        if args.model is None and data.get("model") is None:
            flag = "--model MODEL" if getattr(args, "verb", None) == "diagnose" else "MODEL"
            raise MemfitError(f"`--args {args.args_file}` names no model: pass {flag} as well, or put "
                              f"\"model\": \"<hub id or directory>\" in the file")
        fields["notes"] = notes
        if use_cache and "task" not in fields and data.get("task") is None \
                and "reward" not in (fields.get("trainer"), data.get("trainer")):  # reward: TrainSetup picks seq-cls
            _cached_task(args.model if args.model is not None else data.get("model"), fields)
        return TrainSetup.from_kwargs(args.model, training_args=data, args_source=f"`{args.args_file}`",
                                      **fields), gpu, False
    if args.model is None:
        seed = dict(SEED_CASE)
        gpu = gpu or seed.pop("gpu")
        seed.pop("gpu", None)
        training_args = seed.pop("training_args")
        model = seed.pop("model")
        seed.update(fields)
        return TrainSetup.from_kwargs(model, training_args=training_args, **seed), gpu, True
    if use_cache and "task" not in fields and fields.get("trainer") != "reward":  # reward: TrainSetup picks seq-cls
        _cached_task(args.model, fields)
    return TrainSetup.from_kwargs(args.model, **fields), gpu, False


def _cached_task(model, fields: dict) -> None:
    """Set `task` (and its note, last, where TrainSetup would put it) from memfit's cache of model tasks, so
    that a cached estimate never imports transformers; nothing when the model cannot be keyed."""
    from memfit.cache import default_task

    found = default_task(model)
    if found is not None:
        fields["task"] = found[0]
        fields["notes"] = [*fields.get("notes", []), found[1]]


SEED_CASE_TEXT = ("No model given: the built-in example, fine-tuning xlnet-large-cased for 2-label classification "
                  "(batch 1 x accumulation 16, 512 tokens, evaluation every epoch) on a 16 GB V100; "
                  "pass a model id to estimate your own run.")


def estimate_command(args: argparse.Namespace) -> int:
    from memfit.estimator import estimate

    if args.list_models:
        from memfit.models.catalog import bundled_aliases, bundled_model_ids

        print("\n".join(bundled_model_ids()))
        print("\n".join(f"{alias} (same architecture as {target})" for alias, target in bundled_aliases().items()))
        return 0
    from memfit.commands._setup_flags import flag_name

    for name in ("per_device_train_batch_size", "per_device_eval_batch_size", "gradient_accumulation_steps",
                 "max_length", "num_labels", "lora_r", "eval_accumulation_steps", "eval_samples", "target_length"):
        value = getattr(args, name)
        if value is not None and value <= 0:
            raise MemfitError(f"`{flag_name(args, name)}` must be a positive integer; got `{value}`")
    if args.snapshot is not None:
        from memfit.allocator.export import check_snapshot_path

        check_snapshot_path(args.snapshot)  # fail before the simulation, not after it
    views = args.html is not None or args.plot is not None
    if views:
        from memfit.report import check_view_paths

        check_view_paths(html_path=args.html, plot_path=args.plot)  # fail before the simulation, not after it
    setup, gpu, is_seed = build_setup(args)
    from memfit.commands._data import apply_data

    setup = apply_data(args, setup)
    if args.check and gpu is None:
        raise MemfitError("`--check` needs a GPU to check against: pass `--gpu V100-16GB`, a size like `--gpu 24GiB`, "
                          "or `--gpu auto` on a machine with a GPU")
    from memfit.commands._args import parallel_from_args  # multi-GPU

    parallel, gpus_name = parallel_from_args(args, setup)
    if getattr(args, "accelerate_config", None):  # --accelerate-config FILE.yaml
        from memfit.commands._args import accelerate_from_args

        parallel, setup = accelerate_from_args(args, setup)
    if gpus_name is not None:
        if gpu is not None and args.gpu is not None and args.gpu != gpus_name:
            raise MemfitError(f"--gpu `{args.gpu}` and --gpus `{args.gpus}` name different GPUs; give one")
        gpu = gpus_name
    from memfit.commands._progress import progress

    what = f"simulating rank 0 of {parallel.world_size} ({parallel.strategy})" if parallel is not None else ""
    with progress(f"{setup.model}: {what}", json_output=args.json, enabled=parallel is not None,  # multi-GPU: long
                  details=True):
        report = estimate(setup, gpu=gpu, alloc_conf=args.alloc_conf, parallel=parallel,
                          cache=not args.no_cache and args.snapshot is None and not views)  # these need the trace
    if args.snapshot is not None:
        from memfit.allocator.export import write_run_snapshot

        write_run_snapshot(report.trace, args.snapshot, alloc_conf=args.alloc_conf)
        print(f"memfit estimate: snapshot of the simulated run written to {args.snapshot} "
              "(open it at https://pytorch.org/memory_viz)", file=sys.stderr)
    if views:
        from memfit.report import write_views

        for path in write_views(report, html_path=args.html, plot_path=args.plot):
            print(f"memfit estimate: {path} written", file=sys.stderr)
    if args.json:
        json.dump(report.to_json(), sys.stdout, indent=2)
        print()
    else:
        render(report, is_seed=is_seed)
        if report.parallel is not None:  # multi-GPU
            par = report.parallel
            same = "the others hold the same" if not par.get("ranks") else "ranks that differ below"
            print(f"per rank ({par['strategy']}, {par['world_size']} GPUs on {par['nodes']} node(s); rank 0 shown, "
                  f"{same}): nvidia-smi per GPU {format_bytes(par['nvidia_smi_per_gpu_bytes'])} "
                  f"(NCCL {format_bytes(par['nccl_bytes'])}); host memory for offload "
                  f"{format_bytes(par['host_bytes_per_rank'])} per rank, {format_bytes(par['host_bytes_per_node'])} per node")
            if par.get("replicas", 1) > 1:  # hybrid sharding
                print(f"  hybrid sharding: each node's {par['shard_group_size']} GPUs hold one sharded copy; "
                      f"{par['replicas']} replicas across nodes (what is per rank above: 1/{par['shard_group_size']} "
                      "of the model states)")
            ranks = par.get("ranks") or []  # ranks that differ (ZeRO-2): rank 0's and the worst
            shown = ranks[:1] + [max(ranks, key=lambda d: d["peak_allocated_bytes"])] if ranks else []
            for d in ({id(d): d for d in shown}).values():
                print(f"  rank(s) {', '.join(map(str, d['ranks'][:8]))}{' ...' if len(d['ranks']) > 8 else ''}: "
                      f"peak allocated {format_bytes(d['peak_allocated_bytes'])} (gradient partition "
                      f"{format_bytes(d['grads_in_partition_bytes'])})")
            if len(ranks) > 2:
                print(f"  ({len(ranks)} distinct rank layouts in all: --json lists them)")
    if args.check and not report.fits:
        print(f"memfit estimate --check: {check_line(report)}", file=sys.stderr)
        return 1
    return 0


def check_line(report) -> str:
    """One line saying that (and by how much) the run does not fit its GPU."""
    gpu = report.gpu["name"] if report.gpu else "the GPU"
    if report.shortfall_bytes is not None:
        return (f"does not fit {gpu}: short by {format_bytes(report.shortfall_bytes)} (needs "
                f"{format_bytes(report.required_bytes + report.non_pytorch_bytes)} of GPU memory)")
    return f"does not fit {gpu}"


def reserved_lines(report) -> list[str]:
    """The text lines about reserved memory: on the GPU (or the smallest one), the steady state."""
    out = []
    cached_free = report.reserved_at_peak_allocated_bytes - report.peak_allocated_bytes
    frag = (f"(at the allocated peak above: reserved {format_bytes(report.reserved_at_peak_allocated_bytes)}, of which "
            f"{format_bytes(max(0, cached_free))} cached for reuse: freed blocks the allocator keeps, not lost)")
    if report.gpu is not None:
        until = ", until the OOM" if report.oom is not None else ""
        out.append(f"peak reserved (caching allocator, {format_bytes(report.capacity_bytes)} available to PyTorch"
                   f"{until}): {format_bytes(report.peak_reserved_bytes)}  {frag}")
    else:
        out.append(f"needs {format_bytes(report.required_bytes)} available to PyTorch (the smallest memory at which "
                   "the allocator replay completes, to 2 MiB or 1/256); peak reserved there: "
                   f"{format_bytes(report.peak_reserved_bytes)}  {frag}")
    st = report.steady_state
    in_trace = report.oom is not None and st is not None and st.oom_step is not None and st.oom_step <= 2
    if st is not None and not in_trace:  # an OOM in the two simulated steps is reported below
        if st.oom_step is not None:
            out.append(f"steady state (long run): optimizer step {st.oom_step} runs out of memory "
                       f"(reserved up to then {format_bytes(st.reserved_bytes)})")
        elif st.settled_after_steps is not None:
            out.append(f"steady state (long run): reserved {format_bytes(st.reserved_bytes)}, settled after "
                       f"{st.settled_after_steps} optimizer steps (the two simulated: "
                       f"{format_bytes(st.two_step_reserved_bytes)})")
        else:
            out.append(f"steady state (long run): reserved {format_bytes(st.reserved_bytes)} after "
                       f"{st.steps_replayed} optimizer steps, still changing from step to step (the two simulated: "
                       f"{format_bytes(st.two_step_reserved_bytes)})")
    return out


def quantization_lines(report) -> list[str]:
    """The quantized weights' part of the breakdown: their storage, what stays in higher precision,
    the dequantization temporaries, paged optimizer state."""
    q = getattr(report, "quantization", None)
    out = []
    if q:
        kind = f"{q['bits']}-bit" + (f" {q['quant_type']}" if q.get("quant_type") else "")
        out.append(f"quantized weights ({q['method']}, {kind}): {q['quantized_params'] / 1e6:,.1f} M params in "
                   f"{q['quantized_modules']} layers, {format_bytes(q['quantized_bytes'])} with their quant state")
        for dtype, entry in sorted(q.get("higher_precision", {}).items()):
            out.append(f"  kept in {dtype}: {entry['params'] / 1e6:,.1f} M params, {format_bytes(entry['bytes'])}")
        out.append(f"  dequantization temporaries (inside bitsandbytes ops): "
                   f"{format_bytes(q.get('dequant_temporaries_at_peak_bytes', 0))} at the peak, "
                   f"{format_bytes(q.get('dequant_temporaries_max_bytes', 0))} at most")
    if getattr(report, "paged_bytes", 0):
        out.append(f"paged optimizer state (CUDA managed memory, not in the figures above): "
                   f"{format_bytes(report.paged_bytes)}")
    return out


def parts_lines(report) -> list[str]:
    """An image or speech model's weights and activations at the peak by part (memfit.sim.media_peak)."""
    parts = (getattr(report, "media_inputs", None) or {}).get("parts_at_peak")
    if not parts:
        return []
    out = ["at the peak by part of the model (weights + activations; gradients, optimizer state and the backward's "
           "temporaries are not split):"]
    for p in parts:
        if p["part"] == "other" and not (p["weights_bytes"] or p["activations_bytes"]):
            continue
        where = f" (`{p['path']}`)" if p["path"] else " (under no part: a top-level head, tied embeddings, inputs)"
        out.append(f"  {p['part']}{where}: weights {format_bytes(p['weights_bytes'])}, activations "
                   f"{format_bytes(p['activations_bytes'])}")
    return out


def _example_text(report) -> str:
    """What one example of the batch is: its tokens, or the image / clip its processor made (with its tokens for
    a seq2seq decoder)."""
    s, media = report.setup, getattr(report, "media_inputs", None)
    if not media:
        return f"{s['sequence_length']} tokens"
    if media.get("kind") == "image-text":  # a vision-language model: the sequence its processor made
        n = media["images_per_example"]
        crops = f"1 + {media['crops_per_image']} pan-and-scan crops, " if "crops_per_image" in media else ""
        return (f"{media['sequence_length']} tokens ({n} {media['image_size']} image{'s' if n > 1 else ''} -> "
                f"{crops}{media['image_tokens_per_image']} image tokens each + {media['text_tokens']} text)")
    if media.get("kind") == "video-text":  # one clip through the model's video processor (models.video_inputs)
        return (f"{media['sequence_length']} tokens (a clip of {media['video_frames']} {media['image_size']} frames -> "
                f"{media['video_tokens_per_clip']} video tokens + {media['text_tokens']} text)")
    if media.get("kind") == "image":
        shape = "x".join(map(str, media["inputs"].get("pixel_values", [])))
        return f"{media['image_size']} image -> pixel_values {shape}"
    positions = f", {media['encoder_positions']} encoder positions" if "encoder_positions" in media else ""
    labels = f" + {s['target_length'] or s['max_length']} label tokens" if report.task == "speech-seq2seq" else ""
    if "label_length" in media:  # ctc: the transcript's characters
        labels = f" + {media['label_length']} label characters"
    return f"{media['audio_seconds']:g} s clip{positions}{labels}"


def rl_lines(report) -> list[str]:
    """GRPO / RLOO: the generation batch, the KV cache of generate, the reference copy, vLLM's share."""
    rl = getattr(report, "rl", None)
    if not rl:
        return []
    out = [f"{str(rl.get('trainer', 'grpo')).upper()}: {rl['generation_batch_size']} completions generated at once ({rl['num_generations']} per prompt), "
           f"{rl['steps_per_generation']} micro-steps per generation, prompts {rl['prompt_tokens']} + completions "
           f"{rl['completion_tokens']} tokens; reference copy of the weights: {'yes' if rl['reference_copy'] else 'no'}"
           f"; old log-probs kept: {'yes' if rl['old_log_probs'] else 'no'}"
           f"{'; reward model on the GPU: ' + rl['reward_model'] if rl.get('reward_model') else ''}"]
    if rl.get("kv_cache_bytes") is not None:
        out.append(f"  KV cache of generate at the last token (2 x layers x kv_heads x head_dim x tokens x batch x "
                   f"bytes): {format_bytes(rl['kv_cache_bytes'])}")
    v = rl.get("vllm")
    if v:
        if v["mode"] == "server":
            out.append("  vLLM share: none on this GPU (vllm_mode=server: `trl vllm-serve` generates on other GPUs, "
                       "each holding vllm_gpu_memory_utilization of its memory)")
        else:
            sleep = (" during generation only (sleep mode level 2 releases it while training)" if v["sleep"]
                     else ", held all along (no sleep mode): the training step has what remains")
            out.append(f"  vLLM share (colocate, {v['utilization']:g} x the card): "
                       f"{format_bytes(v['generation_bytes'])}{sleep}")
            if "device_used_at_generation_bytes" in v:
                out.append(f"  nvidia-smi while vLLM generates: ~{format_bytes(v['device_used_at_generation_bytes'])}"
                           f" (training holds {format_bytes(v['training_held_at_generation_bytes'])} then)")
    return out


def render(report, *, is_seed: bool = False) -> None:
    from rich.console import Console
    from rich.table import Table

    console = Console()
    s = report.setup
    title = f"memfit estimate: {report.model} ({report.task})"
    if is_seed:
        console.print(f"[dim]{SEED_CASE_TEXT}[/dim]", markup=True)
    if "backend:cudaMallocAsync" in (report.alloc_conf or ""):
        from memfit.estimator import CUDA_MALLOC_ASYNC_NOTE

        console.print(f"[yellow]warning:[/yellow] {CUDA_MALLOC_ASYNC_NOTE}", markup=True)
    console.print(f"[bold]{title}[/bold]")
    console.print(
        f"params {report.params / 1e6:,.1f} M (trainable {report.trainable_params / 1e6:,.1f} M) | "
        f"batch {s['per_device_train_batch_size']} x accumulation {s['gradient_accumulation_steps']} x "
        f"{_example_text(report)} | {s['precision']} | {s['optim']}"
        + (f" | checkpointing: {report.checkpointing}" if report.checkpointing else "")
        + (f" | SDPA: {', '.join(report.sdpa_backends)}" if report.sdpa_backends else "")
        + (f" | emulated: {', '.join(report.emulated_kernels)}" if report.emulated_kernels else "")
    )
    phases = Table(title="Peak allocated per phase", title_justify="left")
    phases.add_column("phase")
    phases.add_column("allocated", justify="right")
    phases.add_column("reserved", justify="right")
    rl = getattr(report, "rl", None)
    shown = ("generation", "scoring") if rl is not None else ()  # GRPO / RLOO: before the training micro-steps
    if rl is None and report.phases.get("generation"):  # distillation generates, and scores nothing
        shown = ("generation",)
    for phase in (*shown, "forward", "backward", "optimizer", "eval"):
        if phase == "generation" and "generation" not in report.phases:  # vLLM generates
            phases.add_row(phase, "in vLLM's share", "-")
            continue
        if phase == "eval" and not report.phases.get("eval"):
            phases.add_row(phase, "not run", "-")
            continue
        res = report.reserved_by_phase.get(phase, 0)
        if res is None:
            reserved = "not reached (OOM)"
        elif report.oom is not None and report.oom.phase == phase:  # the replay stops at the OOM: a lower figure
            reserved = f"{format_bytes(res)}, then OOM"
        else:
            reserved = format_bytes(res)
        phases.add_row(phase, format_bytes(report.phases.get(phase, 0)), reserved)
    console.print(phases)
    cats = Table(title=f"At the peak ({report.peak_phase})", title_justify="left")
    cats.add_column("category")
    cats.add_column("bytes", justify="right")
    cats.add_column("share", justify="right")
    for k, v in report.breakdown.items():
        if v or k != "workspaces":
            cats.add_row(k.replace("_", " "), format_bytes(v),
                         f"{100 * v / report.peak_allocated_bytes:.0f}%" if report.peak_allocated_bytes else "-")
    cats.add_row("[bold]allocated[/bold]", f"[bold]{format_bytes(report.peak_allocated_bytes)}[/bold]", "")
    console.print(cats)
    for line in parts_lines(report):
        console.print(line)
    for line in quantization_lines(report):
        console.print(line)
    for line in reserved_lines(report):
        console.print(line)
    for line in rl_lines(report):
        console.print(line)
    if report.gpu is not None:
        console.print(f"outside PyTorch (CUDA context, kernels): ~{format_bytes(report.non_pytorch_bytes)}")
        console.print(f"nvidia-smi would show: ~{format_bytes(report.device_used_bytes)} of "
                      f"{format_bytes(report.gpu['total_bytes'])} ({report.gpu['name']})")
        if report.fits:
            console.print(f"[green]fits[/green], headroom {format_bytes(report.headroom_bytes)}")
        else:
            if report.shortfall_bytes is not None:
                console.print(f"[red]does not fit[/red]: short by {format_bytes(report.shortfall_bytes)} "
                              f"(the run needs {format_bytes(report.required_bytes)} available to PyTorch, "
                              f"{format_bytes(report.required_bytes + report.non_pytorch_bytes)} of GPU memory)")
            else:
                console.print("[red]does not fit[/red]")
            if report.oom is not None:
                where = f"the {report.oom.phase} phase" + (
                    f" of optimizer step {report.oom.step}" if report.oom.step is not None else "")
                console.print(f"PyTorch would fail in {where} with:")
                console.print(f"[dim]{report.oom.message}[/dim]", soft_wrap=True)
    for note in report.notes:
        console.print(f"[yellow]note:[/yellow] {note}")
    if report.replay_conf is None:  # a report read from memfit's cache (its note says when it was simulated)
        console.print(f"[dim]from memfit's cache in {report.elapsed_s:.1f} s[/dim]")
    else:
        console.print(f"[dim]simulated in {report.elapsed_s:.1f} s[/dim]")
