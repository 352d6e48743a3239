"""Delta patches of packed buckets (services/weights/delta.py): exact, the smaller encoding
chosen, and every wrong base or damaged byte caught by the digest instead of loaded."""

from __future__ import annotations

import pytest
import torch

from services.weights.delta import (
    DeltaBase,
    DeltaMismatchError,
    apply_patch,
    bucket_digest,
    encode_bucket,
)


def _bucket(seed: int, values: int = 50_000) -> torch.Tensor:
    """A packed bucket of bf16 weights (its bytes)."""
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(values, generator=generator).to(torch.bfloat16).view(torch.uint8).clone()


def _step(flat: torch.Tensor, lr: float, seed: int) -> torch.Tensor:
    """The bucket after a sign update of `lr` (what Adam's first steps do), rounded to bf16."""
    generator = torch.Generator().manual_seed(seed)
    weights = flat.view(torch.bfloat16).float()
    direction = torch.randn(weights.shape, generator=generator).sign()
    return (weights - lr * direction).to(torch.bfloat16).view(torch.uint8).clone()


def test_a_small_step_is_sent_sparse_and_applies_bitwise() -> None:
    old = _bucket(0)
    new = _step(old, 1e-4, 1)
    patch = encode_bucket(0, 1, new, old, 0)
    assert patch.header.encoding in ("sparse", "xor")
    assert 0 < patch.header.changed < 0.25
    assert patch.payload.numel() < new.numel() / 2
    out = apply_patch(patch, old.clone(), 0)
    assert torch.equal(out, new)


def test_nothing_held_or_too_much_changed_is_sent_dense() -> None:
    old = _bucket(0)
    first = encode_bucket(0, 1, old, None, -1)
    assert first.header.encoding == "dense" and first.header.base_version == -1
    moved = _bucket(5)  # every value new
    patch = encode_bucket(0, 2, moved, old, 1)
    assert patch.header.encoding == "dense"
    assert torch.equal(apply_patch(patch, None, None), moved)


def test_clustered_tiny_changes_are_sent_as_compressed_xor() -> None:
    old = _bucket(0)
    new = old.clone()
    words = new.view(torch.int16)
    words[: words.numel() // 5] ^= 1  # a fifth of the values, each by its last bit, together
    patch = encode_bucket(0, 1, new, old, 0)
    assert patch.header.encoding == "xor"
    assert patch.payload.numel() < words.numel() // 5  # under a byte per changed value
    assert torch.equal(apply_patch(patch, old.clone(), 0), new)


def test_a_patch_against_another_version_is_refused() -> None:
    old = _bucket(0)
    patch = encode_bucket(0, 2, _step(old, 1e-4, 1), old, 1)
    with pytest.raises(DeltaMismatchError, match="against version 1"):
        apply_patch(patch, old.clone(), 0)
    with pytest.raises(DeltaMismatchError, match="holds nothing"):
        apply_patch(patch, None, None)


@pytest.mark.parametrize("where", ["index", "value"])
def test_a_flipped_byte_in_a_sparse_patch_is_caught(where: str) -> None:
    old = _bucket(0)
    new = old.clone()
    new.view(torch.int16)[::997] ^= 0x0101  # scattered changes: sparse is the smaller
    patch = encode_bucket(0, 1, new, old, 0)
    assert patch.header.encoding == "sparse"
    count = patch.payload.numel() // 6
    at = 0 if where == "index" else count * 4
    patch.payload[at] ^= 0x10
    with pytest.raises(DeltaMismatchError):
        apply_patch(patch, old.clone(), 0)


def test_a_flipped_byte_in_an_xor_patch_is_caught() -> None:
    old = _bucket(0)
    new = old.clone()
    new.view(torch.int16)[:10_000] ^= 1
    patch = encode_bucket(0, 1, new, old, 0)
    assert patch.header.encoding == "xor"
    patch.payload[patch.payload.numel() // 2] ^= 0x01
    with pytest.raises(DeltaMismatchError):
        apply_patch(patch, old.clone(), 0)


def _versions(count: int) -> list[list[torch.Tensor]]:
    """`count` versions of a 3-bucket model, each a small step from the one before."""
    versions = [[_bucket(seed) for seed in range(3)]]
    for version in range(1, count):
        versions.append(
            [_step(flat, 1e-4, 10 * version + i) for i, flat in enumerate(versions[-1])]
        )
    return versions


def test_sender_and_receiver_bases_stay_bitwise_equal_over_versions() -> None:
    sender, receiver = DeltaBase(), DeltaBase()
    for version, buckets in enumerate(_versions(5)):
        patches = list(sender.encode(version, iter(buckets)))
        assert [p.header.encoding == "dense" for p in patches] == [version == 0] * 3
        receiver.begin()
        for patch, expected in zip(patches, buckets, strict=True):
            assert torch.equal(receiver.apply([patch]), expected)
        receiver.end(version, len(patches))
        assert sender.version == receiver.version == version


def test_a_receiver_that_skipped_versions_applies_the_chain() -> None:
    sender, receiver = DeltaBase(), DeltaBase()
    chains: list[list] = [[], [], []]
    for version, buckets in enumerate(_versions(4)):
        patches = list(sender.encode(version, iter(buckets)))
        if version == 0:
            receiver.begin()
            for patch in patches:
                receiver.apply([patch])
            receiver.end(0, 3)
            continue
        for patch in patches:
            chains[patch.header.index].append(patch)
    receiver.begin()
    final = _versions(4)[-1]
    for index, chain in enumerate(chains):
        assert torch.equal(receiver.apply(chain), final[index])
    receiver.end(3, 3)


def test_a_failed_patch_leaves_the_receiver_holding_nothing() -> None:
    sender, receiver = DeltaBase(), DeltaBase()
    versions = _versions(2)
    receiver.begin()
    for patch in sender.encode(0, iter(versions[0])):
        receiver.apply([patch])
    receiver.end(0, 3)
    patch = next(sender.encode(1, iter(versions[1])))
    patch.payload[-1] ^= 0x40
    receiver.begin()
    with pytest.raises(DeltaMismatchError):
        receiver.apply([patch])
    assert receiver.version is None and list(receiver.held()) == []


def test_a_send_stopped_part_way_makes_the_next_one_dense() -> None:
    sender = DeltaBase()
    versions = _versions(3)
    list(sender.encode(0, iter(versions[0])))
    stopped = sender.encode(1, iter(versions[1]))
    next(stopped)
    stopped.close()  # the transfer failed after one bucket
    assert sender.version is None
    patches = list(sender.encode(2, iter(versions[2])))
    assert {patch.header.encoding for patch in patches} == {"dense"}


def test_the_digest_is_of_the_bytes() -> None:
    flat = _bucket(0)
    other = flat.clone()
    other[7] ^= 1
    assert bucket_digest(flat) == bucket_digest(flat.clone()) != bucket_digest(other)
