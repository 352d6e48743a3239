"""Authentication of a weight group's messages: one random key per group, HMAC-SHA256 tags.

A weight group meets at a TCPStore and moves its bytes over gloo/NCCL connections, and neither
authenticates anyone: whoever reaches the node can read, write and delete the store's keys, and
whoever sits on the path can alter a broadcast. So every message a member acts on carries a tag
that only a holder of the group's key can make:

- The key: 32 random bytes (`new_key`), made by the group's rank 0 when it opens the group and
  handed to every member inside the `WeightGroup` through Ray's calls (Ray's authenticated
  channel); it is never written to the store. A re-formed group has a new key, so nothing of an
  earlier group verifies in a later one.
- A tag is HMAC-SHA256(key, context + body). The context names the message's slot: for a store
  value the group's generation and the store key it was written under (a genuine message copied
  to another key fails), for a broadcast the publish and bucket it belongs to.
- A store value is sealed (`seal`: the tag in hex, then the body) and checked on the raw bytes
  before anything in it is parsed (`unseal`).
- A bucket's tag commits to a digest of its content where its bytes are in host memory (gloo's
  TCP broadcast, a shared-memory file: what a stranger on the path or the node could alter),
  computed by the sender and again by each receiver over what it got, before anything is
  loaded (`content_digest`: SHA-256 over the SHA-256 of each 4 MiB chunk, hashed on a few
  threads, since hashlib releases the GIL; tens of milliseconds per 64 MB bucket). A bucket in
  GPU memory (NCCL, CUDA IPC) is not re-hashed: that would cost a synchronising device-to-host
  copy per bucket on each side, the hot path's worst stall. Its tag still binds its publish,
  version, index and size, and its header and IPC handle are sealed, so nothing a stranger
  writes into the store is loaded; its bytes on the wire rely on the Ray pods' NetworkPolicy
  like NCCL's own traffic (docs/deploy.md).

A failed check raises `WeightAuthenticationError` naming the group, the rank and the message
(its store key, or its publish and bucket), and nothing of the message is loaded.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import os
import secrets
import threading
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor

from torch import Tensor
from torch._C._distributed_c10d import Store

from services.weights.base import WeightAuthenticationError, WeightGroup

KEY_BYTES = 32
TAG_BYTES = 32  # an HMAC-SHA256 tag
DIGEST_CHUNK_BYTES = 4 * 2**20
DIGEST_THREADS = 8
# Versions the construction: a tag made by another scheme never verifies under this one.
DOMAIN = "kpo-weights/auth/1"

Context = Sequence[str | int]


def new_key() -> bytes:
    """A fresh group key (rank 0 makes one per group it opens)."""
    return secrets.token_bytes(KEY_BYTES)


def tag(key: bytes, context: Context, body: bytes) -> bytes:
    """HMAC-SHA256 of `body` in its `context` (the message's slot) under `key`."""
    if len(key) != KEY_BYTES:
        raise ValueError(f"a weight group key is {KEY_BYTES} bytes, got {len(key)}")
    framed = json.dumps([DOMAIN, *context], separators=(",", ":")).encode() + b"\n"
    return hmac.new(key, framed + body, hashlib.sha256).digest()


def verify(key: bytes, context: Context, body: bytes, received: bytes) -> bool:
    """Whether `received` is `body`'s tag in `context` (compared in constant time)."""
    return hmac.compare_digest(tag(key, context, body), received)


def seal(key: bytes, context: Context, body: bytes) -> bytes:
    """A store value: `body`'s tag (hex) followed by `body`."""
    return tag(key, context, body).hex().encode() + body


def unseal(key: bytes, context: Context, sealed: bytes) -> bytes | None:
    """The body of a sealed store value, or None where its tag does not verify (nothing of the
    value is parsed before)."""
    width = 2 * TAG_BYTES
    try:
        received = bytes.fromhex(sealed[:width].decode("ascii"))
    except ValueError:  # not hex (or not ASCII): not sealed by a member
        return None
    body = sealed[width:]
    if len(received) != TAG_BYTES or not verify(key, context, body, received):
        return None
    return body


# --- content digests ----------------------------------------------------------------------------

_POOL: tuple[int, ThreadPoolExecutor] | None = None
_POOL_LOCK = threading.Lock()


def _pool() -> ThreadPoolExecutor:
    """The hashing threads of this process (made again in a forked child, whose copy of the
    parent's pool has no threads)."""
    global _POOL
    with _POOL_LOCK:
        if _POOL is None or _POOL[0] != os.getpid():
            workers = max(1, min(DIGEST_THREADS, os.cpu_count() or 1))
            _POOL = (os.getpid(), ThreadPoolExecutor(workers, thread_name_prefix="kpo-digest"))
        return _POOL[1]


def content_digest(flat: Tensor) -> bytes:
    """The digest a bucket's tag commits to (a flat uint8 tensor). In host memory: SHA-256 of
    its bytes, as a tree (the SHA-256 of its length and of the SHA-256 of each
    `DIGEST_CHUNK_BYTES` chunk). In GPU memory: of its length only (see the module docstring:
    no synchronising copy to the host per bucket)."""
    if flat.device.type != "cpu":
        return hashlib.sha256(b"device-bucket" + flat.numel().to_bytes(8, "little")).digest()
    host = flat.detach()
    size = host.numel()
    # Through a holder emptied before returning: a pool thread may keep its last task (and
    # so what that task references) a moment after its result is in, and the bucket must be
    # freed when its sender lets go of it, not then.
    holder = [memoryview(host.contiguous().numpy()).cast("B")]  # type: ignore[arg-type]

    def leaf(start: int) -> bytes:
        return hashlib.sha256(holder[0][start : start + DIGEST_CHUNK_BYTES]).digest()

    starts = range(0, size, DIGEST_CHUNK_BYTES)
    try:
        if len(starts) > 1:
            leaves = list(_pool().map(leaf, starts))
        else:
            leaves = [leaf(start) for start in starts]
    finally:
        holder.clear()
    root = hashlib.sha256(size.to_bytes(8, "little"))
    for digest in leaves:
        root.update(digest)
    return root.digest()


# --- sealed store values of a group -------------------------------------------------------------

STORE_PREFIX = "kpo-weights"


def store_prefix(group: WeightGroup) -> str:
    """The prefix of every key of `group` in its store (one per generation)."""
    return f"{STORE_PREFIX}/{group.generation}"


def refused(group: WeightGroup, rank: int, what: str, why: str = "") -> WeightAuthenticationError:
    """The error of `rank` refusing `what` (a store key, a broadcast) of `group`."""
    reason = why or "its tag does not verify under the group's key"
    return WeightAuthenticationError(
        f"{group.member(rank)}: refused {what}: it failed its authentication check ({reason}: "
        "written by someone who does not hold the group's key, or altered on the way); "
        "nothing of it was loaded"
    )


def _store_context(group: WeightGroup, key: str) -> list[str | int]:
    return ["store", group.generation, key]


def post(store: Store, group: WeightGroup, key: str, body: bytes) -> None:
    """Write `body` under `key` (of the group's prefixed store), sealed with the group's key."""
    # Bytes pass through the binding as they are (its stubs say str).
    store.set(key, seal(group.key, _store_context(group, key), body))  # type: ignore[arg-type]


def read(store: Store, group: WeightGroup, rank: int, key: str) -> bytes:
    """The body of the sealed value under `key` (present: waited for by the caller);
    `WeightAuthenticationError` naming the key where it does not verify."""
    body = unseal(group.key, _store_context(group, key), store.get(key))
    if body is None:
        raise refused(group, rank, f"store key '{store_prefix(group)}/{key}'")
    return body
