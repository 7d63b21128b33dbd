"""Which weights an engine serves: a short digest that every engine adapter puts in its key root.

KV is a function of the weights, so two engines share a chunk only when they serve the same weights.
A model *name* does not say that: a checkpoint rewritten in place, or a hub name whose branch moved,
keeps its name and changes every byte of its KV.  :func:`weights_identity` names what is loaded:

* a local directory (or one weight file): a fingerprint of its weight files (``*.safetensors``,
  ``*.bin``, ``*.pt``, ``*.pth``, ``*.gguf``) and its ``config.json`` / ``adapter_config.json``: each
  file's name, size and the SHA-256 of :data:`SAMPLES` blocks of :data:`SAMPLE_BYTES` (head, tail and
  evenly spread offsets; a file no larger than their sum is hashed whole).  About 1 MiB read per file,
  whatever its size (``bench/bench_weights.py`` measures it);
* a hub name (``org/model``): the commit its revision resolves to: a commit named directly, the commit a
  ``huggingface_hub`` ``ResolvedRevision`` carries, else the local cache's
  ``<cache>/models--org--model/refs/<revision>``; no network is asked;
* LoRA adapters (``lora_paths``), each named as above and mixed in, in order.

The digest depends on content only: not on the directory's path, its mtimes or its inodes, so two
hosts (or two copies) holding the same checkpoint share their KV.  A change that keeps every file's
size and touches no sampled block is not seen (a fine-tune rewrites every tensor; a hand edit of a
few bytes in the middle of a shard may not be); the ``model_id`` option of an adapter is the way to
assert an identity instead.

A name that is neither a local path nor in the cache cannot be verified: the digest is then one of
the name and revision alone (what keys were before), :attr:`WeightsIdentity.verified` is False, the
count :func:`unverified_count` grows and a warning is logged.  Nothing here imports an engine.
"""

from __future__ import annotations

import hashlib
import logging
import os
import re
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

logger = logging.getLogger("tierkv.weights")

#: hex characters of a digest (64 bits)
DIGEST_CHARS = 16
#: blocks read from each weight file
SAMPLES = 16
#: bytes of each block
SAMPLE_BYTES = 64 << 10
#: file name endings of weight files
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf")
#: other files whose content decides the weights' meaning (hashed whole)
CONFIG_FILES = ("config.json", "adapter_config.json")
#: what :meth:`WeightsIdentity.describe` says of an identity taken from the name alone
UNVERIFIED = "unverified (model name only)"

_COMMIT = re.compile(r"^[0-9a-f]{40}$")
_unverified = 0
_unverified_lock = threading.Lock()


@dataclass(frozen=True)
class WeightsIdentity:
    """What :func:`resolve_weights` found: ``digest`` (hex), how it was taken, and whether it names content.

    ``source`` is ``"files"`` (a fingerprint of local files), ``"hub-cache"`` (a resolved commit) or
    ``"name"`` (neither: unverified); ``detail`` says what was read (files and bytes, or the commit).
    """

    digest: str
    source: str
    verified: bool
    detail: str

    def describe(self) -> str:
        """One line for stats and logs: the digest and how it was taken, or :data:`UNVERIFIED`."""
        if not self.verified:
            return f"{UNVERIFIED}: {self.digest}"
        return f"{self.digest} ({self.source}: {self.detail})"


def unverified_count() -> int:
    """How many identities this process took from a name alone (see :func:`resolve_weights`)."""
    return _unverified


def weights_identity(model: str, *, revision: str | None = None, download_dir: str | None = None,
                     lora_paths: Sequence[str] = ()) -> str:
    """A short hex digest of the weights ``model`` (and ``lora_paths``) name; see the module docstring.

    ``model``: a local directory, a weight file or a hub name; ``revision``: a hub branch, tag or commit
    (None: ``main``); ``download_dir``: the hub cache the engine downloads into (None: Hugging Face's
    own).  Deterministic across processes and hosts for the same content.
    """
    return resolve_weights(model, revision=revision, download_dir=download_dir, lora_paths=lora_paths).digest


def resolve_weights(model: str, *, revision: str | None = None, download_dir: str | None = None,
                    lora_paths: Sequence[str] = ()) -> WeightsIdentity:
    """:func:`weights_identity` with how it was taken; unverified when the model or an adapter is."""
    if not isinstance(model, str) or not model:
        raise ValueError(f"weights_identity: model must be a non-empty string, got {model!r}")
    if isinstance(lora_paths, str):  # one path given as a string: not its characters
        lora_paths = (lora_paths,)
    parts = [_one(model, revision, download_dir)]
    parts += [_one(str(p), None, download_dir) for p in lora_paths]
    if len(parts) == 1:
        ident = parts[0]
    else:
        h = hashlib.sha256(b"tierkv-weights-with-lora\0")
        for p in parts:
            h.update(p.digest.encode() + b"\0")
        ident = WeightsIdentity(h.hexdigest()[:DIGEST_CHARS], parts[0].source, all(p.verified for p in parts),
                                "; ".join(p.detail for p in parts))
    if not ident.verified:
        global _unverified
        with _unverified_lock:
            _unverified += 1
        logger.warning("tierkv: the weights of %r%s cannot be verified (not a local path, not in the hub "
                       "cache): keys name the model by name only, so KV of other weights under that name "
                       "would be served; give a local path, a cached revision or model_id", model,
                       f" with LoRA {list(lora_paths)}" if lora_paths else "")
    return ident


def _one(name: str, revision: str | None, download_dir: str | None) -> WeightsIdentity:
    path = os.path.expanduser(name)
    if os.path.isdir(path) or os.path.isfile(path):
        return _files_identity(path)
    commit = _hub_commit(name, revision, download_dir)
    if commit is not None:
        digest = _digest(b"hub", name.encode(), commit.encode())
        return WeightsIdentity(digest, "hub-cache", True, f"{name}@{commit}")
    return WeightsIdentity(_digest(b"name", name.encode(), (revision or "").encode()), "name", False, UNVERIFIED)


def _digest(*parts: bytes) -> str:
    h = hashlib.sha256(b"tierkv-weights\0")
    for p in parts:
        h.update(len(p).to_bytes(8, "little") + p)
    return h.hexdigest()[:DIGEST_CHARS]


def weight_files(path: str) -> list[str]:
    """The files of ``path`` (a directory's top level, or one file) that the fingerprint reads, sorted by name."""
    if os.path.isfile(path):
        return [path]
    names = sorted(n for n in os.listdir(path) if n.endswith(WEIGHT_SUFFIXES) or n in CONFIG_FILES)
    return [os.path.join(path, n) for n in names if os.path.isfile(os.path.join(path, n))]


def _files_identity(path: str) -> WeightsIdentity:
    files = weight_files(path)
    h = hashlib.sha256(b"tierkv-weights-files\0")
    total = read = 0
    for f in files:
        size = os.path.getsize(f)
        total += size
        name = os.path.basename(f).encode()
        h.update(len(name).to_bytes(8, "little") + name + size.to_bytes(8, "little"))
        read += _sample_file(f, size, h)
    digest = h.hexdigest()[:DIGEST_CHARS]
    return WeightsIdentity(digest, "files", True, f"{len(files)} files, {total} bytes, {read} read")


def sample_offsets(size: int) -> list[int]:
    """Where the blocks of a file of ``size`` bytes are read: head, tail and evenly between (empty: whole file)."""
    if size <= SAMPLES * SAMPLE_BYTES:
        return []
    last = size - SAMPLE_BYTES
    return [last * i // (SAMPLES - 1) for i in range(SAMPLES)]


def _sample_file(path: str, size: int, h: Any) -> int:
    """Feed ``h`` the sampled blocks of ``path`` (the whole file when small); the bytes read."""
    offsets = sample_offsets(size)
    with open(path, "rb", buffering=0) as f:
        if not offsets:
            data = f.read()
            h.update(data)
            return len(data)
        read = 0
        for off in offsets:
            data = os.pread(f.fileno(), SAMPLE_BYTES, off)
            h.update(data)
            read += len(data)
        return read


def hub_cache_dir(download_dir: str | None = None) -> str:
    """The hub cache a model is looked up in: ``download_dir``, else Hugging Face's (its environment honoured)."""
    if download_dir:
        return os.path.expanduser(download_dir)
    try:
        from huggingface_hub import constants

        return str(constants.HF_HUB_CACHE)
    except ImportError:
        pass
    if os.environ.get("HF_HUB_CACHE"):
        return os.path.expanduser(os.environ["HF_HUB_CACHE"])
    home = os.environ.get("HF_HOME") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "huggingface")
    return os.path.join(os.path.expanduser(home), "hub")


def _hub_commit(name: str, revision: str | None, download_dir: str | None) -> str | None:
    """The commit ``name`` at ``revision`` resolves to, or None if neither it nor the local hub cache says.

    A revision that is a commit, or that carries the commit it was resolved to (``huggingface_hub``'s
    ``ResolvedRevision``, what vLLM loads by), is that commit; a branch or tag is read from the cache's
    ``refs/`` (``download_dir`` first, then Hugging Face's own cache).
    """
    if name.count("/") > 1 or name.startswith(("/", ".", "~")):
        return None
    resolved = getattr(revision, "resolved", None)
    if isinstance(resolved, str) and _COMMIT.match(resolved):
        return resolved
    rev = str(revision) if revision is not None else "main"
    if _COMMIT.match(rev):
        return rev
    caches = [hub_cache_dir(download_dir)] + ([hub_cache_dir()] if download_dir else [])
    for cache in caches:
        try:
            with open(os.path.join(cache, "models--" + name.replace("/", "--"), "refs", rev),
                      encoding="ascii") as f:
                commit = f.read().strip()
        except (OSError, UnicodeDecodeError):
            continue
        if _COMMIT.match(commit):
            return commit
    return None
