"""What the scheduler sends the workers each step: loads to run and saves to make.

Block indices are positions in the request; block ids are the engine's.  Block
hashes are vLLM's (bytes), which name the stored chunks (see chunks.py).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata


@dataclass
class LoadSpec:
    """Fill ``block_ids`` (the request's blocks ``start .. start+len-1``) from the store.

    ``block_hashes[i]`` is the hash of block ``hash_base + i``; they reach past the
    last block to fill up to the end of its chunk, so the worker can name the
    objects that hold the blocks.
    """

    req_id: str
    start: int
    block_ids: list[int]
    block_hashes: list[bytes]
    cache_salt: str | None = None
    hash_base: int = 0
    #: several KV cache groups: each group's block ids of the same blocks (``block_ids`` is group 0's);
    #: None with one group
    group_block_ids: list[list[int]] | None = None

    def ids_of(self, group: int) -> list[int]:
        """The block ids of KV cache group ``group``."""
        return self.block_ids if self.group_block_ids is None else self.group_block_ids[group]


@dataclass
class SaveSpec:
    """Put the request's ``chunks`` (blocks computed by the end of this step).

    ``chunks[i] = (first, last)`` block indices in the request; ``block_ids[i]``
    their engine block ids; ``block_hashes[i]`` the hash of block ``last``.
    """

    req_id: str
    chunks: list[tuple[int, int]]
    block_ids: list[list[int]]
    block_hashes: list[bytes]
    #: the request's block table up to the last saved block: a failed load of
    #: any of these blocks taints the saves after it
    table: list[int]
    cache_salt: str | None = None
    #: several KV cache groups: ``group_block_ids[g][i]`` group ``g``'s block ids of chunk ``i``
    #: (``block_ids`` is group 0's); None with one group
    group_block_ids: list[list[list[int]]] | None = None
    #: blocks ``lo .. hi-1`` were a hit served as a miss for an audit: the chunks that overlap them are
    #: compared with the stored copies when the put finds them present (None: no audit)
    audit: tuple[int, int] | None = None
    #: recurrent-state groups: positions in ``chunks`` whose state this step offers (the step ends on the
    #: chunk's last block boundary), the only ones those groups save; None without such groups
    state_chunks: list[int] | None = None

    def audited(self, chunks: list[tuple[int, int]]) -> list[int]:
        """Positions in ``chunks`` of those the audit covers."""
        if self.audit is None:
            return []
        lo, hi = self.audit
        return [j for j, (first, last) in enumerate(chunks) if last >= lo and first < hi]

    def ids_of(self, group: int) -> list[list[int]]:
        """Each chunk's block ids in KV cache group ``group``."""
        return self.block_ids if self.group_block_ids is None else self.group_block_ids[group]


@dataclass
class TierKVConnectorMetadata(KVConnectorMetadata):
    #: loads this step's forward needs (the request is scheduled in this step)
    loads: list[LoadSpec] = field(default_factory=list)
    #: loads of requests vLLM parked until they are done (``load_async``): they run between steps
    async_loads: list[LoadSpec] = field(default_factory=list)
    saves: list[SaveSpec] = field(default_factory=list)
    preempted: set[str] = field(default_factory=set)
    #: requests whose lookup leased chunks that no load of this step or a later one will read (leases.py)
    lease_releases: set[str] = field(default_factory=set)
    #: tokens this step computes (the workers time the step: the decline rule's compute samples, decline.py)
    step_tokens: int = 0
