"""The one check of weights against a model: names, shapes, dtypes, tied aliases."""

from __future__ import annotations

import torch

from services.weights.matching import TensorShape, shapes_of, tied_groups, weights_mismatch

EMBED = "model.embed_tokens.weight"
HEAD = "lm_head.weight"


def test_every_difference_is_named() -> None:
    expected = {"a": TensorShape((2, 3)), "b": TensorShape((4,)), "c": TensorShape((1,))}
    assert weights_mismatch(expected, dict(expected)) is None
    got = {"a": TensorShape((3, 2)), "c": TensorShape((1,)), "z": TensorShape((5,))}
    assert weights_mismatch(expected, got) == (
        "missing ['b']; unexpected ['z']; wrong shapes ['a: got (3, 2), model has (2, 3)']"
    )


def test_a_tied_name_is_covered_by_any_name_of_its_tensor() -> None:
    embed = torch.zeros(5, 2)
    model = {EMBED: embed, HEAD: embed, "other": torch.zeros(5, 2)}
    groups = tied_groups(model)
    assert groups == [[EMBED, HEAD], ["other"]]
    expected = shapes_of(model)
    assert weights_mismatch(expected, shapes_of({HEAD: embed, "other": embed}), tied=groups) is None
    missing = weights_mismatch(expected, shapes_of({"other": embed}), tied=groups)
    assert missing == f"missing ['{HEAD}', '{EMBED}']; unexpected []; wrong shapes []"


def test_a_copy_may_cast_floats_but_not_integers() -> None:
    expected = {"w": TensorShape((2,), torch.float32), "ids": TensorShape((2,), torch.int64)}
    cast = {"w": TensorShape((2,), torch.bfloat16), "ids": TensorShape((2,), torch.int64)}
    assert weights_mismatch(expected, cast) is None
    wrong = {"w": TensorShape((2,), torch.float32), "ids": TensorShape((2,), torch.float32)}
    assert weights_mismatch(expected, wrong) == (
        "missing []; unexpected []; wrong shapes []; "
        "wrong dtypes ['ids: got torch.float32, model has torch.int64']"
    )
    unknown = {"w": TensorShape((2,)), "ids": TensorShape((2,))}  # no dtype given: not checked
    assert weights_mismatch(expected, unknown) is None


def test_names_a_caller_lets_through_are_not_unexpected() -> None:
    expected = {EMBED: TensorShape((5, 2))}
    got = {EMBED: TensorShape((5, 2)), HEAD: TensorShape((5, 2))}
    assert weights_mismatch(expected, got, ignorable=lambda name: name == HEAD) is None
    assert weights_mismatch(expected, got) == (
        f"missing []; unexpected ['{HEAD}']; wrong shapes []"
    )
