"""Will a HybridFlow config fit its GPUs, and roughly how long is one step? No GPU, no weights.

python -m launch.plan CONFIG [key=value ...] [--gpu h100|a100|h200] [--recompute none|selective|full] ...
python -m launch.plan --against-published   (--against-paper: the same)

The GPU: --gpu, else the config's plan.gpu (a recipe names the GPU it was planned for), else h100.

Exit codes: 0 fits, 1 does not fit (the message names the stage, role, component and overflow, and knobs that
would fix it), 2 bad input (unknown GPU or model, a layout that does not divide, too few GPUs).
"""

from __future__ import annotations

import argparse
import json
import re
import shlex
import sys
from pathlib import Path

from launch.plan import make_plan
from launch.plan.job import Options, PlanInputError
from launch.plan.published import DOC_BEGIN, DOC_END, against_published, render_cases, render_markdown
from launch.plan.report import GiB, fit_message, header_lines, render


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    head, _, rest = __doc__.partition("\n\n")
    ap = argparse.ArgumentParser(prog="python -m launch.plan", description=head, epilog=rest,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("config", nargs="?", help="a HybridFlow YAML config (configs/recipes/*.yaml)")
    ap.add_argument("overrides", nargs="*", help="dotlist overrides, as the trainer takes them")
    ap.add_argument("--gpu", default=None, help="a100 | h100 | h200 (default: the config's plan.gpu, else h100)")
    ap.add_argument("--recompute", default="none", help="none | selective | full (Megatron activation recompute)")
    ap.add_argument("--virtual-pipeline", type=int, default=1, dest="vpp", help="virtual pipeline chunks per stage")
    ap.add_argument("--kernels", default="te", help="te (GPU, Transformer Engine) | local (megatron local spec; "
                    "its attention follows the config's attention_backend) | local_unfused")
    ap.add_argument("--dtype", default=None, help="bf16 | fp32 (default: model.dtype, bf16 for auto)")
    ap.add_argument("--internode-gbps", type=float, default=None,
                    help="inter-node bandwidth per node in Gb/s (default: the device table's per-GPU NICs)")
    ap.add_argument("--max-num-seqs", type=int, default=256, help="vLLM concurrent sequences per engine")
    ap.add_argument("--response-length-mean", type=float, default=None,
                    help="mean response tokens (real runs stop at EOS; default: every response at the budget)")
    ap.add_argument("--response-length-p99", type=float, default=None,
                    help="99th percentile of response tokens (default: the budget)")
    ap.add_argument("--rollout-data-dir", default=None,
                    help="a run's trainer.rollout_data_dir: its step_*.jsonl give the length histogram and prompt mean")
    ap.add_argument("--prompt-length-mean", type=float, default=None,
                    help="mean prompt tokens (default: data.max_prompt_length)")
    ap.add_argument("--packing", default="trim", help="trim (micro-batch padded to its longest row) | packed "
                    "(real tokens only) | pad (every row at the budget)")
    ap.add_argument("--train-backend", default="megatron", help="megatron (ours) | fsdp (what an FSDP trainer such as "
                    "verl's example scripts would take: one measured FSDP efficiency, launch/plan/step_time.py)")
    ap.add_argument("--header", action="store_true", help="print a recipe header for this plan")
    ap.add_argument("--json", action="store_true", help="also print the plan's numbers as one JSON line")
    ap.add_argument("--write-headers", action="store_true",
                    help="re-plan configs/recipes/*.yaml and rewrite their headers and docs/scale.md's table")
    ap.add_argument("--against-published", "--against-paper", action="store_true", dest="against_published",
                    help="compare with published figures (HybridFlow paper, verl, NeMo-RL) and docs/measured/*.json")
    return ap.parse_intermixed_args(argv)  # flags may come between the overrides


def options_from(args: argparse.Namespace) -> Options:
    return Options(gpu=args.gpu, recompute=args.recompute, vpp=args.vpp, kernels=args.kernels, dtype=args.dtype,
                   internode_gbps_per_node=args.internode_gbps, max_num_seqs=args.max_num_seqs,
                   response_length_mean=args.response_length_mean, response_length_p99=args.response_length_p99,
                   rollout_data_dir=args.rollout_data_dir, prompt_length_mean=args.prompt_length_mean,
                   packing=args.packing, train_backend=args.train_backend)


def summary(plan) -> dict:
    return {"fits": plan.memory.fits, "peak_gib": plan.memory.peak.total / 1024**3, "peak_stage": plan.memory.peak.name,
            "step_s": plan.step_s, "tokens_per_gpu_s": plan.tokens_per_gpu_s,
            "stages_s": {s.name: s.seconds for s in plan.stages},
            **({"async_mode": plan.job.async_mode, "rollout_idle_frac": plan.idle_fractions[0],
                "train_idle_frac": plan.idle_fractions[1]} if plan.job.rollout_pool else {})}


def refresh_recipe_headers(repo) -> list[str]:
    """Re-plan every configs/recipes/*.yaml with the command its `# plan:` line names, rewrite its expected memory
    and step lines, the matching row of docs/scale.md's recipe table and its against-published table. Returns what
    changed."""
    repo = Path(repo)
    scale = repo / "docs" / "scale.md"
    doc = scale.read_text()
    changed = []
    for path in sorted((repo / "configs" / "recipes").glob("*.yaml")):
        text = path.read_text()
        m = re.search(r"^# plan: python -m launch\.plan (.*)$", text, re.M)
        if not m:
            continue
        args = parse_args(shlex.split(m.group(1)))
        plan = make_plan(repo / args.config, args.overrides, options_from(args))
        _, mem, step = header_lines(plan, "")
        new = re.sub(r"^# expected memory per GPU: .*$", mem, text, flags=re.M)
        new = re.sub(r"^# expected step time: .*$", step, new, flags=re.M)
        if new != text:
            path.write_text(new)
            changed.append(path.name)
        cells = f"{plan.memory.peak.total / GiB:.1f} GiB | {plan.step_s:.0f} s |"
        doc = re.sub(rf"^(\| {path.stem} \|.*\| )[\d.]+ GiB \| \d+ s \|$", lambda r, c=cells: r.group(1) + c, doc,
                     flags=re.M)
    if DOC_BEGIN in doc:
        head, rest = doc.split(DOC_BEGIN, 1)
        doc = f"{head}{DOC_BEGIN}\n{render_markdown(against_published())}\n{DOC_END}{rest.split(DOC_END, 1)[1]}"
    if doc != scale.read_text():
        scale.write_text(doc)
        changed.append("docs/scale.md")
    return changed


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.write_headers:
        print("\n".join(refresh_recipe_headers(Path(__file__).resolve().parents[2])) or "headers up to date")
        return 0
    if args.against_published:
        result = against_published()
        print(render_cases(result))
        print(json.dumps(result))
        return 0
    if not args.config:
        print("error: give a config file (or --against-published)", file=sys.stderr)
        return 2
    try:
        plan = make_plan(args.config, args.overrides, options_from(args))
    except (PlanInputError, ValueError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(render(plan))
    if args.header:
        flags = " ".join(a for a in (argv if argv is not None else sys.argv[1:]) if a != "--header")
        print("\n" + "\n".join(header_lines(plan, f"python -m launch.plan {flags}")))
    if args.json:
        print(json.dumps(summary(plan)))
    message = fit_message(plan)
    if message:
        print("\n" + message, file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
