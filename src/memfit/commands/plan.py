"""`memfit plan MODEL --gpu GPU`: the fastest configuration that fits, and the exact change.

    memfit plan                                        # the built-in example (xlnet-large-cased) on a V100-16GB
    memfit plan xlnet-large-cased --batch-size 1 --grad-accum 16 --max-length 2048 --gpu V100-16GB
    memfit plan meta-llama/Llama-3.2-1B --task causal-lm --gpu T4 --allow lora,truncation --json
    memfit plan meta-llama/Llama-3.2-3B --task causal-lm --gpus 4xA100-40GB --write-launch launch/   # across GPUs
    memfit plan gpt2-large --gpus 8xA100-40GB,4xH100-80GB              # which of these GPU kinds is fastest
"""

from __future__ import annotations

import argparse
import json
import sys

from memfit.commands._data import apply_data, data_note
from memfit.commands.estimate import add_setup_arguments, build_setup
from memfit.errors import MemfitError
from memfit.units import format_bytes

__all__ = ["plan_command_parser", "plan_command"]


def plan_command_parser(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "plan", help="the fastest configuration that fits a GPU, and the exact change",
        description="Search gradient checkpointing, mixed precision, optimizers, micro-batch vs accumulation, "
                     "evaluation and allocator settings, FlashAttention-2 and Liger kernels (and, with --allow, truncation, LoRA, QLoRA, freezing, offload) for "
                     "the fastest configuration that fits the GPU, verified by simulation. With --gpus 4xA100-40GB (or a budget "
                     "8xA100-40GB,4xH100-80GB): the fastest multi-GPU strategy (DDP, FSDP2, ZeRO-1/2/3, CPU offload last) "
                     "and micro-batch that rank 0's simulation verifies, and the files and command to launch it.",
    )
    add_setup_arguments(p)
    p.add_argument("--allow", default="", help="opt-in remedies: truncation, lora, qlora, freeze, offload; for image models: "
                        "smaller_images, freeze_vision_tower, no_pan_and_scan (Gemma 3 with --pan-and-scan); for Seq2Seq "
                        "predict_with_generate evaluation: fewer_beams, shorter_generation; with --trainer grpo: "
                        "fewer_generations, shorter_completions, no_reference, lora, qlora (comma-separated)")
    p.add_argument("--margin", type=float, default=None, help="fraction of the GPU kept free (default 0.05)")
    p.add_argument("--check", action="store_true",
                   help="exit 1 (with one line on stderr) when the setup as given does not fit, even when a plan "
                        "does; for scripts and CI")
    p.add_argument("--html", default=None, metavar="FILE.html",
                   help="also write every configuration simulated (memory against step time, the budget, the "
                        "chosen one and its change) as one self-contained HTML file (works offline)")
    p.add_argument("--no-cache", action="store_true",  # memfit.cache.plan_key
                   help="plan even when memfit's cache ($MEMFIT_CACHE_DIR, else ~/.cache/memfit) holds the result")
    # -- plan across GPUs --
    from memfit.commands._args import add_parallel_arguments

    add_parallel_arguments(p)
    g = p.add_argument_group("plan across GPUs (with --gpus / --world-size / --nodes)")
    g.add_argument("--interconnect", choices=("nvlink", "pcie"), default=None,
                   help="what joins the GPUs of a node (default: the GPU's, memfit.gpus.interconnect)")
    g.add_argument("--network-gbps", type=float, default=None,
                   help="Gb/s per node between nodes (default 100; DGX A100: 1600, DGX H100: 3200)")
    g.add_argument("--write-launch", default=None, metavar="DIR",
                   help="write the launch files (DeepSpeed JSON / fsdp_config / accelerate config) into DIR")
    g.add_argument("--force", action="store_true", help="with --write-launch: replace files that exist")
    g.add_argument("--script", default="train.py", help="the training script in the launch commands")
    g.add_argument("--max-simulations", type=int, default=None,
                   help="per-rank simulations before the search stops with the best found (default 24)")
    g.add_argument("--vllm-server-gpus", type=int, default=None, metavar="K",
                   help="GRPO / RLOO: run `trl vllm-serve` on exactly K of the GPUs, train on the others (default: "
                        "weigh vLLM colocated on all against a server on every K that holds the model)")
    p.set_defaults(func=plan_command)
    return p


def _is_parallel(args: argparse.Namespace) -> bool:
    return any(getattr(args, f, None) is not None for f in ("gpus", "world_size", "nodes"))


def _check_html(args: argparse.Namespace) -> None:
    if getattr(args, "html", None) is not None:
        from memfit.report import check_html_path

        check_html_path(args.html)  # fail before the search, not after it


def _write_html(args: argparse.Namespace, result) -> None:
    if getattr(args, "html", None) is not None and result is not None:
        from memfit.report import write_html
        from memfit.report.plan_view import render_plan_html

        print(f"memfit plan: {write_html(args.html, render_plan_html(result))} written", file=sys.stderr)


def plan_command(args: argparse.Namespace) -> int:
    from memfit.planner.search import DEFAULT_MARGIN, plan

    _check_html(args)
    if _is_parallel(args):
        return plan_parallel_command(args)
    for flag in ("strategy", "deepspeed", "fsdp", "fsdp_config", "write_launch", "interconnect", "network_gbps",
                 "vllm_server_gpus"):
        if getattr(args, flag, None) is not None:
            raise MemfitError(f"`--{flag.replace('_', '-')}` plans across GPUs: give the GPUs with `--gpus 4xA100-40GB` "
                              "(or `--world-size N --gpu GPU`)")
    setup, gpu, is_seed = build_setup(args)
    setup = apply_data(args, setup)  # --data: the worst batch of the user's data
    if gpu is None:
        raise MemfitError("`memfit plan` needs a GPU to plan for: pass `--gpu V100-16GB`, a size like `--gpu 24GiB`, "
                          "or `--gpu auto` on a machine with a GPU")
    from memfit.commands._progress import progress

    with progress(f"planning {setup.model} on {gpu}", json_output=args.json):
        result = plan(setup, gpu=gpu, allow=[a for a in args.allow.split(",") if a.strip()],
                      margin=DEFAULT_MARGIN if args.margin is None else args.margin, alloc_conf=args.alloc_conf,
                      cache=not args.no_cache)
    _write_html(args, result)
    if args.json:
        out = result.to_json()
        if data_note(args, setup):
            out["data"] = data_note(args, setup)
        json.dump(out, sys.stdout, indent=2, default=str)
        print()
    else:
        if data_note(args, setup):
            print(f"note: {data_note(args, setup)}")
        render(result, is_seed=is_seed)
    if args.check and not result.fits_as_is:
        fix = f"plan {result.chosen} fits" if result.chosen is not None else "no plan fits"
        print(f"memfit plan --check: the setup as given does not fit {result.gpu['name']} ({fix})", file=sys.stderr)
        return 1
    return 0 if (result.fits_as_is or result.chosen is not None) else 1


def short(changes: dict, env: dict | None = None) -> str:
    """Compact label of a plan's changes: `fp16, ckpt, b4x4, adafactor`."""
    out = []
    c = dict(changes)
    if "precision" in c:
        out.append(c.pop("precision"))
    ckpt = c.pop("gradient_checkpointing", None)
    if ckpt is not None:
        out.append("ckpt" if ckpt else "no ckpt")  # GRPO plans turn GRPOConfig's default checkpointing off
    if "optim" in c:
        out.append(c.pop("optim"))
    b = c.pop("per_device_train_batch_size", None)
    a = c.pop("gradient_accumulation_steps", None)
    if b is not None or a is not None:
        out.append(f"b{b if b is not None else '='}x{a if a is not None else '='}")
    if "max_length" in c:
        out.append(f"len {c.pop('max_length')}")
        c.pop("truncation", None)
    if "lora_r" in c:
        out.append(f"LoRA r{c.pop('lora_r')}")
    if c.pop("freeze_embeddings", False):
        out.append("frozen emb")
    if c.get("freeze_layers"):
        out.append(f"frozen blocks 0-{c.pop('freeze_layers') - 1}")
    if c.pop("offload_optimizer_state", False):
        out.append("offload")
    if "steps_per_generation" in c:
        out.append(f"{c.pop('steps_per_generation')} steps/generation")
    if "vllm_gpu_memory_utilization" in c:
        out.append(f"vLLM share {c.pop('vllm_gpu_memory_utilization')}")
    sleep = c.pop("vllm_enable_sleep_mode", None)
    if sleep is not None:
        out.append("vLLM sleep" if sleep else "no vLLM sleep")
    if "per_device_eval_batch_size" in c:
        out.append(f"eval b{c.pop('per_device_eval_batch_size')}")
    if "eval_accumulation_steps" in c:
        out.append(f"eval acc {c.pop('eval_accumulation_steps')}")
    out += [f"{k}={v}" for k, v in c.items()]
    out += [v for v in (env or {}).values()]
    return ", ".join(out) or "(as is)"


def _snippet(p, config_class: str = "TrainingArguments") -> str:
    lines = []
    for k, v in p.env.items():
        lines.append(f"export {k}={v}")
    if p.changes:
        kw = ", ".join(f"{k}={v!r}" for k, v in p.changes.items())
        lines.append(f"{config_class}(..., {kw})")
    lines += p.code
    return "\n".join(lines)


#: a plan's table needs this many columns: a narrower terminal, a pipe or a log gets each row as lines
WIDE_COLUMNS = 120


def is_wide(console) -> bool:
    """Whether `console` (rich) writes to a terminal of at least WIDE_COLUMNS columns (rich reads `COLUMNS`; a
    pipe or a file is 80 columns to rich, and cells there would be cut to `attn_impl…`)."""
    return bool(console.is_terminal) and console.width >= WIDE_COLUMNS


def print_rows(console, title: str, heads: tuple[str, ...], rows: list[tuple[str, ...]], *, label: int,
               changes: int) -> None:
    """A table as lines, for a narrow or non-terminal stdout: per row its `label` cell and the figures as
    `head value` on one line, then its `changes` cell wrapped whole (no cell cut) at the console's width."""
    import textwrap

    width = max(console.width, 40)
    out = [textwrap.fill(title, width=width, break_long_words=False, break_on_hyphens=False)]
    for row in rows:
        figures = ", ".join(f"{h} {v}" for i, (h, v) in enumerate(zip(heads, row)) if i not in (label, changes))
        out.append(textwrap.fill(f"{row[label]}: {figures}", width=width, subsequent_indent="      ",
                                 break_long_words=False, break_on_hyphens=False))
        out.append(textwrap.fill(row[changes], width=width, initial_indent="    changes: ", subsequent_indent="      ",
                                 break_long_words=False, break_on_hyphens=False))
    console.print("\n".join(out), markup=False, highlight=False, soft_wrap=True)


def render(result, *, is_seed: bool = False) -> None:
    from rich.console import Console
    from rich.table import Table

    c = Console()
    g = result.gpu
    b = result.baseline
    if is_seed:
        from memfit.commands.estimate import SEED_CASE_TEXT

        c.print(f"[dim]{SEED_CASE_TEXT.replace('to estimate', 'to plan')}[/dim]")
    start = getattr(result, "started_from", None)
    if start:  # the setup as given cannot run: the search started from the change that runs
        c.print(f"[bold]As given[/bold]: [red]does not run[/red]: {start['cause']}. [bold]Applied[/bold] "
                f"`{start['flags']}` first ({start['why']}); every plan below includes it.", markup=True,
                highlight=False)
        b_fits = "fits" if b.fits else f"does not fit, short by {format_bytes(max(-b.headroom_bytes, 0))}"
        state = f"with `{start['flags']}` it {b_fits}"
        shown = f"nvidia-smi would show ~{format_bytes(b.device_used_bytes)}"
    elif result.fits_as_is:
        state = "[green]fits[/green]"
        shown = f"nvidia-smi would show ~{format_bytes(b.device_used_bytes)}"
    else:  # the device figure of a run that fails is the one up to its failure (Plan.peak_reserved_bytes)
        state = f"[red]does not fit[/red], short by {format_bytes(max(-b.headroom_bytes, 0))}"
        shown = f"nvidia-smi would show ~{format_bytes(b.device_used_bytes)} until the budget runs out"
    c.print(f"[bold]{'Start' if start else 'As is'}[/bold]: {state} on {g['name']} ({format_bytes(g['total_bytes'])}): {shown}; budget with "
            f"{result.margin:.0%} margin {format_bytes(result.budget_bytes)}")
    title = ("Plans (fastest first within: same method, then other optimizer, then opt-ins; "
             "* = verified by full simulation + allocator replay; > = chosen)")
    heads = ("#", "changes", "peak reserved", "device used", "headroom", "step time", "fits")
    rows = [("start" if start else "as is", short(b.setup_changes) if start else "(as is)",
             format_bytes(b.peak_reserved_bytes), format_bytes(b.device_used_bytes),
             format_bytes(b.headroom_bytes), "1.00x", "yes" if b.fits else "no")]
    if start and result.plans and result.plans[0] == b:  # the start alone is the chosen plan 0: one row, not two
        rows = []
    for i, p in enumerate(result.plans):
        mark = ">" if i == result.chosen else ""
        desc = short(p.setup_changes, p.env)
        rows.append((f"{mark}{i}{'*' if p.verified else ''}", desc, format_bytes(p.peak_reserved_bytes),
                     format_bytes(p.device_used_bytes), format_bytes(p.headroom_bytes),
                     f"{p.relative_step_time:.2f}x", "yes" if p.fits else "no"))
    if is_wide(c):
        t = Table(title=title, title_justify="left")
        for col in heads:
            t.add_column(col, justify="right" if col not in ("changes",) else "left")
        for row in rows:
            t.add_row(*row)
        c.print(t)
    else:
        print_rows(c, title, heads, rows, label=0, changes=1)
    if result.chosen is not None:
        p = result.plans[result.chosen]
        c.print(f"[bold]Chosen plan {result.chosen}[/bold] ({', '.join(p.remedies)}): step time "
                f"{p.relative_step_time:.2f}x, {format_bytes(p.headroom_bytes)} headroom. Apply:")
        c.print(_snippet(p, result.config_class), markup=False, highlight=False)
    elif result.fits_as_is:
        c.print("The setup fits as it is and no faster configuration fits.")
    else:
        c.print(f"[red]Nothing fits[/red]: the closest plan misses by {format_bytes(result.miss_bytes or 0)}.")
        for s in result.suggestions:
            c.print(f"  - {s}")
    if result.not_applicable:
        c.print("[dim]Not applicable here: " + "; ".join(f"{k}: {v}" for k, v in result.not_applicable.items()) + "[/dim]")
    if result.cached:
        c.print(f"[dim]{result.simulations} simulations read from memfit's cache in {result.elapsed_s:.1f} s "
                "(--no-cache runs them)[/dim]")
    else:
        c.print(f"[dim]{result.simulations} simulations in {result.elapsed_s:.1f} s[/dim]")


# -- plan across GPUs ----------------------------------------------------------------------


def plan_parallel_command(args: argparse.Namespace) -> int:
    """`memfit plan ... --gpus 4xA100-40GB` (or a budget `8xA100-40GB,4xH100-80GB`, or `--world-size N --gpu X`)."""
    from memfit.planner.parallel_plan import DEFAULT_MAX_SIMULATIONS, parse_gpu_budget, plan_gpu_budget, plan_parallel

    for flag in ("deepspeed", "fsdp", "fsdp_config"):
        if getattr(args, flag, None) is not None:
            raise MemfitError(f"`memfit plan` chooses the engine and writes its config; drop `--{flag.replace('_', '-')}` "
                              "(`memfit estimate --gpus ... --" + flag.replace('_', '-') + " ...` checks a config you have)")
    if args.force and not args.write_launch:
        raise MemfitError("`--force` replaces launch files: give `--write-launch DIR` as well")
    if args.write_launch and not args.force:  # every plan writes the accelerate config: fail before simulating
        from pathlib import Path

        from memfit.planner.launch import ACCELERATE_FILE

        if (Path(args.write_launch) / ACCELERATE_FILE).exists():
            raise MemfitError(f"`{Path(args.write_launch) / ACCELERATE_FILE}` exists; memfit does not overwrite it: "
                              "pass --force to replace it or choose another --write-launch folder")
    explicit_gpu = args.gpu
    setup, _, is_seed = build_setup(args)
    setup = apply_data(args, setup)  # --data: the worst batch of the user's data
    kinds = parse_gpu_budget(args.gpus) if args.gpus else None
    if kinds is None:
        if args.world_size is None or explicit_gpu is None:
            raise MemfitError("a multi-GPU plan needs the GPUs: pass `--gpus 4xA100-40GB` (or `--world-size 4 --gpu "
                              "A100-40GB`)")
        kinds = [(args.world_size, explicit_gpu)]
    elif explicit_gpu is not None:
        raise MemfitError(f"--gpu `{explicit_gpu}` and --gpus `{args.gpus}` both name GPUs; give one")
    elif args.world_size is not None and (len(kinds) > 1 or kinds[0][0] != args.world_size):
        raise MemfitError(f"--gpus `{args.gpus}` and --world-size `{args.world_size}` differ; give one of them")
    kw = dict(nodes=args.nodes or 1, margin=args.margin, strategies=(args.strategy,) if args.strategy else None,
              interconnect=args.interconnect, network_gbps=args.network_gbps, alloc_conf=args.alloc_conf,
              max_simulations=args.max_simulations or DEFAULT_MAX_SIMULATIONS, script=args.script,
              allow=tuple(a for a in (args.allow or "").split(",") if a.strip()))  # --allow across GPUs
    if args.vllm_server_gpus is not None:  # GRPO / RLOO only (plan_parallel refuses it for other trainers)
        kw["vllm_server_gpus"] = args.vllm_server_gpus
    from memfit.commands._progress import progress

    with progress(f"planning {setup.model} on {', '.join(f'{n}x{g}' for n, g in kinds)} (rank 0 of each candidate)",
                  json_output=args.json):
        if len(kinds) == 1:
            results, best = [plan_parallel(setup, gpu=kinds[0][1], world_size=kinds[0][0], **kw)], 0
            if results[0].chosen is None:
                best = None
        else:
            results, best = plan_gpu_budget(setup, kinds, **kw)
    chosen = results[best] if best is not None else None
    _write_html(args, chosen if chosen is not None else next(
        (r for r in results if not isinstance(r, MemfitError)), None))
    written: list[str] = []
    if args.write_launch:
        if chosen is None:
            raise MemfitError(f"no plan fits, so there is nothing to write to `{args.write_launch}`")
        from memfit.planner.launch import write_launch

        written = write_launch(args.write_launch, chosen.launch, force=args.force)
    if args.json:
        if len(kinds) == 1:
            out = results[0].to_json()
        else:
            out = {"schema": "memfit.plan.gpu_budget/1", "chosen_kind": best,
                   "kinds": [r.to_json() if not isinstance(r, MemfitError) else {"gpus": f"{k[0]}x{k[1]}",
                                                                                 "error": str(r)}
                             for r, k in zip(results, kinds)]}
        out["written"] = written
        if data_note(args, setup):
            out["data"] = data_note(args, setup)
        json.dump(out, sys.stdout, indent=2, default=str)
        print()
    else:
        if data_note(args, setup):
            print(f"note: {data_note(args, setup)}")
        for r, k in zip(results, kinds):
            if isinstance(r, MemfitError):
                print(f"{k[0]}x{k[1]}: {r}")
            else:
                render_parallel(r, chosen_kind=len(kinds) > 1 and r is chosen)
        if len(kinds) > 1:
            print(f"Fastest that fits: {kinds[best][0]}x{kinds[best][1]}" if best is not None
                  else "None of these GPU kinds fits the run.")
        for path in written:
            print(f"wrote {path}")
    if chosen is None and args.check:
        print(f"memfit plan --check: no plan fits {args.gpus or kinds[0]}", file=sys.stderr)
    return 0 if chosen is not None else 1


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:.1f} ms" if seconds < 10 else f"{seconds:.1f} s"


def _generation_line(gen: dict) -> str:
    """One line on a GRPO / RLOO candidate's generation layout (memfit.planner.grpo_parallel_plan)."""
    head = (f"{gen['completions_per_step']} completions per optimizer step, generation batch "
            f"{gen['generation_batch_size']}: {gen['completions_per_rank_per_step']} per training rank per step, "
            f"{gen['generated_per_rank']} generated per rank per generation; ")
    if gen["mode"] == "server":
        return head + (f"trl vllm-serve on GPUs 0-{gen['server_gpus'] - 1} (tensor parallel {gen['tensor_parallel']} "
                       f"x data parallel {gen['data_parallel']}), gpu_memory_utilization {gen['gpu_memory_utilization']}"
                       f" = {format_bytes(gen['server_bytes_per_gpu'])} per GPU for "
                       f"{format_bytes(gen['server_weights_bytes_per_gpu'])} of weights + the KV cache "
                       f"({format_bytes(gen['server_kv_pool_bytes_per_replica'])} per replica, "
                       f"{gen['sequences_at_once_per_replica']} sequences at once); training on the other "
                       f"{gen['training_ranks']}")
    if gen["mode"] == "colocate":
        return head + (f"vLLM colocated in each of the {gen['training_ranks']} ranks, vllm_gpu_memory_utilization "
                       f"{gen['vllm_gpu_memory_utilization']} = {format_bytes(gen['share_bytes'])} per GPU"
                       + (" (sleep mode: released during the training step)" if gen["sleep"] else ""))
    return head + "transformers' generate in each rank"


def render_parallel(r, *, chosen_kind: bool = False) -> None:
    """The candidates simulated, the chosen one, and exactly what to launch."""
    from rich.console import Console
    from rich.table import Table

    c = Console()
    ic = r.interconnect
    link = f"{ic['kind']} {ic['intra_node_gbps']:g} GB/s per GPU" + (
        f", {ic['network_gbps']:g} Gb/s per node between nodes" if r.nodes > 1 else "")
    c.print(f"[bold]{r.world_size} x {r.gpu['name']}[/bold] on {r.nodes} node(s) ({link}); global batch "
            f"{r.global_batch} = {r.per_rank_batch} per GPU; each GPU's budget {format_bytes(r.budget_bytes)}, "
            f"{format_bytes(r.capacity_bytes)} to PyTorch" + (" [green](fastest kind)[/green]" if chosen_kind else ""))
    title = ("Candidates simulated (rank 0; step time modelled: compute + exposed communication + host copies; "
             "> = chosen)")
    heads = ("#", "strategy", "changes", "per GPU", "headroom", "host/node", "step", "comm", "fits")
    rows = [(f"{'>' if i == r.chosen else ''}{i}", cand.strategy, short(cand.setup_changes),
             format_bytes(cand.device_used_bytes), format_bytes(cand.headroom_bytes),
             format_bytes(cand.host_bytes_per_node) if cand.host_bytes_per_node else "-",
             _ms(cand.step.total_s), _ms(cand.step.exposed_comm_s + cand.step.host_copy_s),
             "yes" if cand.fits else "no") for i, cand in enumerate(r.candidates)]
    if is_wide(c):
        t = Table(title=title, title_justify="left")
        for col in heads:
            t.add_column(col, justify="left" if col in ("strategy", "changes") else "right", no_wrap=col != "changes")
        for row in rows:
            t.add_row(*row)
        c.print(t)
    else:  # `6 FSDP2 full_shard: per GPU 13.55 GiB, ...` and its changes below
        print_rows(c, title, ("#", "changes", *heads[3:]), [(f"{row[0]} {row[1]}", *row[2:]) for row in rows],
                   label=0, changes=1)
    c.print("[dim]per GPU: what nvidia-smi shows on rank 0's GPU (reserved + CUDA context + NCCL buffers); step: "
            "modelled time of one optimizer step; comm: its exposed communication and host copies[/dim]")
    best = r.chosen_candidate
    if best is None:
        if getattr(r, "config_class", "TrainingArguments") in ("GRPOConfig", "RLOOConfig"):
            c.print("[red]Nothing fits[/red] on these GPUs (vLLM colocated or served); more or larger GPUs, or "
                    "`--allow` opt-ins (fewer_generations, shorter_completions, no_reference, lora, qlora).")
        else:
            c.print("[red]Nothing fits[/red] on these GPUs (also with CPU offload); more or larger GPUs, or `--allow` "
                    "opt-in remedies (truncation, lora, qlora, freeze).")
    else:
        per_step = sum(x["bytes_per_step"] for x in best.collectives)
        c.print(f"[bold]Chosen[/bold]: {best.strategy}, micro-batch {best.per_device_train_batch_size} x accumulation "
                f"{best.gradient_accumulation_steps}; {format_bytes(best.headroom_bytes)} headroom on each GPU; "
                f"{format_bytes(per_step)} moved per rank per step. Launch:")
        gen = best.generation
        if gen is not None:  # GRPO / RLOO: where generation runs
            c.print(_generation_line(gen), markup=False, highlight=False)
        L = r.launch
        lines = []
        for name, text in L.files.items():
            lines += [f"# {name}", text.rstrip()]
        lines += [f"export {k}={v}" for k, v in L.env.items()]
        lines.append(f"{getattr(r, 'config_class', 'TrainingArguments')}(..., "
                     + ", ".join(f"{k}={v!r}" for k, v in L.training_args.items()) + ")")
        lines += L.code + L.commands
        c.print("\n".join(lines), markup=False, highlight=False, soft_wrap=True)
    for n in r.notes:
        c.print(f"[dim]note: {n}[/dim]")
    c.print(f"[dim]{r.simulations} per-rank simulations in {r.elapsed_s:.1f} s[/dim]")
