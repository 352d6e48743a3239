"""Counting where the host waits for a tensor's value (a stream synchronisation on a GPU).

A learner step that reads a device value back (`.item()`, `float(t)`, `if t.any():`, a boolean
mask index whose result size depends on the data) stalls the host until the GPU has finished
everything queued before it, so the host can no longer run ahead to queue the next kernels. The
step keeps its counts and metrics on the device and reads them once at its end; `HostReads`
counts what is left, on any device, so a CPU test can hold that count down (on CUDA,
`torch.cuda.set_sync_debug_mode` sees the same reads from the driver's side).

Counted: the reads of a value (`item`, `tolist`, `numpy`, `bool`/`int`/`float` of a tensor),
copies from a non-CPU device to the host, and the operations whose output shape depends on the
data (`nonzero`, `masked_select`, `unique`, indexing with a boolean mask).
"""

from __future__ import annotations

from collections import Counter
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

_VALUE_READS = frozenset(
    {"item", "tolist", "numpy", "__bool__", "__int__", "__float__", "__index__"}
)
_DATA_DEPENDENT_SHAPES = frozenset(
    {
        "nonzero",
        "argwhere",
        "masked_select",
        "unique",
        "unique_consecutive",
        "_unique",
        "_unique2",
    }
)
_INDEXING = frozenset({"__getitem__", "__setitem__", "index_put", "index_put_"})


def _has_bool_index(index: Any) -> bool:
    if isinstance(index, torch.Tensor):
        return index.dtype == torch.bool
    if isinstance(index, tuple | list):
        return any(_has_bool_index(part) for part in index)
    return False


def _leaves_device(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
    """A copy of a GPU (or other non-CPU) tensor to the host."""
    source = args[0] if args else None
    if not isinstance(source, torch.Tensor) or source.device.type == "cpu":
        return False
    name = getattr(func, "__name__", "")
    if name == "cpu":
        return True
    if name != "to":
        return False
    target = kwargs.get("device", args[1] if len(args) > 1 else None)
    return isinstance(target, str | torch.device) and torch.device(target).type == "cpu"


class HostReads(TorchFunctionMode):
    """Within `with HostReads() as reads:`, `reads.total` host reads and `reads.by_name`."""

    def __init__(self) -> None:
        super().__init__()
        self.by_name: Counter[str] = Counter()

    @property
    def total(self) -> int:
        return sum(self.by_name.values())

    def __torch_function__(
        self,
        func: Any,
        types: Any,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        kwargs = kwargs or {}
        name = getattr(func, "__name__", str(func))
        reads_value = name in _VALUE_READS and args and isinstance(args[0], torch.Tensor)
        if reads_value or name in _DATA_DEPENDENT_SHAPES:
            self.by_name[name] += 1
        elif name in _INDEXING and len(args) > 1 and _has_bool_index(args[1]):
            self.by_name["bool_index"] += 1
        elif _leaves_device(func, args, kwargs):
            self.by_name["to_host"] += 1
        return func(*args, **kwargs)
