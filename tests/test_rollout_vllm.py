"""The in-process vLLM rollout (external_launcher, one rank) against HF transformers, in fp32.

One engine per architecture for the whole module (an engine costs ~5 s plus a first-generate
warm-up); the tiny Llama and the tiny Qwen2 run the same checks one after the other, with
`shutdown()` in between, which is itself under test: a second engine must start in the process.
"""

import contextlib

import pytest
import torch
from rollout_scripts.reference import hf_greedy, make_prompts, teacher_forced_log_probs

pytest.importorskip("vllm")

from hybridflow.config.schema import RolloutConfig  # noqa: E402
from hybridflow.models.tiny import build_tokenizer, save_tiny_model  # noqa: E402
from hybridflow.rollout.hf_rollout import HFRollout  # noqa: E402
from hybridflow.rollout.output import assemble_rollout_output  # noqa: E402

R = 24  # response length


@contextlib.contextmanager
def config_set(rollout, **values):
    """Temporarily changes rollout.config fields (the engine is shared by the whole module)."""
    old = {k: getattr(rollout.config, k) for k in values}
    for k, v in values.items():
        setattr(rollout.config, k, v)
    try:
        yield
    finally:
        for k, v in old.items():
            setattr(rollout.config, k, v)


@pytest.fixture(scope="module", params=["llama", "qwen2"])
def engine(request, tmp_path_factory):
    from transformers import AutoModelForCausalLM

    from hybridflow.rollout.vllm_rollout import VLLMRollout

    arch = request.param
    path = save_tiny_model(tmp_path_factory.mktemp(f"tiny_{arch}"), preset="tiny", arch=arch)
    rng_before = torch.get_rng_state()
    # fp32: these compare with HF transformers token for token (bf16 flips ties; its bound is in
    # tests/test_hybrid_engine_workers.py)
    # verl's engine keys (max_num_seqs above any batch here, so the scheduling is vLLM's default one)
    rollout = VLLMRollout(str(path), RolloutConfig(response_length=R, n=1, seed=3, max_num_seqs=300,
                                                   max_num_batched_tokens=3000, enable_chunked_prefill=True,
                                                   kv_cache_memory_bytes=64 * 1024 * 1024), dtype="float32")
    rollout.rng_kept_at_start = torch.equal(torch.get_rng_state(), rng_before)
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    yield rollout, hf, path
    rollout.shutdown()


@pytest.fixture(scope="module")
def tok():
    return build_tokenizer()


def test_layout_of_a_single_rank(engine):
    rollout, _, _ = engine
    assert (rollout.world_size, rollout.num_replicas, rollout.replica_rank, rollout.tp_rank) == (1, 1, 0, 0)
    assert rollout.is_replica_leader
    assert rollout.pad_token_id == build_tokenizer().pad_token_id
    assert rollout.rng_kept_at_start, "building the engine changed the process's torch RNG state"
    scheduler = rollout.llm.llm_engine.vllm_config.scheduler_config  # rollout.* keys reached the engine
    assert (scheduler.max_num_seqs, scheduler.max_num_batched_tokens, scheduler.enable_chunked_prefill) == (
        300, 3000, True)
    assert rollout.llm.llm_engine.vllm_config.model_config.enforce_eager  # always on CPU


def test_on_cpu_generation_compiles_nothing(engine, tok):
    # vLLM's token-rank kernel is torch.compile'd; compiling it was most of a run's first step on CPU
    # (hybridflow/rollout/vllm_rollout.py, eager_token_ranks).
    import vllm.v1.sample.sampler as sampler
    from torch._dynamo.utils import counters

    rollout, _, _ = engine
    assert not hasattr(sampler.batched_count_greater_than, "_torchdynamo_orig_callable")
    frames = sum(counters["frames"].values())
    out = rollout.generate_sequences(make_prompts(tok, meta_info={"n": 2, "temperature": 1.0}))
    assert "rollout_log_probs" in out.batch
    assert sum(counters["frames"].values()) == frames, "a generation compiled a frame with torch.compile"


def test_greedy_tokens_equal_hf_and_log_probs_match_teacher_forcing(engine, tok):
    rollout, hf, _ = engine
    prompts = make_prompts(tok, meta_info={"do_sample": False})
    # ignore_eos: a random model may emit eos early; the full length compares more tokens.
    with config_set(rollout, ignore_eos=True):
        out = rollout.generate_sequences(prompts)
    assert len(prompts) >= 8
    assert out.batch["responses"].tolist() == hf_greedy(hf, prompts, R)
    assert out.batch["response_mask"].all()
    ref = teacher_forced_log_probs(hf, out)
    torch.testing.assert_close(out.batch["rollout_log_probs"], ref, atol=1e-4, rtol=0)


def test_output_format_equals_hf_rollout_with_stop_tokens(engine, tok):
    rollout, hf, _ = engine
    prompts = make_prompts(tok, meta_info={"do_sample": False})
    first = rollout.generate_sequences(prompts).batch["responses"]
    stop = int(first[0, 2])  # row 0 stops at its first occurrence (step 3 or earlier), others wherever
    row0_len = first[0].tolist().index(stop) + 1
    meta = {"do_sample": False}
    with config_set(rollout, stop_token_ids=[stop]):
        got = rollout.generate_sequences(make_prompts(tok, meta_info=meta))
    want = HFRollout(hf, RolloutConfig(response_length=R, stop_token_ids=[stop])).generate_sequences(
        make_prompts(tok, meta_info=meta))
    for key in ("prompts", "responses", "input_ids", "attention_mask", "position_ids", "response_mask"):
        assert torch.equal(got.batch[key], want.batch[key]), key
    assert got.batch["response_mask"][0].tolist() == [1] * row0_len + [0] * (R - row0_len)
    torch.testing.assert_close(got.batch["rollout_log_probs"], want.batch["rollout_log_probs"], atol=1e-4, rtol=0)
    assert list(got.non_tensor_batch["uid"]) == list(want.non_tensor_batch["uid"])


def test_sampling_n_and_log_probs_under_temperature(engine, tok):
    rollout, hf, _ = engine
    prompts = make_prompts(tok, texts=["hi", "what is 2+2?", "0123"], meta_info={"n": 4, "temperature": 0.8})
    rng_before = torch.get_rng_state()
    out = rollout.generate_sequences(prompts)
    assert torch.equal(torch.get_rng_state(), rng_before), "generate_sequences changed the caller's RNG state"
    # The next call draws from a new per-call seed, not a replay of this one.
    assert not torch.equal(rollout.generate_sequences(prompts).batch["responses"], out.batch["responses"])
    assert len(out) == 12 and out.batch["responses"].shape == (12, R)
    assert list(out.non_tensor_batch["uid"]) == [u for u in ("u0", "u1", "u2") for _ in range(4)]
    assert len({tuple(r) for r in out.batch["responses"][:4].tolist()}) > 1  # four different draws
    # "processed" log-probs: log_softmax(logits / T), the trainer's quantity at top_p=1, top_k off.
    ref = teacher_forced_log_probs(hf, out, temperature=0.8)
    torch.testing.assert_close(out.batch["rollout_log_probs"], ref, atol=1e-4, rtol=0)
    lengths = out.batch["response_mask"].sum(1)
    ends = out.batch["responses"][torch.arange(12), lengths - 1]
    eos = build_tokenizer().eos_token_id
    assert ((lengths == R) | (ends == eos)).all(), "a response shorter than R must end in eos"


def test_load_weights_then_greedy_equals_hf_with_new_weights(engine, tok, tmp_path):
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    rollout, hf, path = engine
    arch = hf.config.model_type
    new_path = save_tiny_model(tmp_path / "new", preset="tiny", arch=arch, seed=11)
    new_hf = AutoModelForCausalLM.from_pretrained(new_path, dtype=torch.float32).eval()
    prompts = make_prompts(tok, meta_info={"do_sample": False})
    with config_set(rollout, ignore_eos=True):
        before = rollout.generate_sequences(prompts).batch["responses"]
        try:
            rollout.load_weights(load_file(new_path / "model.safetensors").items())
            after = rollout.generate_sequences(prompts)
            assert not torch.equal(before, after.batch["responses"])
            assert after.batch["responses"].tolist() == hf_greedy(new_hf, prompts, R)
            torch.testing.assert_close(after.batch["rollout_log_probs"], teacher_forced_log_probs(new_hf, after),
                                       atol=1e-4, rtol=0)
        finally:
            rollout.load_weights(load_file(path / "model.safetensors").items())  # leave the fixture as found
        # Back on the old weights, with the prefix cache of the new ones dropped: the old output.
        assert torch.equal(rollout.generate_sequences(prompts).batch["responses"], before)


def test_release_resume_on_cpu_keeps_working(engine, tok):
    rollout, _, _ = engine
    prompts = make_prompts(tok, texts=["hi"], meta_info={"do_sample": False})
    before = rollout.generate_sequences(prompts).batch["responses"]
    rollout.release()
    rollout.resume()
    assert torch.equal(rollout.generate_sequences(prompts).batch["responses"], before)


def test_without_log_probs_the_same_samples_and_no_log_prob_key(engine, tok):
    """rollout.calculate_log_probs=false only drops the sampler's log-probs: the same seed draws the same tokens."""
    rollout, _, _ = engine
    meta = {"n": 3, "temperature": 0.8, "global_step": 5}  # the step fixes the call's seed: both calls draw alike
    with_lp = rollout.generate_sequences(make_prompts(tok, texts=["hi", "0123"], meta_info=dict(meta)))
    with config_set(rollout, calculate_log_probs=False):
        without = rollout.generate_sequences(make_prompts(tok, texts=["hi", "0123"], meta_info=dict(meta)))
    assert "rollout_log_probs" in with_lp.batch and "rollout_log_probs" not in without.batch
    assert len({tuple(r) for r in without.batch["responses"].tolist()}) > 1  # sampled, not one greedy answer
    for key in ("responses", "response_mask", "input_ids", "attention_mask", "position_ids"):
        assert torch.equal(with_lp.batch[key], without.batch[key]), key


# ---------------------------------------------------------------- server mode: the engine's add-request/step loop

def _serve_all(rollout, waves, max_steps=4):
    """Feeds `waves` (lists of requests) one per tick, then ticks until nothing is in flight; returns
    {request_id: output} and the number of ticks at which each request came back."""
    done, tick_of, ticks = {}, {}, 0
    waves = list(waves)
    while waves or rollout.llm.llm_engine.has_unfinished_requests():
        ticks += 1
        assert ticks < 200, "the engine never finished"
        for d in rollout.serve_tick(waves.pop(0) if waves else [], max_steps=max_steps):
            done[d["request_id"]] = d
            tick_of[d["request_id"]] = ticks
    return done, tick_of


def _request(rid, ids, **kw):
    return {"request_id": rid, "prompt_ids": ids, "max_tokens": R, **kw}


def test_serve_tick_greedy_equals_hf_with_requests_joining_mid_flight(engine, tok):
    """Requests added while others decode (continuous batching across ticks) decode exactly as HF greedy does,
    and their log-probs are the teacher-forced ones."""
    rollout, hf, _ = engine
    prompts = make_prompts(tok, meta_info={"do_sample": False})
    rows = [[t for t, m in zip(ids, mask) if m] for ids, mask in
            zip(prompts.batch["input_ids"].tolist(), prompts.batch["attention_mask"].tolist())]
    waves = [[_request(f"q{i}", rows[i], greedy=True, ignore_eos=True) for i in range(3)], [],
             [_request(f"q{i}", rows[i], greedy=True, ignore_eos=True) for i in range(3, len(rows))]]
    done, tick_of = _serve_all(rollout, waves)
    assert sorted(done) == sorted(f"q{i}" for i in range(len(rows)))
    assert min(tick_of[f"q{i}"] for i in range(3, len(rows))) > 3, "the late wave finishes after it was added"
    want = hf_greedy(hf, prompts, R)
    for i in range(len(rows)):
        assert done[f"q{i}"]["token_ids"] == want[i], i
        assert done[f"q{i}"]["finish_reason"] == "length"
    # the sampler's log-probs against one teacher-forced HF forward over the same tokens
    out = assemble_rollout_output(prompts, [done[f"q{i}"]["token_ids"] for i in range(len(rows))],
                                  [done[f"q{i}"]["log_probs"] for i in range(len(rows))], 1, R, tok.pad_token_id)
    torch.testing.assert_close(out.batch["rollout_log_probs"], teacher_forced_log_probs(hf, out), atol=1e-4, rtol=0)
    assert rollout.abort_in_flight() == []


def test_serve_tick_per_request_seed_draws_the_same_whatever_else_is_in_flight(engine, tok):
    rollout, _, _ = engine
    ids = [tok.bos_token_id, *tok("what is 2+2?", add_special_tokens=False)["input_ids"]]
    alone, _ = _serve_all(rollout, [[_request("a", ids, seed=123, temperature=0.9)]])
    crowd = [_request(f"o{i}", ids[: 2 + i], seed=i, temperature=0.9) for i in range(6)]
    mixed, _ = _serve_all(rollout, [crowd[:3], [_request("a", ids, seed=123, temperature=0.9)], crowd[3:]])
    other, _ = _serve_all(rollout, [[_request("a", ids, seed=124, temperature=0.9)]])
    assert mixed["a"]["token_ids"] == alone["a"]["token_ids"]
    torch.testing.assert_close(torch.tensor(mixed["a"]["log_probs"]), torch.tensor(alone["a"]["log_probs"]),
                               atol=1e-5, rtol=0)
    assert other["a"]["token_ids"] != alone["a"]["token_ids"], "another seed should draw another sample"


def test_abort_in_flight_drops_unfinished_requests(engine, tok):
    rollout, _, _ = engine
    ids = [tok.bos_token_id, *tok("hi", add_special_tokens=False)["input_ids"]]
    out = rollout.serve_tick([_request("long", ids, greedy=True, ignore_eos=True)], max_steps=2)
    assert out == []  # 2 steps < R tokens
    assert rollout.abort_in_flight() == ["long"]
    assert not rollout.llm.llm_engine.has_unfinished_requests()


def test_interrupt_hands_back_the_tokens_sampled_so_far(engine, tok):
    """What a weight update interrupts (fully_async): the tokens and log-probs so far, exactly the greedy prefix."""
    rollout, hf, _ = engine
    prompts = make_prompts(tok, meta_info={"do_sample": False})
    row = [t for t, m in zip(prompts.batch["input_ids"][0].tolist(), prompts.batch["attention_mask"][0].tolist()) if m]
    assert rollout.serve_tick([_request("cut", row, greedy=True, ignore_eos=True)], max_steps=5) == []
    (part,) = rollout.interrupt()
    assert part["request_id"] == "cut" and part["finish_reason"] == "abort"
    assert part["token_ids"] == hf_greedy(hf, prompts, R)[0][:5]
    assert len(part["log_probs"]) == 5
    assert not rollout.llm.llm_engine.has_unfinished_requests() and rollout.interrupt() == []


class _InProcessGroup:
    """The worker-group call shape (`group.method.remote(...).get()`, DP_PER_REPLICA lists) over one real
    ServingRole host in this process: the server's logic against the real engine, without Ray."""

    def __init__(self, host):
        from types import SimpleNamespace

        def call(fn, per_replica=False):
            def remote(*args, **kwargs):
                value = fn(*[a[0] for a in args], **kwargs) if per_replica else fn(*args, **kwargs)
                result = [value] if per_replica or fn.__name__ != "begin" else value
                return SimpleNamespace(get=lambda timeout=None: result)
            return SimpleNamespace(remote=remote)

        def begin(version):
            host._start_serving_clock()
            return {}

        self.begin_serving = call(begin)
        self.serve_tick = call(host.serve_tick, per_replica=True)
        self.interrupt_serving = call(host.interrupt_serving)
        self.end_serving = call(host.end_serving)


@pytest.mark.parametrize("partial", [True, False])
def test_a_weight_update_mid_request_continues_it_under_the_new_weights(engine, tok, tmp_path, partial):
    """RolloutServer.update_weights between two ticks (fully_async's weight sync), on the real engine. Partial
    rollouts: the request keeps its tokens of version 1 (the old model's greedy prefix) and goes on from there
    with the new model, version 2: HF greedy of the new model continuing the prefix, with the new model's
    teacher-forced log-probs. Without: the caller gets RequestInterrupted and no tokens."""
    import asyncio

    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    from hybridflow.rollout.server import RolloutServer
    from hybridflow.rollout.server_api import RequestInterrupted, TurnSampling
    from megatron_workers.serving import ServingRole

    rollout, hf, path = engine
    new_path = save_tiny_model(tmp_path / "new", preset="tiny", arch=hf.config.model_type, seed=11)
    new_hf = AutoModelForCausalLM.from_pretrained(new_path, dtype=torch.float32).eval()
    host = ServingRole()
    host.rollout, host.weight_version = rollout, 1
    server = RolloutServer(_InProcessGroup(host), 1, max_steps_per_tick=4)
    ids = [tok.bos_token_id, *tok("count to ten", add_special_tokens=False)["input_ids"]]
    sampling = TurnSampling(max_tokens=R, greedy=True)

    def transfer():
        rollout.load_weights(load_file(new_path / "model.safetensors").items())
        host.weight_version = 2
        return "sent"

    async def scenario():
        async with server.running(weight_version=1):
            request = asyncio.create_task(server.generate(ids, sampling, "traj"))
            while server.stats["ticks"] < 1:
                await asyncio.sleep(0.01)
            record = await server.update_weights(transfer, 2, partial_rollout=partial)
            try:
                return record, await request
            except RequestInterrupted as e:
                return record, e

    try:
        with config_set(rollout, ignore_eos=True):  # the server's requests take it from the config
            record, out = asyncio.run(scenario())
    finally:
        rollout.load_weights(load_file(path / "model.safetensors").items())
    assert record["transfer"] == "sent" and record["interrupted"] == 1.0
    if not partial:
        assert isinstance(out, RequestInterrupted)
        assert server.stats["dropped"] == 1
        return
    m = out.token_versions.count(1)
    assert 4 <= m < R and out.token_versions == [1] * m + [2] * (R - m)
    assert len(out.token_ids) == len(out.log_probs) == R and out.min_weight_version == 1 and out.weight_version == 2
    # Greedy under each model, checked by teacher forcing over the sampled tokens (one HF forward per model): every
    # token of version 1 is the old model's argmax, every token of version 2 the new model's (within fp32 noise:
    # random tiny models have near-ties, which HF's own cached decoding may break the other way).
    with torch.no_grad():
        full = torch.tensor([ids + out.token_ids])
        old_logits = hf(full).logits[0, len(ids) - 1:-1].float()
        new_logits = new_hf(full).logits[0, len(ids) - 1:-1].float()
    for t, tok_id in enumerate(out.token_ids):
        logits = old_logits[t] if t < m else new_logits[t]
        assert logits.max() - logits[tok_id] < 1e-2, (t, m, tok_id, int(logits.argmax()))
    assert not torch.equal(old_logits[m:].argmax(-1), new_logits[m:].argmax(-1)), "the new weights changed nothing"
    want = torch.log_softmax(new_logits[m:], -1).gather(-1, torch.tensor(out.token_ids[m:])[:, None])[:, 0]
    torch.testing.assert_close(torch.tensor(out.log_probs[m:]), want, atol=1e-4, rtol=0)
    want_old = torch.log_softmax(old_logits[:m], -1).gather(-1, torch.tensor(out.token_ids[:m])[:, None])[:, 0]
    torch.testing.assert_close(torch.tensor(out.log_probs[:m]), want_old, atol=1e-4, rtol=0)
