"""How the fixtures named `<folder>.<script>.txt` here were made: verl's Megatron example scripts
(`examples/*/*megatron*.sh` at one commit), each run by bash with `python`/`python3` replaced by a stub that
writes the arguments it was given, one per line. So every variable, default, array and quote is expanded by
the shell itself, exactly as the script runs, not by hand.

    python tests/data/verl_overrides/expand.py /path/to/verl.git [COMMIT]

It reads the scripts with `git show COMMIT:path` from a verl git directory (a bare mirror is enough) and
writes one fixture per script next to this file. What the run assumes, the same for every script:
  - no environment variable of the script's own is set, so `${X:-default}` takes its default and a bare `$X`
    is empty; HOME is the literal text `$HOME`, so paths under it read as in the script;
  - no arguments (`$@` is empty; a script that reads `${1:-x}` takes x);
  - PATH holds only the stubs and the few tools the scripts call to compute values (dirname, env, awk), so a
    script's downloads, converters or `ray` calls are not run (a line that calls them only prints an error).
`--config-path` / `--config-name` are not overrides: the config name goes to the header, the rest is dropped.
Notes about single scripts (what a reader should know that the lines do not say) are in NOTES.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
TRAINER = "verl.trainer.main_ppo"
# The stub: the trainer call prints its arguments after a marker; any other python call (a converter) does nothing.
STUB = f"""#!/bin/bash
if [ "$1" = "-m" ] && [ "$2" = "{TRAINER}" ]; then
  echo "@@overrides"; shift 2; printf '%s\\n' "$@"; echo "@@end"
fi
"""
TOOLS = ("dirname", "env", "awk", "bash", "cat")

# The model each script trains (its HF model_type, from the model's config.json) and what else to know.
NOTES = {
    "gpg_trainer/run_qwen2-7b_math_megatron.sh": ("Qwen/Qwen2-7B-Instruct (qwen2)", ""),
    "grpo_trainer/run_deepseek671b_math_megatron_80gb.sh": (
        "DeepSeek-V3-0324 (deepseek_v3)", "LLM is the script's placeholder <path_to_dsv3_config>; CKPT_DIR is unset."),
    "grpo_trainer/run_deepseek671b_math_megatron_96gb.sh": ("DeepSeek-V3 (deepseek_v3)", ""),
    "grpo_trainer/run_deepseek7b_llm_math_megatron.sh": (
        "deepseek-ai/deepseek-llm-7b-chat (llama: LlamaForCausalLM)", ""),
    "grpo_trainer/run_moonlight16b_math_megatron.sh": (
        "moonshotai/Moonlight-16B-A3B (deepseek_v3)",
        "DIST_CKPT_PATH is unset, so the dist-checkpoint paths are empty."),
    "grpo_trainer/run_qwen2-7b_math_megatron.sh": ("Qwen/Qwen2-7B-Instruct (qwen2)", ""),
    "grpo_trainer/run_qwen2-7b_math_megatron_lora.sh": ("Qwen/Qwen2-7B-Instruct (qwen2)", ""),
    "grpo_trainer/run_qwen2-7b_math_megatron_trtllm.sh": (
        "Qwen/Qwen2-7B-Instruct (qwen2)",
        "DATADIR defaults to $PWD/data: the directory bash ran in (a temporary one)."),
    "grpo_trainer/run_qwen2-7b_seq_balance_math_megatron.sh": ("Qwen/Qwen2-7B-Instruct (qwen2)", ""),
    "grpo_trainer/run_qwen2-7b_sgl_megatron.sh": ("Qwen/Qwen2-7B-Instruct (qwen2)", ""),
    "grpo_trainer/run_qwen2_5-7b_math_megatron_diff_tp.sh": ("Qwen/Qwen2.5-7B-Instruct (qwen2)", ""),
    "grpo_trainer/run_qwen2_5_vl-7b-megatron.sh": (
        "Qwen/Qwen2.5-VL-7B-Instruct (qwen2_5_vl)", "DIST_CKPT_PATH is unset, so the dist-checkpoint paths are empty."),
    "grpo_trainer/run_qwen3-235b_megatron_96gb.sh": ("Qwen3-235B-A22B (qwen3_moe)", ""),
    "grpo_trainer/run_qwen3_vl-235b-megatron.sh": (
        "Qwen3-VL-235B-A22B-Instruct (qwen3_vl_moe)", "RAY_DATA_HOME is unset, so the model path starts at /models."),
    "grpo_trainer/run_qwen3_vl-30b-megatron.sh": (
        "Qwen3-VL-30B-A3B-Instruct (qwen3_vl_moe)",
        "RAY_DATA_HOME is unset, so the model path starts at /models. A comment line inside the command "
        "(`# Use aux_loss and z_loss ...`) ends it there: the moe_aux_loss_coeff / moe_z_loss_coeff lines and "
        "everything after them are not passed to verl (bash then fails to run them as a command)."),
    "grpo_trainer/run_qwen3_vl-8b-megatron.sh": (
        "Qwen3-VL-8B-Instruct (qwen3_vl)", "RAY_DATA_HOME is unset, so the model path starts at /models."),
    "grpo_trainer/run_qwen3moe-30b_megatron_96gb.sh": (
        "Qwen/Qwen3-30B-A3B-Base (qwen3_moe)",
        "TEST_FILE is overwritten with ['$aime24_test_path'], a variable the script never sets: ['']."),
    "grpo_trainer/run_qwen3moe-30b_megatron_lora.sh": ("Qwen/Qwen3-30B-A3B-Instruct-2507 (qwen3_moe)", ""),
    "mtp_trainer/test_dapo_mimo_7b_with_mtp_math_megatron.sh": (
        "XiaomiMiMo/MiMo-7B-RL (mimo: MiMoForCausalLM, remote code, with multi-token prediction)", ""),
    "ppo_trainer/run_deepseek_math_gsm8k_megatron.sh": (
        "deepseek-ai/deepseek-llm-7b-chat (llama: LlamaForCausalLM)", ""),
    "ppo_trainer/run_deepseek_math_gsm8k_megatron_nsys.sh": (
        "deepseek-ai/deepseek-llm-7b-chat (llama: LlamaForCausalLM)", ""),
    "ppo_trainer/run_moonlight16b_a3b_gsm8k_megatron.sh": (
        "moonshotai/Moonlight-16B-A3B-Instruct (deepseek_v3)",
        "The model paths are $LLM, which the script never sets (its HF_MODEL_PATH is only used by the converter): "
        "empty."),
    "ppo_trainer/run_qwen1.5_moe_a2.7b-gsm8k_megatron.sh": ("Qwen/Qwen1.5-MoE-A2.7B-Chat (qwen2_moe)", ""),
    "ppo_trainer/run_qwen2-7b_math_gsm8k_megatron.sh": ("Qwen/Qwen2-7B-Instruct (qwen2)", ""),
    "router_replay/run_qwen30_a3b_megatron_sglang.sh": (
        "Qwen3-30B-A3B, by the script's name (qwen3_moe)",
        "HF_MODEL_PATH and the data paths are empty strings in the script."),
    "router_replay/run_qwen30_a3b_megatron_vllm.sh": (
        "Qwen3-30B-A3B, by the script's name (qwen3_moe)",
        "HF_MODEL_PATH and the data paths are empty strings in the script."),
    "sglang_multiturn/run_qwen2.5-3b_megatron_gsm8k_multiturn.sh": (
        "Qwen/Qwen2.5-3B-Instruct (qwen2)",
        "PROJECT_DIR is $(pwd): the directory bash ran in (a temporary one). Its config name sets verl's multi-turn "
        "defaults, which these lines do not carry."),
}


def expand(script_text: str, workdir: Path) -> tuple[list[str], str]:
    """(overrides, config name) of one run of the script's text."""
    bin_dir = workdir / "bin"
    bin_dir.mkdir()
    for name in ("python", "python3"):
        (bin_dir / name).write_text(STUB)
        (bin_dir / name).chmod(0o755)
    for tool in TOOLS:
        os.symlink(shutil.which(tool), bin_dir / tool)
    script = workdir / "script.sh"
    script.write_text(script_text)
    run = subprocess.run([str(bin_dir / "bash"), str(script)], cwd=workdir, capture_output=True, text=True,
                         timeout=60, env={"PATH": str(bin_dir), "HOME": "$HOME"})
    out = run.stdout.split("\n")
    if "@@overrides" not in out:
        raise RuntimeError(f"the script never called {TRAINER}: {run.stderr[-2000:]}")
    args = out[out.index("@@overrides") + 1:out.index("@@end")]
    overrides, name = [], ""
    for a in args:
        if a.startswith("--config-name="):
            name = a.split("=", 1)[1]
        elif not a.startswith("--config-path="):
            overrides.append(a.replace(str(workdir), "$PWD"))
    return overrides, name


def main(argv: list[str]) -> None:
    git_dir, commit = argv[0], argv[1] if len(argv) > 1 else "HEAD"
    sha = subprocess.check_output(["git", "--git-dir", git_dir, "rev-parse", commit], text=True).strip()
    names = subprocess.check_output(["git", "--git-dir", git_dir, "ls-tree", "-r", "--name-only", sha, "examples"],
                                    text=True).split()
    scripts = sorted(n for n in names if n.count("/") == 2 and "megatron" in n.rsplit("/", 1)[1] and n.endswith(".sh"))
    missing = sorted(set(s.removeprefix("examples/") for s in scripts) - set(NOTES))
    if missing:
        raise SystemExit(f"no NOTES entry (model, notes) for: {missing}")
    for path in scripts:
        text = subprocess.check_output(["git", "--git-dir", git_dir, "show", f"{sha}:{path}"], text=True)
        with tempfile.TemporaryDirectory() as tmp:
            overrides, config_name = expand(text, Path(tmp))
        rel = path.removeprefix("examples/")
        model, note = NOTES[rel]
        folder, stem = rel.removesuffix(".sh").split("/")
        header = [f"# source: volcengine/verl {path}", f"# commit: {sha}", f"# model: {model}",
                  f"# config-name: {config_name}"]
        about = (f"Expanded by tests/data/verl_overrides/expand.py: the overrides bash passed to {TRAINER}, one per "
                 "line, with no environment variables or arguments (every ${X:-default} at its default, $HOME "
                 "literal); see that file. " + note)
        header += [f"# {line}" for line in _wrap(about)]
        (HERE / f"{folder}.{stem}.txt").write_text("\n".join(header + overrides) + "\n")
        print(f"{folder}.{stem}.txt: {len(overrides)} overrides")


def _wrap(text: str, width: int = 116) -> list[str]:
    lines, line = [], ""
    for word in text.split():
        if line and len(line) + 1 + len(word) > width:
            lines.append(line)
            line = word
        else:
            line = f"{line} {word}".strip()
    return lines + [line] if line else lines


if __name__ == "__main__":
    main(sys.argv[1:])
