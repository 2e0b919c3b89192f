"""Weights from the training pool to a separate rollout pool, shard to shard (asynchronous RL).

The colocated 3D-HybridEngine (planner.py, engine.py) reshards inside one world where every rank is
both a trainer and a rollout rank. For async RL the rollout runs on processes of its own, so the
weights travel from the T training ranks to the R rollout ranks over one extra process group that
spans both pools (`make_sync_group`: gloo on CPU, NCCL on GPU, created once from a TCPStore; it is a
bare backend object, so neither pool's default group is touched). Sync-group ranks: training ranks
0..T-1 (their own world ranks), then rollout ranks T..T+R-1.

The plan is pure and lives in cross_pool_plan.py (`plan_cross_pool`): every rollout rank receives exactly
its vLLM shard, M/t_g, from the training replica and stage that hold it, bucket by bucket.

Execution:
  trainer   `TrainerSender.send()` posts, bucket by bucket, the pieces of its live training shards and
            waits for them (timeout per message); `send(wait=False)` first snapshots the parameters it
            sends (a clone: memory <= its own training shard), posts everything and returns a
            `PendingSend`, so the next update may run while the bytes go out; `.wait()` later.
  rollout   `RolloutReceiver.iter_buckets()` receives bucket by bucket into freshly allocated generation
            shards; `receive_into(vllm)` streams them through the colocated path's `VllmShardConverter`
            + `load_into_vllm` (CPU: full-shaped tensors with only this rank's region filled, allocated
            locally and never sent; GPU: direct copy into vLLM's fused parameters).
  handshake `TrainerSender.for_megatron` / `RolloutReceiver.connect` are collective over the sync group:
            training rank 0 broadcasts (dims, every stage's specs, dtypes, model shape), rollout rank 0
            (sync rank T) broadcasts (R, t_g, vLLM's vocab pad, bucket_bytes); every rank then builds
            the same plan. The trainer never imports vLLM; the rollout never builds a Megatron model.

Measured (this 2-core CPU box shared with other jobs, torch 2.13 gloo over loopback, fp32). Link
(`measure_bandwidth`, one 64 MiB message, best of 3): 1.3-2.6 GiB/s between two processes (2.6-4.0 GiB/s
for 16-256 MiB on a quiet moment). Transport alone (tests/reshard_scripts/cross_pool_transport.py bench: a
25.8M-parameter synthetic model, 103.6 MB, 64 MiB buckets, best of 3 syncs after a warm-up):
  t=2 -> t_g=1, R=1   103.6 MB per rollout rank, link 2.34 GiB/s: bound 41 ms, sync 63 ms (1.5x)
  t=1 -> t_g=2, R=2    51.8 MB per rollout rank (the one trainer sends 103.6 MB: bound 41 ms), sync 37-43 ms
  t=2,p=2 -> t_g=2     51.8 MB per rollout rank from 4 senders, link 2.16 GiB/s: bound 22 ms, sync 37-54 ms
                       (6 processes on 2 cores: loopback copies need the CPU the other ranks use)
End to end with the tiny model (0.45 MB, 64 KiB buckets, tests/test_cross_pool_sync.py): 0.02-0.05 s per sync
including vLLM's CPU reload, against a byte bound of 0.13-0.3 ms: at that size the time is per-message and
reload overhead (~25 messages, 6-10 buckets), not bandwidth.
"""

from __future__ import annotations

import datetime
import pickle
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass

import torch
import torch.distributed as dist

from hybridflow.parallel.dims import LayoutError, ModelShape, ParallelDims
from hybridflow.resharding.cross_pool_plan import (
    DEFAULT_BUCKET_BYTES,
    CrossPoolError,
    CrossPoolPlan,
    RolloutLayout,
    plan_cross_pool,
)
from hybridflow.resharding.intervals import local_offset
from hybridflow.resharding.planner import ParamSpec
from hybridflow.resharding.waits import wait_or_raise

BANDWIDTH_TAG = 1 << 30  # message tags of measure_bandwidth; plan messages are numbered from 0


# ---- the sync group ---------------------------------------------------------------------------------------------


def _timedelta(seconds: float) -> datetime.timedelta:
    return datetime.timedelta(seconds=seconds)


@dataclass
class SyncGroup:
    """One process group over both pools: a bare c10d backend (not registered with torch.distributed's world)."""

    backend_name: str
    pg: object  # ProcessGroupGloo / ProcessGroupNCCL
    rank: int
    size: int
    timeout_s: float
    store: object  # keeps the TCPStore (and on rank 0 its server) alive as long as the group

    @property
    def device(self) -> torch.device:
        return torch.device("cuda", torch.cuda.current_device()) if self.backend_name == "nccl" else torch.device("cpu")

    def wait(self, work, what: str, timeout_s: float | None = None) -> None:
        timeout = _timedelta(self.timeout_s if timeout_s is None else timeout_s)
        wait_or_raise(work, timeout, CrossPoolError, f"sync rank {self.rank}/{self.size}: {what}")

    def send(self, tensor: torch.Tensor, dst: int, tag: int):
        return self.pg.send([tensor], dst, tag)

    def recv(self, tensor: torch.Tensor, src: int, tag: int):
        return self.pg.recv([tensor], src, tag)

    def broadcast_object(self, obj, root: int, what: str):
        """`obj` from sync rank `root` on every rank (pickled: the group is the job's own, trusted processes)."""
        dev = self.device
        data = pickle.dumps(obj) if self.rank == root else b""
        size = torch.tensor([len(data)], dtype=torch.int64, device=dev)
        opts = dist.BroadcastOptions()
        opts.rootRank, opts.rootTensor, opts.timeout = root, 0, _timedelta(self.timeout_s)
        self.wait(self.pg.broadcast([size], opts), f"{what}: size from sync rank {root}")
        if self.rank == root:
            buf = torch.frombuffer(bytearray(data), dtype=torch.uint8).to(dev)
        else:
            buf = torch.empty(int(size.item()), dtype=torch.uint8, device=dev)
        self.wait(self.pg.broadcast([buf], opts), f"{what}: {int(size.item())} bytes from sync rank {root}")
        return obj if self.rank == root else pickle.loads(buf.cpu().numpy().tobytes())


def detect_backend() -> str:
    return "nccl" if torch.cuda.is_available() and dist.is_nccl_available() else "gloo"


def make_sync_group(host: str, port: int, rank: int, world: int, timeout_s: float = 120.0,
                    backend: str | None = None, prefix: str = "hybridflow_weight_sync") -> SyncGroup:
    """The cross-pool group, created once: rank 0 serves a TCPStore at host:port; every rank joins within timeout_s.

    Training ranks take 0..T-1 and rollout ranks T..T+R-1. backend: None detects (NCCL with CUDA, gloo otherwise;
    every rank must detect the same). Neither pool's default process group is used or changed.
    """
    if not 0 <= rank < world:
        raise CrossPoolError(f"make_sync_group: rank {rank} outside world {world}")
    backend = backend or detect_backend()
    timeout = _timedelta(timeout_s)
    try:
        store = dist.TCPStore(host, port, world_size=world, is_master=rank == 0, timeout=timeout,
                              wait_for_workers=True)
    except (RuntimeError, OSError) as e:
        role = "serve" if rank == 0 else "reach"
        raise CrossPoolError(f"sync rank {rank}/{world}: could not {role} the weight-sync store at {host}:{port} "
                             f"within {timeout_s:.0f} s: {e}") from e
    prefixed = dist.PrefixStore(prefix, store)
    try:
        if backend == "gloo":
            pg = dist.ProcessGroupGloo(prefixed, rank, world, timeout)
        elif backend == "nccl":
            opts = dist.ProcessGroupNCCL.Options()
            opts._timeout = timeout
            pg = dist.ProcessGroupNCCL(prefixed, rank, world, opts)
        else:
            raise CrossPoolError(f"make_sync_group: backend={backend!r}; expected 'gloo' or 'nccl'")
    except RuntimeError as e:
        raise CrossPoolError(f"sync rank {rank}/{world}: {backend} group over {host}:{port} failed: {e}") from e
    return SyncGroup(backend, pg, rank, world, timeout_s, store)


def measure_bandwidth(group: SyncGroup, src: int, dst: int, nbytes: int = 64 << 20, repeats: int = 3) -> float:
    """Bytes/s of one src -> dst message of `nbytes` (best of `repeats` after a warm-up). Only src and dst call it."""
    if group.rank not in (src, dst):
        raise CrossPoolError(f"measure_bandwidth: sync rank {group.rank} is neither src {src} nor dst {dst}")
    buf = torch.zeros(nbytes, dtype=torch.uint8, device=group.device)
    best = float("inf")
    for i in range(repeats + 1):
        start = time.perf_counter()
        if group.rank == src:
            group.wait(group.send(buf, dst, BANDWIDTH_TAG + i), f"bandwidth message {i} to {dst}")
        else:
            group.wait(group.recv(buf, src, BANDWIDTH_TAG + i), f"bandwidth message {i} from {src}")
        if group.device.type == "cuda":
            torch.cuda.synchronize()
        if i:
            best = min(best, time.perf_counter() - start)
    return nbytes / best


# ---- handshake --------------------------------------------------------------------------------------------------


def handshake(group: SyncGroup, num_train: int | None = None, trainer: dict | None = None,
              rollout: dict | None = None) -> CrossPoolPlan:
    """Collective over the sync group; every rank gets the same plan.

    Sync rank 0 passes trainer = {"dims", "specs", "dtypes", "model"}; sync rank T (rollout rank 0) passes
    rollout = {"layout", "vocab_pad", "bucket_bytes"}; the rest pass None. num_train: T where the caller knows it
    (training ranks; rollout ranks learn it from the first broadcast).
    """
    t_info = group.broadcast_object(trainer, 0, "weight-sync handshake (trainer manifest)")
    if t_info is None:
        raise CrossPoolError("sync rank 0 must be training rank 0 and pass the trainer manifest")
    dims: ParallelDims = t_info["dims"]
    if num_train is not None and num_train != dims.world_size:
        raise CrossPoolError(f"sync rank {group.rank}: training pool of {num_train} ranks, training rank 0 says "
                             f"{dims} = {dims.world_size}")
    r_info = group.broadcast_object(rollout, dims.world_size, "weight-sync handshake (rollout manifest)")
    if r_info is None:
        raise CrossPoolError(f"sync rank {dims.world_size} (rollout rank 0) must pass the rollout manifest")
    layout: RolloutLayout = r_info["layout"]
    if dims.world_size + layout.ranks != group.size:
        raise CrossPoolError(f"the sync group has {group.size} ranks; {dims.world_size} training ranks ({dims}) + "
                             f"{layout.ranks} rollout ranks = {dims.world_size + layout.ranks}")
    return plan_cross_pool(dims, layout, t_info["specs"], t_info["model"], r_info["bucket_bytes"],
                           r_info["vocab_pad"], t_info["dtypes"])


# ---- trainer side -----------------------------------------------------------------------------------------------


def megatron_named_params(model_chunks) -> list[tuple[str, torch.Tensor]]:
    """(global name, parameter) of every chunk; a tied model's output layer is the embedding (sent once)."""
    from megatron_workers import hf_mapping

    chunks = list(model_chunks) if isinstance(model_chunks, (list, tuple)) else [model_chunks]
    tied = bool(getattr(hf_mapping.unwrap(chunks[0]), "share_embeddings_and_output_weights", False))
    return [(n, p) for c in chunks for n, p in hf_mapping.global_named_parameters(c)
            if not (tied and n == "output_layer.weight")]


def _as_rows(t: torch.Tensor, spec: ParamSpec) -> tuple[torch.Tensor, int]:
    return (t.reshape(1), 0) if not spec.full_shape else (t, spec.partition_dim)


@dataclass
class SyncStats:
    seconds: float = 0.0
    bytes: int = 0  # sent (trainer) or received (rollout)
    expected_bytes: int = 0
    buckets: int = 0
    messages: int = 0
    wait_s: float = 0.0  # in message waits
    load_s: float = 0.0  # rollout: vLLM load beyond the receive (CPU reload / GPU copy)
    snapshot_bytes: int = 0  # trainer, send(wait=False): the copy that lets the next update run

    def as_dict(self) -> dict:
        return asdict(self)

    def as_metrics(self, prefix: str = "weight_sync") -> dict[str, float]:
        """The step metrics: timing_s/weight_sync and the bytes (per rank; the driver reduces)."""
        return {"timing_s/weight_sync": self.seconds, f"{prefix}/bytes": float(self.bytes),
                f"{prefix}/expected_bytes": float(self.expected_bytes), f"{prefix}/buckets": float(self.buckets)}


class PendingSend:
    """Sends in flight (send(wait=False)); `wait()` before the next send. Holds the snapshot until then."""

    def __init__(self, sender: TrainerSender, works: list, stats: SyncStats, start: float, keep: list):
        self._sender, self._works, self.stats, self._start, self._keep = sender, works, stats, start, keep
        self.done = False

    def wait(self) -> SyncStats:
        if not self.done:
            t0 = time.perf_counter()
            for i, (work, msg) in enumerate(self._works):
                self._sender.group.wait(work, f"message {i + 1}/{len(self._works)} ({msg.name} rows "
                                              f"[{msg.start}, {msg.stop}) to rollout rank {msg.dst})")
            self.stats.wait_s += time.perf_counter() - t0
            self.stats.seconds = time.perf_counter() - self._start
            self._works, self._keep, self.done = [], [], True
        return self.stats


class TrainerSender:
    """The training rank's side: sends its planned pieces of the live shards returned by `shards_fn`.

    shards_fn() -> {global Megatron name: this rank's training shard (its stage only)}.
    """

    def __init__(self, plan: CrossPoolPlan, train_rank: int, shards_fn: Callable[[], dict[str, torch.Tensor]],
                 group: SyncGroup):
        if group.rank != train_rank:
            raise CrossPoolError(f"training rank {train_rank} must be sync rank {train_rank}, got {group.rank}")
        self.plan, self.rank, self.shards_fn, self.group = plan, train_rank, shards_fn, group
        self._pending: PendingSend | None = None
        self._index = {s.name: k for k, s in enumerate(plan.specs)}

    @classmethod
    def for_megatron(cls, dims: ParallelDims, model_chunks, hf_config, group: SyncGroup,
                     train_group=None) -> TrainerSender:
        """Collective over the training world (spec gather) and the sync group (handshake). Megatron must be set up."""
        from hybridflow.resharding.megatron_specs import gather_param_specs, param_specs
        from megatron_workers import hf_mapping
        from megatron_workers.model_builder import read_hf_facts

        rank = dist.get_rank(train_group)
        if dist.get_world_size(train_group) != dims.world_size:
            raise CrossPoolError(f"training world has {dist.get_world_size(train_group)} ranks, dims {dims} "
                                 f"{dims.world_size}")
        chunks = list(model_chunks) if isinstance(model_chunks, (list, tuple)) else [model_chunks]
        if len(chunks) != dims.vpp:
            raise LayoutError(f"TrainerSender got {len(chunks)} model chunks per rank, dims.vpp={dims.vpp}")
        named = megatron_named_params(chunks)
        if any(hf_mapping.is_expert(n) for n, _ in named):
            # plan_cross_pool reads every training TP rank of a stage as a holder; experts live on one EP rank's
            # ranks, split over etp (the colocated HybridEngine plans them: planner.ParamSpec.ep_owner).
            raise LayoutError("split pools (a separate rollout pool) do not sync MoE experts yet; colocate the "
                              "rollout with the actor (the 3D-HybridEngine plans experts)")
        local_specs, _ = param_specs(
            named, tp=dims.tp, pp_stage=dims.coords(rank)["pp"], vocab_size=read_hf_facts(hf_config).vocab_size,
            gen_vocab_pad_multiple=1,  # vLLM's padding comes from the rollout side in the handshake
            is_vocab=lambda name: hf_mapping.describe(name, hf_config).kind == hf_mapping.VOCAB)
        specs = gather_param_specs(local_specs, train_group)
        per_rank: list = [None] * dims.world_size
        dist.all_gather_object(per_rank, {n: str(p.dtype).removeprefix("torch.") for n, p in named}, group=train_group)
        dtype_of = {n: d for part in per_rank for n, d in part.items()}
        manifest = None
        if rank == 0:
            manifest = {"dims": dims, "specs": specs, "dtypes": [dtype_of[s.name] for s in specs],
                        "model": ModelShape.from_hf_config(hf_config)}
        plan = handshake(group, num_train=dims.world_size, trainer=manifest)

        def shards():
            return {n: p.detach() for n, p in megatron_named_params(chunks)}

        return cls(plan, rank, shards, group)

    def _checked(self, shards: dict[str, torch.Tensor], spec: ParamSpec) -> torch.Tensor:
        if spec.name not in shards:
            raise CrossPoolError(f"training rank {self.rank}: no training shard of {spec.name!r} "
                                 f"(stage {spec.pp_stage}) to send")
        t = shards[spec.name]
        want = spec.shard_shape(self.plan.holds(self.rank, spec))
        if tuple(t.shape) != want:
            raise CrossPoolError(f"training rank {self.rank}: {spec.name!r} has shape {tuple(t.shape)}, the plan "
                                 f"expects {want}")
        return t

    def _post(self, msgs, shards, stats: SyncStats, works: list, keep: list) -> None:
        for msg in msgs:
            spec = self.plan.spec(msg.name)
            src = self._checked(shards, spec)
            rows, dim = _as_rows(src, spec)
            view = rows.narrow(dim, local_offset(self.plan.holds(self.rank, spec), msg.start, msg.stop),
                               msg.stop - msg.start)
            if not view.is_contiguous():
                view = view.contiguous()
            keep.append(view)
            works.append((self.group.send(view, self.plan.sync_rank(msg.dst), msg.tag), msg))
            stats.bytes += view.numel() * view.element_size()
            stats.messages += 1

    def send(self, wait: bool = True) -> SyncStats | PendingSend:
        """Send this rank's pieces of the current weights. wait=False: snapshot, post all, return a PendingSend."""
        if self._pending is not None:
            self._pending.wait()
            self._pending = None
        start = time.perf_counter()
        stats = SyncStats(expected_bytes=self.plan.send_bytes(self.rank), buckets=len(self.plan.buckets))
        live = self.shards_fn()
        mine = [m for m in self.plan.messages if m.src == self.rank]
        with torch.no_grad():
            if not wait:
                names = {m.name for m in mine}
                shards = {n: self._checked(live, self.plan.spec(n)).clone() for n in names}
                stats.snapshot_bytes = sum(t.numel() * t.element_size() for t in shards.values())
                works: list = []
                keep: list = []
                self._post(mine, shards, stats, works, keep)
                self._pending = PendingSend(self, works, stats, start, keep)
                return self._pending
            for b in range(len(self.plan.buckets)):
                works, keep = [], []
                self._post([m for m in self.plan.bucket_messages(b) if m.src == self.rank], live, stats, works, keep)
                t0 = time.perf_counter()
                for i, (work, msg) in enumerate(works):
                    self.group.wait(work, f"bucket {b}: message {i + 1}/{len(works)} ({msg.name} rows "
                                          f"[{msg.start}, {msg.stop}) to rollout rank {msg.dst})")
                stats.wait_s += time.perf_counter() - t0
        stats.seconds = time.perf_counter() - start
        return stats


# ---- rollout side -----------------------------------------------------------------------------------------------


class RolloutReceiver:
    """The rollout rank's side: receives exactly its generation shards, bucket by bucket."""

    def __init__(self, plan: CrossPoolPlan, rollout_rank: int, group: SyncGroup):
        if group.rank != plan.sync_rank(rollout_rank):
            raise CrossPoolError(f"rollout rank {rollout_rank} must be sync rank {plan.sync_rank(rollout_rank)} "
                                 f"(after {plan.num_train} training ranks), got {group.rank}")
        if not plan.dtypes:
            raise CrossPoolError("RolloutReceiver needs a plan with dtypes (from the handshake)")
        self.plan, self.rank, self.group = plan, rollout_rank, group
        self.stats = SyncStats()

    @classmethod
    def connect(cls, group: SyncGroup, layout: RolloutLayout, rollout_rank: int,
                bucket_bytes: int = DEFAULT_BUCKET_BYTES, vocab_pad: int | None = None) -> RolloutReceiver:
        """Collective over the sync group (the handshake). vocab_pad: None asks vLLM (vllm_layout.vllm_vocab_pad)."""
        from hybridflow.resharding.vllm_layout import vllm_vocab_pad

        manifest = None
        if rollout_rank == 0:
            manifest = {"layout": layout, "bucket_bytes": bucket_bytes,
                        "vocab_pad": vllm_vocab_pad() if vocab_pad is None else vocab_pad}
        plan = handshake(group, rollout=manifest)
        if plan.rollout != layout:
            raise CrossPoolError(f"rollout rank {rollout_rank} was started for {layout}, rollout rank 0 says "
                                 f"{plan.rollout}")
        return cls(plan, rollout_rank, group)

    def iter_buckets(self) -> Iterator[dict[str, torch.Tensor]]:
        """{global Megatron name: this rank's generation shard} per bucket; sets self.stats."""
        plan, st = self.plan, SyncStats(expected_bytes=self.plan.expected_recv_bytes(self.rank))
        self.stats = st
        dev = self.group.device
        for b, (lo, hi) in enumerate(plan.buckets):
            start = time.perf_counter()
            out: dict[str, torch.Tensor] = {}
            for k in range(lo, hi):
                spec = plan.specs[k]
                out[spec.name] = torch.empty(spec.shard_shape(plan.needs(self.rank, spec)), dtype=plan.dtype_of(k),
                                             device=dev)
            works, unstage = [], []
            for msg in plan.bucket_messages(b):
                if msg.dst != self.rank:
                    continue
                spec = plan.spec(msg.name)
                rows, dim = _as_rows(out[msg.name], spec)
                view = rows.narrow(dim, local_offset(plan.needs(self.rank, spec), msg.start, msg.stop),
                                   msg.stop - msg.start)
                target = view
                if not view.is_contiguous():
                    target = torch.empty(view.shape, dtype=view.dtype, device=dev)
                    unstage.append((target, view))
                works.append((self.group.recv(target, msg.src, msg.tag), msg))
                st.bytes += target.numel() * target.element_size()
                st.messages += 1
            t0 = time.perf_counter()
            for i, (work, msg) in enumerate(works):
                self.group.wait(work, f"bucket {b}: message {i + 1}/{len(works)} ({msg.name} rows "
                                      f"[{msg.start}, {msg.stop}) from training rank {msg.src})")
            st.wait_s += time.perf_counter() - t0
            for buf, view in unstage:
                view.copy_(buf)
            st.buckets += 1
            st.seconds += time.perf_counter() - start
            yield out

    def receive(self) -> dict[str, torch.Tensor]:
        """Every generation shard at once (tests, benchmarks); prefer receive_into to stream into vLLM."""
        out: dict[str, torch.Tensor] = {}
        for part in self.iter_buckets():
            out.update(part)
        return out

    def receive_into(self, rollout, hf_config, device_kind: str = "auto", poison: float | None = None) -> SyncStats:
        """Receive and load into `rollout` (VLLMRollout, vllm.LLM or a model runner); reset its prefix cache.

        stats.seconds: the whole sync as the rollout sees it (receive + load), the timing_s/weight_sync metric.
        """
        from hybridflow.resharding.vllm_layout import VllmShardConverter, load_into_vllm

        start = time.perf_counter()
        converter = VllmShardConverter(self.plan, hf_config, self.rank)
        load = load_into_vllm(rollout, self.iter_buckets(), device_kind, converter=converter, poison=poison)
        st = self.stats
        recv_s = st.seconds
        st.seconds = time.perf_counter() - start
        st.load_s = max(0.0, load["load_s"] - recv_s)
        if st.bytes != st.expected_bytes:
            raise CrossPoolError(f"rollout rank {self.rank}: received {st.bytes} bytes, the plan says "
                                 f"{st.expected_bytes}")
        return st

