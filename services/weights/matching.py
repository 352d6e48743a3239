"""The one check of a set of weights against the model they are for: names, shapes, dtypes and
tied aliases.

Every place that loads or sends weights asks it, each with its own error type: a manifest
against a worker's model (services.weights.loading), a state dict against the hf or vLLM
backend's model, a checkpoint against the learner's model, and a checkpoint against the model an
export builds. A name of the model is covered when it or another name of the same tied tensor
is present (`tied`); a name the model lacks is unexpected unless the caller lets it through
(`ignorable`: e.g. the output head of a tied model, which vLLM skips). Shapes must be equal.
Dtypes are checked only where both sides give one, and only for what a copy cannot fix: a
floating tensor may arrive in another floating dtype (the copy casts), but an integer or bool
tensor must keep its dtype.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor


@dataclass(frozen=True)
class TensorShape:
    """What is checked of one tensor: its shape, and its dtype where known."""

    shape: tuple[int, ...]
    dtype: torch.dtype | None = None

    @classmethod
    def of(cls, tensor: Tensor) -> TensorShape:
        return cls(tuple(tensor.shape), tensor.dtype)


def shapes_of(tensors: Mapping[str, Tensor]) -> dict[str, TensorShape]:
    return {name: TensorShape.of(tensor) for name, tensor in tensors.items()}


def tied_groups(tensors: Mapping[str, Tensor]) -> list[list[str]]:
    """Names grouped by the storage they share (tied weights), in the mapping's order."""
    groups: dict[tuple[int, int, tuple[int, ...]], list[str]] = {}
    for name, tensor in tensors.items():
        where = (
            tensor.untyped_storage().data_ptr(),
            int(tensor.storage_offset()),
            tuple(tensor.shape),
        )
        groups.setdefault(where, []).append(name)
    return list(groups.values())


def _dtypes_fit(want: torch.dtype | None, got: torch.dtype | None) -> bool:
    if want is None or got is None or want == got:
        return True
    return want.is_floating_point and got.is_floating_point


def weights_mismatch(
    expected: Mapping[str, TensorShape],
    got: Mapping[str, TensorShape],
    *,
    tied: Iterable[Sequence[str]] = (),
    ignorable: Callable[[str], bool] = lambda name: False,
) -> str | None:
    """None if `got` covers `expected` (module doc); else what differs, naming the tensors:
    "missing [...]; unexpected [...]; wrong shapes [...]" (and wrong dtypes, if any)."""
    group_of = {name: list(group) for group in tied for name in group}
    missing = sorted(
        name
        for name in expected
        if name not in got and not any(other in got for other in group_of.get(name, ()))
    )
    unexpected = sorted(name for name in got if name not in expected and not ignorable(name))
    common = [name for name in expected if name in got]
    wrong_shape = [
        f"{name}: got {got[name].shape}, model has {expected[name].shape}"
        for name in common
        if tuple(got[name].shape) != tuple(expected[name].shape)
    ]
    wrong_dtype = [
        f"{name}: got {got[name].dtype}, model has {expected[name].dtype}"
        for name in common
        if not _dtypes_fit(expected[name].dtype, got[name].dtype)
    ]
    if not (missing or unexpected or wrong_shape or wrong_dtype):
        return None
    text = f"missing {missing}; unexpected {unexpected}; wrong shapes {wrong_shape}"
    return text + (f"; wrong dtypes {wrong_dtype}" if wrong_dtype else "")
