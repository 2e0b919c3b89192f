"""DataProto: the batch that flows between the single controller and the SPMD workers.

A DataProto holds three things:
- ``batch``: ``dict[str, torch.Tensor]``, every tensor with the same leading (batch) dim;
- ``non_tensor_batch``: ``dict[str, np.ndarray]`` (object or numeric arrays), same leading dim;
- ``meta_info``: a plain dict that is not split, only carried along (temperature, step, metrics...).

Row operations (index, chunk, concat, repeat, pad) apply to ``batch`` and ``non_tensor_batch``
together, so per-sample strings (uids, raw prompts) stay aligned with their tensors.

Transport. Pickling turns every tensor into a numpy array (a zero-copy view of its memory). With
pickle protocol 5 and a ``buffer_callback`` -- which is what Ray's serializer uses -- numpy hands
its memory over as out-of-band buffers, so nothing is copied while pickling, and Ray's object store
hands the same memory back to the receiver without a copy either. Dtypes numpy lacks (bfloat16,
float8, complex32) travel as an integer view of the same item size and get their dtype back on
arrival.

Received batches are read-only. Tensors rebuilt from Ray's object store alias shared memory that
other readers on the node may be reading at the same time; numpy marks it read-only, torch cannot
express that. We do not copy (that would cost the whole point of zero-copy); we silence torch's
"not writable" warning instead, and the rule is: never write in place into a received batch
(``t[...] = x``, ``t.add_(...)``). Ordinary ops that return new tensors are fine. Call ``clone()``
first if you need to mutate.
"""

from __future__ import annotations

import copy
import pickle
import warnings
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

_FORMAT_VERSION = 1

# Torch dtypes that torch.Tensor.numpy() can express. Everything else travels as an integer view.
_NUMPY_NATIVE = {
    torch.bool, torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64,
    torch.uint16, torch.uint32, torch.uint64,
    torch.float16, torch.float32, torch.float64, torch.complex64, torch.complex128,
}
_INT_VIEW_BY_ITEMSIZE = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


# ---------------------------------------------------------------------------------------------
# tensor <-> numpy for transport
# ---------------------------------------------------------------------------------------------

def _tensor_to_wire(key: str, t: torch.Tensor) -> tuple[np.ndarray, str | None]:
    """(array, dtype tag). The tag is None for numpy-native dtypes, else the torch dtype name."""
    # detach: requires_grad does not travel; cpu/contiguous copy only when needed (no-op usually).
    t = t.detach().cpu().resolve_conj().resolve_neg()
    if not t.is_contiguous():
        t = t.contiguous()
    if t.dtype in _NUMPY_NATIVE:
        return t.numpy(), None
    view_dtype = _INT_VIEW_BY_ITEMSIZE.get(t.element_size())
    if view_dtype is None:
        raise TypeError(f"DataProto: tensor {key!r} has dtype {t.dtype} which cannot be serialized")
    return t.view(view_dtype).numpy(), str(t.dtype).removeprefix("torch.")


def _wire_to_tensor(arr: np.ndarray, tag: str | None) -> torch.Tensor:
    if arr.flags.writeable:
        t = torch.from_numpy(arr)
    else:
        # Read-only memory from the object store: aliased on purpose, see the module docstring.
        # (catch_warnings is not thread-safe; the worst a race can do is let the warning through.)
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
            t = torch.from_numpy(arr)
    return t if tag is None else t.view(getattr(torch, tag))


# Row copies (concat, gather) run through numpy for plain CPU tensors. Measured on the 2-core dev
# box: concatenating 64 MB of chunks takes 18 ms with np.concatenate and 50-110 ms with torch.cat
# (fresh page-faulted allocations plus OpenMP threads fighting for the cores); a 64 MB row gather
# 9 ms vs 16 ms. numpy keeps the dtype (bf16 via its integer view) but not autograd, so tensors
# that require grad, and non-CPU tensors, stay on the torch path.
def _numpy_ok(*tensors: torch.Tensor) -> bool:
    return all(t.device.type == "cpu" and not t.requires_grad
               and (t.dtype in _NUMPY_NATIVE or t.element_size() in _INT_VIEW_BY_ITEMSIZE) for t in tensors)


def _cat_rows(parts: list[torch.Tensor]) -> torch.Tensor:
    if not _numpy_ok(*parts):
        return torch.cat(parts, dim=0)
    wire = [_tensor_to_wire("", p) for p in parts]
    return _wire_to_tensor(np.concatenate([arr for arr, _ in wire], axis=0), wire[0][1])


def _take_rows(t: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    if not _numpy_ok(t):
        return t[index.to(t.device)]
    arr, tag = _tensor_to_wire("", t)
    return _wire_to_tensor(np.take(arr, index.numpy(), axis=0), tag)


# ---------------------------------------------------------------------------------------------
# small helpers
# ---------------------------------------------------------------------------------------------

def _to_object_array(values: Sequence) -> np.ndarray:
    # Fill element by element: np.array(list_of_equal_length_lists) would build a 2-D array.
    arr = np.empty(len(values), dtype=object)
    for i, v in enumerate(values):
        arr[i] = v
    return arr


def _as_list(keys: str | Sequence[str] | None) -> list[str] | None:
    if keys is None:
        return None
    return [keys] if isinstance(keys, str) else list(keys)


def _values_equal(a: Any, b: Any) -> bool:
    """Equality that works for tensors, numpy arrays (incl. object arrays) and plain values."""
    if a is b:
        return True
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.shape == b.shape
                and a.dtype == b.dtype and torch.equal(a.cpu(), b.cpu()))
    if isinstance(a, np.ndarray) or isinstance(b, np.ndarray):
        if not (isinstance(a, np.ndarray) and isinstance(b, np.ndarray)) or a.shape != b.shape:
            return False
        if a.dtype == object or b.dtype == object:
            return all(_values_equal(x, y) for x, y in zip(a.ravel(), b.ravel()))
        return bool(np.array_equal(a, b))
    try:
        return bool(a == b)
    except (ValueError, RuntimeError, TypeError):  # e.g. lists of arrays
        return False


def _missing(kind: str, keys: list[str], available) -> None:
    missing = [k for k in keys if k not in available]
    if missing:
        raise KeyError(f"DataProto: {kind} key(s) {missing} not found; available: {sorted(available)}")


# ---------------------------------------------------------------------------------------------
# DataProtoItem: one row
# ---------------------------------------------------------------------------------------------

@dataclass(eq=False)
class DataProtoItem:
    """One row of a DataProto. ``item[key]`` looks in batch, then non_tensor_batch."""

    batch: dict[str, torch.Tensor] = field(default_factory=dict)
    non_tensor_batch: dict[str, Any] = field(default_factory=dict)
    meta_info: dict = field(default_factory=dict)

    def __getitem__(self, key: str):
        if key in self.batch:
            return self.batch[key]
        if key in self.non_tensor_batch:
            return self.non_tensor_batch[key]
        raise KeyError(f"DataProtoItem: key {key!r} not found; available: {sorted(self.keys())}")

    def __contains__(self, key: str) -> bool:
        return key in self.batch or key in self.non_tensor_batch

    def keys(self) -> list[str]:
        return [*self.batch, *self.non_tensor_batch]


# ---------------------------------------------------------------------------------------------
# DataProto
# ---------------------------------------------------------------------------------------------

@dataclass(eq=False)
class DataProto:
    batch: dict[str, torch.Tensor] = field(default_factory=dict)
    non_tensor_batch: dict[str, np.ndarray] = field(default_factory=dict)
    meta_info: dict = field(default_factory=dict)

    def __post_init__(self):
        self.check_consistency()

    # ---- construction -----------------------------------------------------------------------

    @classmethod
    def from_dict(cls, tensors: dict | None = None, non_tensors: dict | None = None,
                  meta_info: dict | None = None) -> DataProto:
        """Tensors go to ``batch``; non-tensors must be numpy arrays or lists (-> object arrays)."""
        batch = {}
        for k, v in (tensors or {}).items():
            if not isinstance(v, torch.Tensor):
                raise TypeError(f"DataProto.from_dict: tensors[{k!r}] is {type(v).__name__}, expected torch.Tensor")
            batch[k] = v
        non_tensor = {}
        for k, v in (non_tensors or {}).items():
            if isinstance(v, (list, tuple)):
                v = _to_object_array(v)
            if not isinstance(v, np.ndarray):
                raise TypeError(f"DataProto.from_dict: non_tensors[{k!r}] is {type(v).__name__}, "
                                "expected np.ndarray or list")
            non_tensor[k] = v
        return cls(batch=batch, non_tensor_batch=non_tensor, meta_info=dict(meta_info or {}))

    @classmethod
    def from_single_dict(cls, d: dict, meta_info: dict | None = None) -> DataProto:
        """Routes torch tensors to ``batch`` and lists / numpy arrays to ``non_tensor_batch``."""
        tensors, non_tensors = {}, {}
        for k, v in d.items():
            if isinstance(v, torch.Tensor):
                tensors[k] = v
            elif isinstance(v, (np.ndarray, list, tuple)):
                non_tensors[k] = v
            else:
                raise TypeError(f"DataProto.from_single_dict: value for {k!r} is {type(v).__name__}; "
                                "expected torch.Tensor, np.ndarray or list (per-sample values)")
        return cls.from_dict(tensors, non_tensors, meta_info)

    def check_consistency(self) -> None:
        """Every tensor/array has a leading dim and they all agree; keys are not in both dicts."""
        ref_key, ref_size = None, None
        for kind, store, typ in (("batch", self.batch, torch.Tensor),
                                 ("non_tensor_batch", self.non_tensor_batch, np.ndarray)):
            for k, v in store.items():
                if not isinstance(v, typ):
                    raise TypeError(f"DataProto: {kind}[{k!r}] is {type(v).__name__}, expected {typ.__name__}")
                if v.ndim == 0:
                    raise ValueError(f"DataProto: {kind}[{k!r}] is 0-dimensional; it needs a leading batch dim")
                if ref_size is None:
                    ref_key, ref_size = k, v.shape[0]
                elif v.shape[0] != ref_size:
                    raise ValueError(f"DataProto: {kind}[{k!r}] has leading size {v.shape[0]}, "
                                     f"but {ref_key!r} has {ref_size}")
        both = set(self.batch) & set(self.non_tensor_batch)
        if both:
            raise ValueError(f"DataProto: key(s) {sorted(both)} are in both batch and non_tensor_batch")

    # ---- size and display ---------------------------------------------------------------------

    def __len__(self) -> int:
        for v in self.batch.values():
            return v.shape[0]
        for v in self.non_tensor_batch.values():
            return v.shape[0]
        return 0

    @property
    def nbytes(self) -> int:
        """Bytes of tensor and array data (object arrays count their pointers, not the objects)."""
        return (sum(t.numel() * t.element_size() for t in self.batch.values())
                + sum(a.nbytes for a in self.non_tensor_batch.values()))

    def __repr__(self) -> str:
        def fmt(v):
            dtype = str(v.dtype).removeprefix("torch.")
            return f"{tuple(v.shape)} {dtype}"
        batch = ", ".join(f"{k}: {fmt(v)}" for k, v in self.batch.items())
        non_tensor = ", ".join(f"{k}: {fmt(v)}" for k, v in self.non_tensor_batch.items())
        return (f"DataProto(len={len(self)}, batch={{{batch}}}, non_tensor_batch={{{non_tensor}}}, "
                f"meta_info_keys={list(self.meta_info)})")

    # ---- indexing -----------------------------------------------------------------------------

    def _derive(self, batch, non_tensor_batch, meta_info=None) -> DataProto:
        # meta_info is shallow-copied so that adding keys to a derived batch leaves the parent alone.
        return DataProto(batch=batch, non_tensor_batch=non_tensor_batch,
                         meta_info=dict(self.meta_info if meta_info is None else meta_info))

    def _normalize_index(self, idx) -> torch.Tensor:
        """Any integer/boolean index (list, numpy, tensor) -> int64 CPU tensor of valid rows."""
        n = len(self)
        if isinstance(idx, torch.Tensor):
            t = idx.detach().cpu()
        else:
            t = torch.as_tensor(np.asarray(idx))
        if t.dtype == torch.bool:
            if t.shape != (n,):
                raise IndexError(f"DataProto: boolean index has shape {tuple(t.shape)}, expected ({n},)")
            return t.nonzero().flatten()
        if t.is_floating_point() or t.is_complex() or t.ndim != 1:
            if t.numel() == 0 and t.ndim == 1:  # e.g. np.array([]) is float64
                return torch.zeros(0, dtype=torch.long)
            raise IndexError(f"DataProto: index must be a 1-D integer or boolean array, got {t.dtype} "
                             f"with shape {tuple(t.shape)}")
        t = t.long()
        if t.numel() and (t.min() < -n or t.max() >= n):
            bad = t[(t < -n) | (t >= n)][0].item()
            raise IndexError(f"DataProto: index {bad} out of range for DataProto of len {n}")
        return torch.where(t < 0, t + n, t)

    def _take(self, index: torch.Tensor) -> DataProto:
        np_index = index.numpy()
        return self._derive({k: _take_rows(v, index) for k, v in self.batch.items()},
                            {k: v[np_index] for k, v in self.non_tensor_batch.items()})

    def __getitem__(self, idx):
        if isinstance(idx, (int, np.integer)) and not isinstance(idx, bool):
            n, i = len(self), int(idx)
            if not -n <= i < n:
                raise IndexError(f"DataProto: index {i} out of range for DataProto of len {n}")
            i %= n
            return DataProtoItem(batch={k: v[i] for k, v in self.batch.items()},
                                 non_tensor_batch={k: v[i] for k, v in self.non_tensor_batch.items()},
                                 meta_info=self.meta_info)
        if isinstance(idx, slice):
            start, stop, step = idx.indices(len(self))
            if step != 1:  # torch cannot slice with negative steps; use a gather for any step
                return self._take(torch.arange(start, stop, step, dtype=torch.long))
            # Plain slices are views: no copy (chunk/split/unpad rely on this).
            return self._derive({k: v[start:stop] for k, v in self.batch.items()},
                                {k: v[start:stop] for k, v in self.non_tensor_batch.items()})
        if isinstance(idx, (torch.Tensor, np.ndarray, list, tuple, range)):
            return self._take(self._normalize_index(idx))
        if isinstance(idx, str):
            raise TypeError(f"DataProto: use dp.batch[{idx!r}] or dp.non_tensor_batch[{idx!r}] for key access")
        raise TypeError(f"DataProto: unsupported index type {type(idx).__name__}")

    def __iter__(self) -> Iterator[DataProtoItem]:
        for i in range(len(self)):
            yield self[i]

    # ---- key operations -----------------------------------------------------------------------

    def select(self, batch_keys=None, non_tensor_batch_keys=None, meta_info_keys=None,
               deepcopy: bool = False) -> DataProto:
        """New DataProto with only the given keys (None = all). Shares memory unless deepcopy."""
        bk, nk, mk = _as_list(batch_keys), _as_list(non_tensor_batch_keys), _as_list(meta_info_keys)
        for kind, keys, store in (("batch", bk, self.batch), ("non_tensor_batch", nk, self.non_tensor_batch),
                                  ("meta_info", mk, self.meta_info)):
            if keys is not None:
                _missing(kind, keys, store)
        batch = {k: self.batch[k] for k in (bk if bk is not None else self.batch)}
        non_tensor = {k: self.non_tensor_batch[k] for k in (nk if nk is not None else self.non_tensor_batch)}
        meta = {k: self.meta_info[k] for k in (mk if mk is not None else self.meta_info)}
        if deepcopy:
            batch = {k: v.clone() for k, v in batch.items()}
            non_tensor = copy.deepcopy(non_tensor)
            meta = copy.deepcopy(meta)
        return self._derive(batch, non_tensor, meta)

    def clone(self) -> DataProto:
        """A deep copy whose tensors own writable memory (use before writing into a received batch)."""
        return self.select(deepcopy=True)

    def pop(self, batch_keys=(), non_tensor_batch_keys=(), meta_info_keys=()) -> DataProto:
        """Removes the keys from self and returns them as a new DataProto."""
        bk, nk, mk = _as_list(batch_keys), _as_list(non_tensor_batch_keys), _as_list(meta_info_keys)
        _missing("batch", bk, self.batch)
        _missing("non_tensor_batch", nk, self.non_tensor_batch)
        _missing("meta_info", mk, self.meta_info)
        return DataProto(batch={k: self.batch.pop(k) for k in bk},
                         non_tensor_batch={k: self.non_tensor_batch.pop(k) for k in nk},
                         meta_info={k: self.meta_info.pop(k) for k in mk})

    def rename(self, old_keys, new_keys) -> DataProto:
        """Renames keys in batch or non_tensor_batch (wherever each lives). In place; returns self."""
        old, new = _as_list(old_keys), _as_list(new_keys)
        if len(old) != len(new):
            raise ValueError(f"DataProto.rename: {len(old)} old keys {old} but {len(new)} new keys {new}")
        all_keys = set(self.batch) | set(self.non_tensor_batch)
        _missing("batch/non_tensor_batch", old, all_keys)
        clash = [n for n in new if n in all_keys and n not in old]
        if clash or len(set(new)) != len(new):
            raise KeyError(f"DataProto.rename: new key(s) {clash or new} already exist or repeat")
        moved = [(o, n, self.batch if o in self.batch else self.non_tensor_batch) for o, n in zip(old, new)]
        values = [(n, store.pop(o), store) for o, n, store in moved]  # pop all first: allows swaps
        for n, v, store in values:
            store[n] = v
        return self

    def union(self, other: DataProto) -> DataProto:
        """Merges other's keys into self (in place; returns self). Shared keys must hold equal values."""
        if (self.batch or self.non_tensor_batch) and (other.batch or other.non_tensor_batch) \
                and len(self) != len(other):
            raise ValueError(f"DataProto.union: batch sizes differ: {len(self)} vs {len(other)}")
        for kind, mine, theirs in (("batch", self.batch, other.batch),
                                   ("non_tensor_batch", self.non_tensor_batch, other.non_tensor_batch),
                                   ("meta_info", self.meta_info, other.meta_info)):
            for k, v in theirs.items():
                if k in mine and not _values_equal(mine[k], v):
                    raise ValueError(f"DataProto.union: {kind} key {k!r} exists in both with different values")
        self.batch.update(other.batch)
        self.non_tensor_batch.update(other.non_tensor_batch)
        self.meta_info.update(other.meta_info)
        self.check_consistency()
        return self

    # ---- row operations -----------------------------------------------------------------------

    @staticmethod
    def concat(data: Sequence[DataProto]) -> DataProto:
        """Row-wise concatenation. All parts need the same keys; meta_info is taken from the first."""
        data = list(data)
        if not data:
            raise ValueError("DataProto.concat: got an empty list")
        first = data[0]
        for i, d in enumerate(data[1:], start=1):
            if set(d.batch) != set(first.batch) or set(d.non_tensor_batch) != set(first.non_tensor_batch):
                raise ValueError(
                    f"DataProto.concat: part {i} (len {len(d)}) has keys batch={sorted(d.batch)} "
                    f"non_tensor_batch={sorted(d.non_tensor_batch)}, but part 0 (len {len(first)}) has "
                    f"batch={sorted(first.batch)} non_tensor_batch={sorted(first.non_tensor_batch)}")
        batch = {}
        for k, v0 in first.batch.items():
            parts = [d.batch[k] for d in data]
            for i, p in enumerate(parts):
                if p.dtype != v0.dtype or p.shape[1:] != v0.shape[1:]:
                    raise ValueError(f"DataProto.concat: batch key {k!r} is {tuple(p.shape)} {p.dtype} in part "
                                     f"{i} but {tuple(v0.shape)} {v0.dtype} in part 0 (sizes {[len(d) for d in data]})")
            batch[k] = _cat_rows(parts)
        non_tensor = {}
        for k in first.non_tensor_batch:
            parts = [d.non_tensor_batch[k] for d in data]
            try:
                non_tensor[k] = np.concatenate(parts, axis=0)
            except ValueError as e:
                raise ValueError(f"DataProto.concat: non_tensor_batch key {k!r} shapes "
                                 f"{[p.shape for p in parts]} do not concatenate: {e}") from e
        return DataProto(batch=batch, non_tensor_batch=non_tensor, meta_info=dict(first.meta_info))

    def chunk(self, chunks: int) -> list[DataProto]:
        """Splits into `chunks` equal parts (views). len must be divisible by chunks."""
        n = len(self)
        if not isinstance(chunks, int) or chunks <= 0:
            raise ValueError(f"DataProto.chunk: chunks must be a positive int, got {chunks!r}")
        if n % chunks != 0:
            raise ValueError(f"DataProto.chunk: len {n} is not divisible by chunks={chunks}; "
                             "pad_to_divisor() first")
        size = n // chunks
        return [self[i * size:(i + 1) * size] for i in range(chunks)]

    def split(self, split_size: int) -> list[DataProto]:
        """Consecutive parts of split_size rows (views); the last part may be smaller."""
        if not isinstance(split_size, int) or split_size <= 0:
            raise ValueError(f"DataProto.split: split_size must be a positive int, got {split_size!r}")
        return [self[i:i + split_size] for i in range(0, len(self), split_size)]

    def repeat(self, repeat_times: int = 2, interleave: bool = True) -> DataProto:
        """interleave: [a,b] x2 -> [a,a,b,b]; otherwise [a,b,a,b]. Returns a new DataProto."""
        if not isinstance(repeat_times, int) or repeat_times < 1:
            raise ValueError(f"DataProto.repeat: repeat_times must be an int >= 1, got {repeat_times!r}")
        n = len(self)
        if interleave:
            index = torch.arange(n).repeat_interleave(repeat_times)
        else:
            index = torch.arange(n).repeat(repeat_times)
        return self._take(index)

    def reorder(self, indices) -> None:
        """Permutes rows in place (e.g. to undo a balancing permutation)."""
        taken = self._take(self._normalize_index(indices))
        self.batch, self.non_tensor_batch = taken.batch, taken.non_tensor_batch

    def pad_to_divisor(self, divisor: int) -> tuple[DataProto, int]:
        """Pads by repeating rows from the start (wrapping) until len % divisor == 0.

        Returns (padded, pad_size); the padded copy is a new DataProto even when pad_size == 0.
        """
        if not isinstance(divisor, int) or divisor <= 0:
            raise ValueError(f"DataProto.pad_to_divisor: divisor must be a positive int, got {divisor!r}")
        n = len(self)
        pad_size = (-n) % divisor
        if pad_size == 0:
            return self[:], 0
        index = torch.cat([torch.arange(n), torch.arange(pad_size) % n])
        return self._take(index), pad_size

    def unpad(self, pad_size: int) -> DataProto:
        """Drops the last pad_size rows (a view), undoing pad_to_divisor."""
        n = len(self)
        if not isinstance(pad_size, int) or not 0 <= pad_size <= n:
            raise ValueError(f"DataProto.unpad: pad_size {pad_size!r} is not in [0, len={n}]")
        return self[:n - pad_size]

    def make_iterator(self, mini_batch_size: int, epochs: int = 1, shuffle: bool = False,
                      seed: int | None = None) -> Iterator[DataProto]:
        """Yields mini-batches for `epochs` passes. With shuffle, each epoch draws a fresh
        permutation from one generator seeded with `seed`, so a seed fixes the whole sequence."""
        n = len(self)
        if not isinstance(mini_batch_size, int) or mini_batch_size <= 0:
            raise ValueError(f"DataProto.make_iterator: mini_batch_size must be a positive int, "
                             f"got {mini_batch_size!r}")
        if n % mini_batch_size != 0:
            raise ValueError(f"DataProto.make_iterator: len {n} is not divisible by mini_batch_size={mini_batch_size}")
        if not isinstance(epochs, int) or epochs < 1:
            raise ValueError(f"DataProto.make_iterator: epochs must be an int >= 1, got {epochs!r}")
        gen = torch.Generator()
        if seed is None:
            gen.seed()
        else:
            gen.manual_seed(seed)

        def iterate():  # inner generator so that the checks above run at call time
            for _ in range(epochs):
                if shuffle:
                    order = torch.randperm(n, generator=gen)
                    for i in range(0, n, mini_batch_size):
                        yield self._take(order[i:i + mini_batch_size])
                else:
                    yield from self.split(mini_batch_size)

        return iterate()

    # ---- devices ------------------------------------------------------------------------------

    def to(self, device, non_blocking: bool = False) -> DataProto:
        """Moves every tensor to `device`, in place; returns self."""
        self.batch = {k: v.to(device, non_blocking=non_blocking) for k, v in self.batch.items()}
        return self

    # ---- serialization ------------------------------------------------------------------------

    def __getstate__(self) -> dict:
        # Tensors become numpy views (no copy for contiguous CPU tensors), which pickle protocol 5
        # passes out of band; see the module docstring.
        return {
            "version": _FORMAT_VERSION,
            "batch": {k: _tensor_to_wire(k, v) for k, v in self.batch.items()},
            "non_tensor_batch": self.non_tensor_batch,
            "meta_info": self.meta_info,
        }

    def __setstate__(self, state: dict) -> None:
        if state.get("version") != _FORMAT_VERSION:
            raise ValueError(f"DataProto: unknown serialized format version {state.get('version')!r}, "
                             f"expected {_FORMAT_VERSION}")
        self.batch = {k: _wire_to_tensor(arr, tag) for k, (arr, tag) in state["batch"].items()}
        self.non_tensor_batch = dict(state["non_tensor_batch"])
        self.meta_info = dict(state["meta_info"])

    def save_to_disk(self, path) -> None:
        """Pickles to `path` (protocol 5, in-band). Only load files you trust."""
        with open(path, "wb") as f:
            pickle.dump(self, f, protocol=5)

    @staticmethod
    def load_from_disk(path) -> DataProto:
        with open(path, "rb") as f:
            obj = pickle.load(f)
        if not isinstance(obj, DataProto):
            raise TypeError(f"DataProto.load_from_disk: {path} holds a {type(obj).__name__}, not a DataProto")
        return obj
