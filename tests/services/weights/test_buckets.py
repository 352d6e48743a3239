"""Bucket plans and the packed byte layout, with plain tensors of several dtypes."""

from __future__ import annotations

import pytest
import torch

from services.weights.base import TensorSpec
from services.weights.buckets import (
    ALIGN,
    HostPacker,
    bucket_layout,
    bucket_nbytes,
    bucket_tensors,
    pack_bucket,
    plan_buckets,
    unpack_bucket,
)


def spec_of(name: str, tensor: torch.Tensor) -> TensorSpec:
    return TensorSpec(name, tuple(tensor.shape), str(tensor.dtype).removeprefix("torch."))


def mixed_tensors() -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    return {
        "bf16": torch.randn(3, 5, generator=generator).to(torch.bfloat16),  # 30 bytes: unaligned
        "f32": torch.randn(7, generator=generator),
        "i64": torch.randint(-(2**40), 2**40, (4, 2), generator=generator),
        "i8": torch.randint(-128, 127, (9,), dtype=torch.int8, generator=generator),
        "bool": torch.rand(5, generator=generator) > 0.5,
        "scalar": torch.tensor(2.5, dtype=torch.float64),
        "empty": torch.zeros(0, 4),
        "f16": torch.randn(2, 3, generator=generator).half(),
    }


def test_a_bucket_round_trips_bitwise_for_every_dtype() -> None:
    tensors = mixed_tensors()
    specs = [spec_of(name, tensor) for name, tensor in tensors.items()]
    flat = pack_bucket(list(tensors.values()))
    assert flat.dtype == torch.uint8 and flat.dim() == 1
    assert flat.numel() == bucket_nbytes(specs)
    offsets, _ = bucket_layout(specs)
    assert all(offset % ALIGN == 0 for offset in offsets)
    unpacked = unpack_bucket(flat, specs)
    assert list(unpacked) == list(tensors)
    for name, tensor in tensors.items():
        got = unpacked[name]
        assert got.dtype == tensor.dtype and got.shape == tensor.shape, name
        # Bitwise: compare the raw bytes (NaN-safe, and exact for every dtype).
        assert torch.equal(got.reshape(-1).view(torch.uint8), tensor.reshape(-1).view(torch.uint8))


def test_non_contiguous_tensors_are_packed_by_value() -> None:
    base = torch.arange(24, dtype=torch.float32).reshape(4, 6)
    column = base[:, 1]  # stride 6
    transposed = base.t()
    flat = pack_bucket([column, transposed])
    out = unpack_bucket(flat, [spec_of("c", column), spec_of("t", transposed)])
    assert torch.equal(out["c"], column) and torch.equal(out["t"], transposed)


def test_unpacked_views_share_the_flat_buffer_and_pack_back_without_a_copy() -> None:
    specs = [TensorSpec("a", (3,), "bfloat16"), TensorSpec("b", (2, 2), "int32")]
    flat = torch.zeros(bucket_nbytes(specs), dtype=torch.uint8)
    views = unpack_bucket(flat, specs)
    views["a"].copy_(torch.tensor([1.0, 2.0, 3.0]))
    views["b"].fill_(7)
    packed = pack_bucket([views["a"], views["b"]])
    assert packed.data_ptr() == flat.data_ptr() and packed.numel() == flat.numel()
    again = unpack_bucket(packed.clone(), specs)
    assert again["a"].tolist() == [1.0, 2.0, 3.0] and again["b"].tolist() == [[7, 7], [7, 7]]


def test_a_reused_buffer_packs_the_same_bytes_as_a_fresh_one_its_gaps_zeroed() -> None:
    """A sender's buffer holds the last bucket's bytes: the alignment gaps and the tail past
    the new bucket are zeroed, so the digest of a packed bucket never sees stale bytes."""
    tensors = list(mixed_tensors().values())
    fresh = pack_bucket(tensors)
    stale = torch.full((fresh.numel() + 64,), 0xAB, dtype=torch.uint8)
    packed = pack_bucket(tensors, into=stale)
    assert packed.data_ptr() == stale.data_ptr() and torch.equal(packed, fresh)
    with pytest.raises(ValueError, match="cannot hold"):
        pack_bucket(tensors, into=stale[:8])


def test_a_host_packer_reuses_one_buffer_grown_to_the_largest_bucket() -> None:
    packer = HostPacker()
    small = [torch.randn(20)[::2]]  # a view with gaps: copied, not handed back
    large = list(mixed_tensors().values())
    first = packer.pack(large)
    assert torch.equal(first, pack_bucket(large))
    address = first.data_ptr()
    second = packer.pack(small)  # over the first: valid until the next pack
    assert second.data_ptr() == address and torch.equal(second, pack_bucket(small))
    bigger = [torch.randn(2000)[::2]]
    assert torch.equal(packer.pack(bigger), pack_bucket(bigger))
    # Host views of one packed buffer are handed back as that buffer, not copied.
    specs = [TensorSpec("a", (3,), "float32")]
    flat = torch.zeros(bucket_nbytes(specs), dtype=torch.uint8)
    assert packer.pack([unpack_bucket(flat, specs)["a"]]).data_ptr() == flat.data_ptr()


def test_views_in_another_order_are_copied_not_reused() -> None:
    specs = [TensorSpec("a", (4,), "float32"), TensorSpec("b", (4,), "float32")]
    flat = torch.zeros(bucket_nbytes(specs), dtype=torch.uint8)
    views = unpack_bucket(flat, specs)
    views["a"].fill_(1.0)
    views["b"].fill_(2.0)
    packed = pack_bucket([views["b"], views["a"]])
    assert packed.data_ptr() != flat.data_ptr()
    swapped = unpack_bucket(packed, specs)
    assert swapped["a"].tolist() == [2.0] * 4 and swapped["b"].tolist() == [1.0] * 4


def test_plan_keeps_order_and_fills_buckets_up_to_the_limit() -> None:
    specs = [TensorSpec(f"t{i}", (16,), "float32") for i in range(7)]  # 64 bytes each
    plan = plan_buckets(specs, 3 * ALIGN)
    assert [[s.name for s in bucket] for bucket in plan] == [
        ["t0", "t1", "t2"],
        ["t3", "t4", "t5"],
        ["t6"],
    ]
    assert all(bucket_nbytes(bucket) <= 3 * ALIGN for bucket in plan)
    flat = [spec for bucket in plan for spec in bucket]
    assert flat == specs


def test_a_tensor_larger_than_a_bucket_gets_a_bucket_of_its_own() -> None:
    small = TensorSpec("small", (4,), "float32")
    big = TensorSpec("big", (1000,), "bfloat16")  # 2000 bytes, bucket 256
    plan = plan_buckets([small, big, TensorSpec("small2", (4,), "float32")], 256)
    assert [[s.name for s in bucket] for bucket in plan] == [["small"], ["big"], ["small2"]]


def test_alignment_counts_towards_the_bucket_size() -> None:
    # 30 + 30 bytes of payload, but the second starts at 64: 94 bytes packed.
    specs = [TensorSpec("a", (15,), "bfloat16"), TensorSpec("b", (15,), "bfloat16")]
    assert bucket_nbytes(specs) == ALIGN + 30
    assert len(plan_buckets(specs, 93)) == 2
    assert len(plan_buckets(specs, 94)) == 1


def test_bad_input_is_refused_with_a_clear_error() -> None:
    with pytest.raises(ValueError, match="no tensors"):
        plan_buckets([], 1024)
    with pytest.raises(ValueError, match="bucket_bytes must be > 0"):
        plan_buckets([TensorSpec("a", (1,), "float32")], 0)
    with pytest.raises(ValueError, match=r"repeat: \['a'\]"):
        plan_buckets([TensorSpec("a", (1,), "float32")] * 2, 1024)
    with pytest.raises(ValueError, match="empty bucket"):
        pack_bucket([])
    specs = [TensorSpec("a", (4,), "float32")]
    with pytest.raises(ValueError, match="holds 15 bytes, its specs need 16"):
        unpack_bucket(torch.zeros(15, dtype=torch.uint8), specs)
    with pytest.raises(ValueError, match="1-D uint8"):
        unpack_bucket(torch.zeros(4), specs)
    with pytest.raises(ValueError, match="unknown dtype 'float99'"):
        _ = TensorSpec("x", (1,), "float99").torch_dtype


def test_bucket_tensors_checks_names_shapes_and_dtypes() -> None:
    specs = [TensorSpec("a", (2,), "float32"), TensorSpec("b", (1,), "int64")]
    good = {"b": torch.tensor([3]), "a": torch.zeros(2)}
    assert [t.dtype for t in bucket_tensors(good, specs)] == [torch.float32, torch.int64]
    with pytest.raises(ValueError, match=r"missing \['b'\], unexpected \['c'\]"):
        bucket_tensors({"a": torch.zeros(2), "c": torch.zeros(1)}, specs)
    with pytest.raises(ValueError, match=r"tensor 'a': got torch\.float64"):
        bucket_tensors({"a": torch.zeros(2, dtype=torch.float64), "b": torch.tensor([3])}, specs)
