"""hybridflow.precision: what model.dtype=auto means on each machine, and which dtypes are refused (pure)."""

from __future__ import annotations

import pytest
import torch

from hybridflow import precision as P

XEON_AMX = frozenset("fpu avx2 avx512f avx512_bf16 amx_bf16 amx_tile".split())
EPYC_ZEN4 = frozenset("fpu avx2 avx512f avx512_bf16".split())
OLD_AVX2 = frozenset("fpu avx2 fma".split())


def test_cpu_flags_read_from_a_cpuinfo_file(tmp_path):
    f = tmp_path / "cpuinfo"
    f.write_text("processor\t: 0\nmodel name\t: X\nflags\t\t: fpu avx2 avx512_bf16\n\nprocessor\t: 1\nflags\t: fpu\n")
    assert P.cpu_flags(str(f)) == {"fpu", "avx2", "avx512_bf16"}  # the first processor's
    assert P.cpu_flags(str(tmp_path / "missing")) == frozenset()


@pytest.mark.parametrize("flags, want", [(XEON_AMX, "amx_bf16"), (EPYC_ZEN4, "avx512_bf16"), (OLD_AVX2, None)])
def test_bf16_flag_prefers_amx(flags, want):
    assert P.cpu_bf16_flag(flags) == want


def test_env_overrides_detection(monkeypatch):
    monkeypatch.setenv(P.ENV_OVERRIDE, "0")
    assert P.cpu_bf16_flag() is None and P.resolve("auto", "cpu") == "float32"
    monkeypatch.setenv(P.ENV_OVERRIDE, "1")
    assert P.cpu_bf16_flag() == "HYBRIDFLOW_CPU_BF16=1" and P.resolve("auto", "cpu") == "bfloat16"


@pytest.mark.parametrize("name, device, flag, want", [
    ("auto", "cuda", None, "bfloat16"),
    ("auto", "cpu", "amx_bf16", "bfloat16"),
    ("auto", "cpu", "avx512_bf16", "bfloat16"),
    ("auto", "cpu", None, "float32"),
    ("bf16", "cpu", None, "bfloat16"),  # an explicit choice is kept (check_roles decides whether to refuse it)
    ("fp32", "cuda", None, "float32"),
    ("float16", "cuda", None, "float16"),
])
def test_resolve(name, device, flag, want):
    assert P.resolve(name, device, bf16_flag=flag) == want


def test_unknown_dtype_names_the_key():
    with pytest.raises(P.PrecisionError, match=r"critic.model.dtype='half' is not one of \['auto', 'float32'"):
        P.resolve("half", "cpu", "critic.model.dtype")


def test_torch_dtype():
    assert P.torch_dtype("bf16") is torch.bfloat16 and P.torch_dtype("float32") is torch.float32
    with pytest.raises(KeyError):
        P.torch_dtype("auto")  # resolve first


ACTOR, CRITIC, RM = "actor_rollout_ref.model.dtype", "critic.model.dtype", "reward_model.model.dtype"


def test_check_roles_resolves_every_role():
    roles = {ACTOR: ("auto", True), CRITIC: ("float32", True), RM: ("auto", False)}
    assert P.check_roles(roles, "cpu", bf16_flag="avx512_bf16") == {ACTOR: "bfloat16", CRITIC: "float32",
                                                                    RM: "bfloat16"}
    assert P.check_roles(roles, "cpu", bf16_flag=None) == {ACTOR: "float32", CRITIC: "float32", RM: "float32"}
    # an inference-only reward model may run fp16 on GPU; its scores are read in fp32
    assert P.check_roles({RM: ("fp16", False)}, "cuda")[RM] == "float16"


@pytest.mark.parametrize("roles, device, flag, force, match", [
    ({ACTOR: ("fp16", True)}, "cpu", "amx_bf16", False, r"actor_rollout_ref.model.dtype=fp16: fp16 is not supported"),
    ({RM: ("float16", False)}, "cpu", "amx_bf16", False, r"reward_model.model.dtype=float16: fp16 is not supported"),
    ({CRITIC: ("float16", True)}, "cuda", None, False, r"critic.model.dtype=float16: training in fp16 needs a loss"),
    ({ACTOR: ("bfloat16", True)}, "cpu", None, False, r"actor_rollout_ref.model.dtype=bfloat16: this CPU has no "),
])
def test_check_roles_refuses(roles, device, flag, force, match):
    with pytest.raises(P.PrecisionError, match=match):
        P.check_roles(roles, device, bf16_flag=flag, force_slow_bf16=force)


def test_forced_slow_bf16_passes_and_the_slowdown_is_measured():
    assert P.check_roles({ACTOR: ("bf16", True)}, "cpu", bf16_flag=None, force_slow_bf16=True) == {ACTOR: "bfloat16"}
    ratio = P.measured_bf16_slowdown(n=64, reps=2)
    assert 0 < ratio < 1000


def test_why_says_what_auto_chose():
    assert P.why("auto", "cpu", bf16_flag="amx_bf16") == "bfloat16 (auto: CPU has amx_bf16)"
    assert P.why("auto", "cpu", bf16_flag=None) == "float32 (auto: this CPU has no native bf16)"
    assert P.why("auto", "cuda") == "bfloat16 (auto: CUDA)"
    assert P.why("bf16", "cpu") == "bfloat16 (set)"
