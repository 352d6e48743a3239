"""Delta publishes (`pipeline.weight_delta`): a bucket sent as what changed since the last
version its receiver holds, instead of all of its bytes.

Between two RL steps at the learning rates RL uses most bf16 weights do not move at all (an
update smaller than half a bf16 step rounds back to the same value), so a packed bucket
(`buckets.pack_bucket`) differs from the previous version's in few 2-byte words. A bucket is
encoded against the previous version's bytes as one of:

- `sparse`: the changed words' indices (int32, or int64 past 2**31 words) then their new
  values: 4 + 2 bytes per changed bf16 value;
- `xor`: the previous bytes XOR the new ones, compressed with Zstandard (zeros almost all of
  it): smaller than `sparse` where changes cluster;
- `dense`: the bucket itself, where nothing earlier is held or the changed fraction passes
  the dense threshold (a delta would cost more than it saves).

Whichever of `sparse` and `xor` measures smaller is sent (`xor` is only tried where `sparse`
is not already tiny against the bucket: compressing costs time). Every patch carries the
digest (XXH3-128) of the bucket after it is applied; a receiver checks it, so a delta applied
to the wrong base, or a flipped byte on the way, is caught (`DeltaMismatchError`) and healed
by a dense resend, never loaded. The digest is for integrity, not authentication: the weight
group's own tags (`services.weights.auth`) authenticate what is sent.

Both ends hold the previous version's packed buckets in host memory (`DeltaBase`): the sender
to diff against, each receiver to apply to.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass

import torch
import xxhash
import zstandard
from torch import Tensor

from services.weights.base import PatchEncoding, PatchHeader, TensorSpec, WeightGroupError
from services.weights.buckets import bucket_nbytes

# A bucket whose changed fraction of words passes this is sent dense without trying a patch:
# past half, neither a sparse patch (3 words per changed bf16 word) nor a compressed XOR (about
# as many bytes as the changed words' low bits, spread over the bucket) saves enough.
DENSE_ABOVE = 0.5
# `xor` is compressed only where the sparse patch is over this share of the bucket's bytes:
# below it the patch is already small, and compressing a whole bucket costs time.
TRY_XOR_ABOVE = 1 / 256
ZSTD_LEVEL = 1  # fastest: XORed weights are mostly zeros, which every level compresses alike
# One compressor per process, on every core (a bucket of hundreds of MB splits into frames).
_COMPRESSOR = zstandard.ZstdCompressor(level=ZSTD_LEVEL, threads=-1)


class DeltaMismatchError(WeightGroupError):
    """A patch that cannot be applied (no base, a base of another version or size) or whose
    result's digest is not the sender's: nothing of it was loaded; the receiver needs the
    bucket dense."""


def bucket_digest(flat: Tensor) -> str:
    """XXH3-128 of a packed bucket's bytes (a 1-D uint8 tensor in host memory), as hex."""
    if flat.device.type != "cpu" or flat.dtype != torch.uint8:
        raise ValueError(
            f"a bucket digest reads host uint8 bytes, got {flat.dtype} on {flat.device}"
        )
    return xxhash.xxh3_128_hexdigest(memoryview(flat.contiguous().numpy()))  # type: ignore[arg-type]


def _words(flat: Tensor) -> Tensor:
    """The bucket as 2-byte words (every bf16/fp16/fp32 bucket has an even size), else bytes."""
    return flat.view(torch.int16) if flat.numel() % 2 == 0 else flat


def _index_dtype(words: int) -> torch.dtype:
    return torch.int32 if words < 2**31 else torch.int64


@dataclass(frozen=True)
class BucketPatch:
    """A patch as it travels: its header and its payload (1-D uint8, host)."""

    header: PatchHeader
    payload: Tensor


def encode_bucket(
    index: int,
    version: int,
    current: Tensor,
    previous: Tensor | None,
    base_version: int,
    dense_above: float = DENSE_ABOVE,
    scratch: Tensor | None = None,
) -> BucketPatch:
    """Bucket `index` of `version` (`current`, packed, on the host) as a patch against
    `previous` (the same bucket of `base_version`; None: dense). `scratch`: host bytes of at
    least the bucket's size to compute in (see `DeltaBase._scratch`), none of which the patch
    holds."""
    digest = bucket_digest(current)
    nbytes = current.numel()

    def patch(encoding: PatchEncoding, payload: Tensor, changed: float) -> BucketPatch:
        base = -1 if encoding == "dense" else base_version
        sent = payload.numel()
        header = PatchHeader(index, encoding, version, base, nbytes, digest, changed, sent)
        return BucketPatch(header, payload)

    if previous is None or previous.numel() != nbytes:
        return patch("dense", current, 1.0)
    new = _words(current)
    # One pass over both versions: the XOR's nonzero words are the changed ones, and it is
    # what the `xor` encoding compresses (counting a `!=` mask's sum instead is slower).
    xor = torch.bitwise_xor(new, _words(previous), out=_scratch_words(scratch, nbytes))
    count = int(torch.count_nonzero(xor))
    changed = count / max(new.numel(), 1)
    if changed > dense_above:
        return patch("dense", current, changed)
    index_dtype = _index_dtype(new.numel())
    sparse_bytes = count * (index_dtype.itemsize + new.element_size())
    if sparse_bytes > nbytes * TRY_XOR_ABOVE:
        # Compressed before the sparse patch is built: where it wins, the indices are never
        # gathered (the larger cost of the two at a few per cent changed).
        packed = _COMPRESSOR.compress(memoryview(xor.view(torch.uint8).numpy()))  # type: ignore[arg-type]
        if len(packed) < min(sparse_bytes, nbytes):
            return patch("xor", torch.frombuffer(bytearray(packed), dtype=torch.uint8), changed)
    if sparse_bytes >= nbytes:
        return patch("dense", current, changed)
    changed_at = xor.nonzero().squeeze(1)
    del xor
    indices = changed_at.to(index_dtype)
    payload = torch.cat([indices.view(torch.uint8), new[changed_at].view(torch.uint8)])
    return patch("sparse", payload, changed)


def _scratch_words(scratch: Tensor | None, nbytes: int) -> Tensor | None:
    """The first `nbytes` of `scratch` as the words of a bucket of that size (None: none)."""
    return None if scratch is None else _words(scratch[:nbytes])


def apply_patch(
    patch: BucketPatch,
    base: Tensor | None,
    base_version: int | None,
    scratch: Tensor | None = None,
) -> Tensor:
    """The bucket `patch` gives applied to `base` (this receiver's copy of the bucket, at
    `base_version`), which it updates in place (a dense patch: a copy of its payload where
    no base fits); `DeltaMismatchError` where it cannot apply or its digest is not the
    sender's (`base` is left unusable then: the caller drops it). `scratch`: as
    `encode_bucket`'s."""
    header = patch.header
    if header.encoding == "dense":
        if base is None or base.numel() != header.nbytes:
            base = patch.payload.clone()
        else:
            base.copy_(patch.payload)
    elif base is None or base_version != header.base_version or base.numel() != header.nbytes:
        held = "nothing" if base is None else f"version {base_version} ({base.numel()} bytes)"
        raise DeltaMismatchError(
            f"bucket {header.index} of version {header.version}: a patch against version "
            f"{header.base_version} ({header.nbytes} bytes), but this receiver holds {held}"
        )
    elif header.encoding == "sparse":
        _apply_sparse(header, patch.payload, base)
    else:
        _apply_xor(header, patch.payload, base, scratch)
    if bucket_digest(base) != header.digest:
        raise DeltaMismatchError(
            f"bucket {header.index} of version {header.version}: its digest after applying "
            f"the {header.encoding} patch is not the sender's"
        )
    return base


def _apply_sparse(header: PatchHeader, payload: Tensor, base: Tensor) -> None:
    words = _words(base)
    index_dtype = _index_dtype(words.numel())
    step = index_dtype.itemsize + words.element_size()
    if payload.numel() % step:
        raise DeltaMismatchError(f"bucket {header.index}: a sparse patch of a wrong length")
    count = payload.numel() // step
    split = count * index_dtype.itemsize
    indices = payload[:split].view(index_dtype).long()
    if count and (int(indices.min()) < 0 or int(indices.max()) >= words.numel()):
        raise DeltaMismatchError(f"bucket {header.index}: a sparse patch indexes past the bucket")
    words[indices] = payload[split:].view(words.dtype)


def _apply_xor(header: PatchHeader, payload: Tensor, base: Tensor, scratch: Tensor | None) -> None:
    # Decompressed into `scratch` (pages already mapped, not a fresh bucket-sized buffer each
    # time), exactly the bucket's size: a patch that ends early or runs past it is refused.
    nbytes = header.nbytes
    xor = scratch[:nbytes] if scratch is not None else torch.empty(nbytes, dtype=torch.uint8)
    out = memoryview(xor.numpy())  # type: ignore[arg-type]
    filled = 0
    try:
        with zstandard.ZstdDecompressor().stream_reader(
            memoryview(payload.numpy()),  # type: ignore[arg-type]
            read_across_frames=True,
        ) as reader:
            while filled < nbytes and (got := reader.readinto(out[filled:])):
                filled += got
            overrun = reader.read(1)
    except zstandard.ZstdError as error:
        raise DeltaMismatchError(
            f"bucket {header.index}: an xor patch that does not decompress ({error})"
        ) from None
    if filled != nbytes or overrun:
        raise DeltaMismatchError(f"bucket {header.index}: an xor patch of a wrong length")
    _words(base).bitwise_xor_(_words(xor))


class DeltaBase:
    """One end's copy of the last version it sent or received whole: its packed buckets, in
    host memory. `version` is None while nothing usable is held (at first, during a transfer,
    after one that stopped part-way): the next transfer is then dense."""

    def __init__(self, dense_above: float = DENSE_ABOVE) -> None:
        self.version: int | None = None
        self.dense_above = dense_above
        self._buckets: dict[int, Tensor] = {}
        self._receiving: int | None = None  # the version held when a transfer began
        # One bucket's worth of bytes to compute each XOR in, kept from bucket to bucket and
        # publish to publish: a fresh buffer of hundreds of MB costs its page faults each time
        # (more than the XOR itself).
        self._scratch: Tensor | None = None

    def _scratch_for(self, nbytes: int) -> Tensor:
        if self._scratch is None or self._scratch.numel() < nbytes:
            self._scratch = torch.empty(nbytes, dtype=torch.uint8)
        return self._scratch

    def encode(self, version: int, buckets: Iterable[Tensor]) -> Iterator[BucketPatch]:
        """The sender's patches of `version`, bucket by bucket (each packed, on the host),
        against what is held; what is held becomes `version` once the last is taken."""
        held, self.version = self.version, None
        index = -1
        # Counted by hand, and each bucket and patch let go before the next bucket is asked
        # for: `enumerate`'s reused result tuple would keep the previous bucket alive while the
        # sender gathers the next (two buckets held at once).
        for flat in buckets:
            index += 1
            previous = self._buckets.get(index) if held is not None else None
            patch = encode_bucket(
                index,
                version,
                flat,
                previous,
                -1 if held is None else held,
                self.dense_above,
                None if previous is None else self._scratch_for(flat.numel()),
            )
            self._keep(index, flat)
            del flat, previous
            yield patch
            del patch
        self._buckets = {i: kept for i, kept in self._buckets.items() if i <= index}
        self.version = version

    def _keep(self, index: int, flat: Tensor) -> None:
        """Hold a copy of `flat` (the sender's bucket may be a buffer reused for the next)."""
        held = self._buckets.get(index)
        if held is not None and held.numel() == flat.numel():
            held.copy_(flat)
        else:
            self._buckets[index] = flat.detach().to("cpu", copy=True)

    def apply(self, chain: Sequence[BucketPatch]) -> Tensor:
        """Apply `chain` (one bucket's patches of consecutive versions, oldest first) to what
        is held of it, for a receiver inside a transfer (`begin` .. `end`); the bucket's new
        bytes, held from now on (read them before the next transfer)."""
        if not chain:
            raise ValueError("an empty chain of patches")
        index = chain[0].header.index
        flat: Tensor | None = self._buckets.pop(index, None)
        version = self._receiving
        try:
            for patch in chain:
                xor = patch.header.encoding == "xor"
                scratch = self._scratch_for(patch.header.nbytes) if xor else None
                flat = apply_patch(patch, flat, version, scratch)
                version = patch.header.version
        except DeltaMismatchError:
            self.invalidate()  # what was held is partly patched: of no one version
            raise
        assert flat is not None  # the chain is not empty
        self._buckets[index] = flat
        return flat

    def begin(self) -> None:
        """A receiver starts a transfer: the copy is of no one version until `end`."""
        self._receiving, self.version = self.version, None

    def end(self, version: int, buckets: int) -> None:
        """Every one of `buckets` buckets of `version` was applied."""
        self._buckets = {i: flat for i, flat in self._buckets.items() if i < buckets}
        self.version = version

    def invalidate(self) -> None:
        """Forget what is held (a transfer stopped part-way, or a patch failed its digest)."""
        self.version = None
        self._receiving = None
        self._buckets.clear()
        self._scratch = None

    def held(self) -> Iterator[tuple[int, Tensor]]:
        """The held buckets, in order (the sender's dense resend reads them)."""
        return iter(sorted(self._buckets.items()))


def patch_bytes(patches: Sequence[BucketPatch]) -> int:
    """Bytes the payloads of `patches` send."""
    return sum(patch.payload.numel() for patch in patches)


def check_patch_specs(header: PatchHeader, specs: Sequence[TensorSpec]) -> None:
    """`DeltaMismatchError` unless the patch builds a bucket of `specs`' size."""
    if header.nbytes != bucket_nbytes(specs):
        raise DeltaMismatchError(
            f"bucket {header.index}: a patch of {header.nbytes} bytes for a bucket of "
            f"{bucket_nbytes(specs)}"
        )
