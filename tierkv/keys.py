"""Content addresses for KV chunks.

A key is the hex SHA-256 of its parent key and its chunk's tokens, chained from a
root that covers the namespace (model, dtype, layout, KV-head shard, tenant
salt) and the chunk size.  So:

* equal prefixes under equal namespaces give equal keys (dedup across requests,
  engine instances and ranks that hold identical bytes);
* a change anywhere earlier in the prefix changes every later key;
* a key cannot be forged without knowing the whole prefix and the namespace,
  because SHA-256 is preimage resistant.

Keys say nothing about placement: which tier holds a chunk is the store's business.
"""

from __future__ import annotations

import array
import hashlib
import sys
from collections.abc import Sequence
from typing import Any

import numpy as np

_ARRAY_OK = array.array("I").itemsize == 4 and sys.byteorder == "little"
_DOMAIN = b"tierkv/chunk/v1\x00"
_HASH_DOMAIN = b"tierkv/blockhash/v1\x00"


def _utf8(text: str, what: str) -> bytes:
    """``text`` as UTF-8; a ``ValueError`` naming ``what`` when it has none (a lone surrogate)."""
    try:
        return text.encode()
    except UnicodeEncodeError:
        r = repr(text)
        raise ValueError(f"{what} {r if len(r) <= 60 else r[:50] + '...'} cannot be encoded as UTF-8 "
                         "(a lone surrogate)") from None


def namespace_root(namespace: str, chunk_tokens: int) -> bytes:
    """The 32-byte digest every chain under ``namespace`` starts from."""
    if not isinstance(namespace, str):
        raise TypeError(f"namespace must be a str, got {type(namespace).__name__}")
    return hashlib.sha256(_DOMAIN + str(int(chunk_tokens)).encode() + b"\x00" + _utf8(namespace, "namespace")).digest()


def _as_token_bytes(token_ids: Any) -> memoryview:
    """Token ids as little-endian uint32 bytes; raises on ids outside [0, 2**32)."""
    if isinstance(token_ids, (list, tuple)) and _ARRAY_OK:
        try:  # the fast path for plain lists: 4-5x quicker than numpy's conversion
            return memoryview(array.array("I", token_ids)).cast("B")
        except OverflowError:
            raise ValueError("token ids must lie in [0, 2**32)") from None
        except TypeError:
            pass  # not all ints (floats, nested lists): numpy below gives the precise error
    if hasattr(token_ids, "detach"):  # torch tensor, without importing torch here
        token_ids = token_ids.detach().cpu().numpy()
    arr = np.asarray(token_ids)
    if arr.ndim != 1:
        raise ValueError(f"token_ids must be one-dimensional, got shape {tuple(arr.shape)}")
    if arr.size == 0:
        return memoryview(b"")
    if arr.dtype.kind not in "iu":
        raise ValueError(f"token_ids must be integers, got dtype {arr.dtype}")
    if arr.dtype != np.uint32:
        lo, hi = int(arr.min()), int(arr.max())
        if lo < 0 or hi >= 1 << 32:
            raise ValueError(f"token ids must lie in [0, 2**32); found {lo if lo < 0 else hi}")
        arr = arr.astype("<u4")
    return memoryview(np.ascontiguousarray(arr).data).cast("B")


def chunk_keys(token_ids: Sequence[int] | Any, chunk_tokens: int = 256, namespace: str = "") -> list[str]:
    """One key per *full* chunk of ``chunk_tokens`` tokens, chained over the prefix.

    ``token_ids`` may be a list of ints, a numpy array or a torch tensor.  A
    trailing partial chunk gets no key (its KV is not complete yet).
    """
    if not isinstance(chunk_tokens, int) or isinstance(chunk_tokens, bool) or chunk_tokens <= 0:
        raise ValueError(f"chunk_tokens must be a positive int, got {chunk_tokens!r}")
    data = _as_token_bytes(token_ids)
    step = chunk_tokens * 4
    n_full = len(data) // step
    parent = namespace_root(namespace, chunk_tokens)
    sha = hashlib.sha256
    out: list[str] = []
    append = out.append
    for i in range(n_full):
        h = sha(parent)
        h.update(data[i * step:(i + 1) * step])
        parent = h.digest()
        append(parent.hex())
    return out


def block_hash_root(namespace: str = "") -> bytes:
    """The 32-byte digest the keys of engine-hashed blocks under ``namespace`` start from."""
    if not isinstance(namespace, str):
        raise TypeError(f"namespace must be a str, got {type(namespace).__name__}")
    return hashlib.sha256(_HASH_DOMAIN + _utf8(namespace, "namespace")).digest()


def keys_from_root(root: bytes, block_hashes: Sequence[Any]) -> list[str]:
    """``keys_from_block_hashes`` under the namespace whose :func:`block_hash_root` is ``root``.

    For callers that name the same blocks under several namespaces (one per layer):
    the root is computed once per namespace, and each key is one SHA-256 call.
    """
    sha = hashlib.sha256
    try:  # bytes-like hashes (the common case): the root and the hash in one call
        return [sha(root + bh).hexdigest() for bh in block_hashes]
    except TypeError:
        pass
    out = []
    for bh in block_hashes:
        if isinstance(bh, str):
            bh = _utf8(bh, "block hash")
        elif isinstance(bh, int):
            bh = bh.to_bytes(max(1, (bh.bit_length() + 8) // 8), "little", signed=True)
        out.append(sha(root + bytes(bh)).hexdigest())
    return out


def keys_from_block_hashes(block_hashes: Sequence[Any], namespace: str = "") -> list[str]:
    """Keys for blocks an engine has already hashed (each hash chained over its prefix).

    Used by engine adapters so that tokens are not hashed twice.  The namespace
    is still folded in, so two models never share a key for equal tokens.  A key
    is the hex SHA-256 of the namespace's root digest followed by the hash's bytes
    (str hashes as UTF-8, int hashes as little-endian signed bytes).
    """
    return keys_from_root(block_hash_root(namespace), block_hashes)


def check_key(key: object) -> str:
    """Return ``key`` if it is a valid key string, else raise ``ValueError`` naming it."""
    if (not isinstance(key, str) or not key or "/" in key or "\x00" in key
            or (not key.isascii() and _utf8_len(key) < 0) or (len(key) > 50 and _utf8_len(key) > 200)):
        if isinstance(key, str):
            shown = repr(key) if len(repr(key)) <= 60 else repr(key)[:50] + f"...' ({len(key)} chars)"
        else:
            shown = f"<{type(key).__name__}>"
        why = " (it cannot be encoded as UTF-8: a lone surrogate)" if isinstance(key, str) and key \
            and _utf8_len(key) < 0 else ""
        raise ValueError(f"invalid key {shown}{why}: keys are non-empty strings of at most 200 UTF-8 bytes, "
                         "without '/' or NUL")
    return key


def _utf8_len(key: str) -> int:
    """The UTF-8 length of ``key``; -1 when it has none (a lone surrogate)."""
    try:
        return len(key.encode())
    except UnicodeEncodeError:
        return -1


def check_keys(keys: Any, what: str = "keys", each: bool = True) -> list[str]:
    """``keys`` as a list of valid key strings; raises a ``TypeError`` / ``ValueError`` naming the problem.

    ``each=False`` checks only the container: for reads, where a malformed key can
    never be present, the caller checks the keys it does not find (cheaper on the
    hot path).
    """
    if type(keys) is not list:  # (a list, the common case, is an ordered sequence and no single key)
        if isinstance(keys, (str, bytes)):
            raise TypeError(f"{what} must be a sequence of keys, not a single "
                            f"{'string' if isinstance(keys, str) else 'bytes object'} (wrap it in a list)")
        if not isinstance(keys, Sequence):
            raise TypeError(f"{what} must be an ordered sequence (list or tuple) of strings, "
                            f"got {type(keys).__name__}"
                            + (": a set has no order to pair results with" if isinstance(keys, (set, frozenset))
                               else ""))
    keys = list(keys)
    if each and keys:
        # C passes for the common case (ASCII, or short, strings without '/' or NUL); the exact check otherwise
        # (every one exactly a str: ``count`` meets the same type object each time; then a few lengths)
        lens = set(map(len, keys)) if list(map(type, keys)).count(str) == len(keys) else None
        if lens and min(lens):
            longest = max(lens)
            joined = "".join(keys)
            # (ASCII: always UTF-8; otherwise one encode of the batch finds a lone surrogate)
            if ((joined.isascii() and longest <= 200) or (longest <= 50 and _utf8_len(joined) >= 0)) \
                    and "/" not in joined and "\x00" not in joined:
                return keys
        for k in keys:
            check_key(k)
    return keys

