"""`memfit plan MODEL --gpu GPU`: the fastest configuration that fits, and the exact change.

    memfit plan                                        # the built-in example (xlnet-large-cased) on a V100-16GB
    memfit plan xlnet-large-cased --batch-size 1 --grad-accum 16 --max-length 2048 --gpu V100-16GB
    memfit plan meta-llama/Llama-3.2-1B --task causal-lm --gpu T4 --allow lora,truncation --json
"""

from __future__ import annotations

import argparse
import json
import sys

from memfit.commands.estimate import add_setup_arguments, build_setup
from memfit.errors import MemfitError
from memfit.units import format_bytes

__all__ = ["plan_command_parser", "plan_command"]


def plan_command_parser(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "plan", help="the fastest configuration that fits a GPU, and the exact change",
        description="Search gradient checkpointing, mixed precision, optimizers, micro-batch vs accumulation, "
                     "evaluation and allocator settings, FlashAttention-2 and Liger kernels (and, with --allow, truncation, LoRA, QLoRA, freezing, offload) for "
                     "the fastest configuration that fits the GPU, verified by simulation.",
    )
    add_setup_arguments(p)
    p.add_argument("--allow", default="", help="opt-in remedies: truncation, lora, qlora, freeze, offload (comma-separated)")
    p.add_argument("--margin", type=float, default=None, help="fraction of the GPU kept free (default 0.05)")
    p.add_argument("--check", action="store_true",
                   help="exit 1 (with one line on stderr) when the setup as given does not fit, even when a plan "
                        "does; for scripts and CI")
    p.add_argument("--no-cache", action="store_true",  # issue 15: memfit.cache.plan_key
                   help="plan even when memfit's cache ($MEMFIT_CACHE_DIR, else ~/.cache/memfit) holds the result")
    p.set_defaults(func=plan_command)
    return p


def plan_command(args: argparse.Namespace) -> int:
    from memfit.planner.search import DEFAULT_MARGIN, plan

    setup, gpu, is_seed = build_setup(args)
    if gpu is None:
        raise MemfitError("`memfit plan` needs a GPU to plan for: pass `--gpu V100-16GB`, a size like `--gpu 24GiB`, "
                          "or `--gpu auto` on a machine with a GPU")
    result = plan(setup, gpu=gpu, allow=[a for a in args.allow.split(",") if a.strip()],
                  margin=DEFAULT_MARGIN if args.margin is None else args.margin, alloc_conf=args.alloc_conf,
                  cache=not args.no_cache)
    if args.json:
        json.dump(result.to_json(), sys.stdout, indent=2, default=str)
        print()
    else:
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
    if c.pop("gradient_checkpointing", False):
        out.append("ckpt")
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
    if "per_device_eval_batch_size" in c:
        out.append(f"eval b{c.pop('per_device_eval_batch_size')}")
    if "eval_accumulation_steps" in c:
        out.append(f"eval acc {c.pop('eval_accumulation_steps')}")
    out += [f"{k}={v}" for k, v in c.items()]
    out += [v for v in (env or {}).values()]
    return ", ".join(out) or "(as is)"


def _snippet(p) -> str:
    lines = []
    for k, v in p.env.items():
        lines.append(f"export {k}={v}")
    if p.changes:
        kw = ", ".join(f"{k}={v!r}" for k, v in p.changes.items())
        lines.append(f"TrainingArguments(..., {kw})")
    lines += p.code
    return "\n".join(lines)


def render(result, *, is_seed: bool = False) -> None:
    from rich.console import Console
    from rich.table import Table

    c = Console()
    g = result.gpu
    b = result.baseline
    if is_seed:
        from memfit.commands.estimate import SEED_CASE_TEXT

        c.print(f"[dim]{SEED_CASE_TEXT.replace('to estimate', 'to plan')}[/dim]")
    state = "[green]fits[/green]" if result.fits_as_is else "[red]does not fit[/red]"
    c.print(f"[bold]As is[/bold]: {state} on {g['name']} ({format_bytes(g['total_bytes'])}): nvidia-smi would show "
            f"~{format_bytes(b.device_used_bytes)}; budget with {result.margin:.0%} margin {format_bytes(result.budget_bytes)}")
    t = Table(title="Plans (fastest first within: same method, then other optimizer, then opt-ins; "
                    "* = verified by full simulation + allocator replay; > = chosen)", title_justify="left")
    for col in ("#", "changes", "peak reserved", "device used", "headroom", "step time", "fits"):
        t.add_column(col, justify="right" if col not in ("changes",) else "left")
    t.add_row("as is", "(as is)", format_bytes(b.peak_reserved_bytes), format_bytes(b.device_used_bytes),
              format_bytes(b.headroom_bytes), "1.00x", "yes" if b.fits else "no")
    for i, p in enumerate(result.plans):
        mark = ">" if i == result.chosen else ""
        desc = short(p.setup_changes, p.env)
        t.add_row(f"{mark}{i}{'*' if p.verified else ''}", desc, format_bytes(p.peak_reserved_bytes),
                  format_bytes(p.device_used_bytes), format_bytes(p.headroom_bytes), f"{p.relative_step_time:.2f}x",
                  "yes" if p.fits else "no")
    c.print(t)
    if result.chosen is not None:
        p = result.plans[result.chosen]
        c.print(f"[bold]Chosen plan {result.chosen}[/bold] ({', '.join(p.remedies)}): step time "
                f"{p.relative_step_time:.2f}x, {format_bytes(p.headroom_bytes)} headroom. Apply:")
        c.print(_snippet(p), markup=False, highlight=False)
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
