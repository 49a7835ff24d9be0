"""Paged KV cache bookkeeping: which physical block holds which tokens of which sequence.

Pure Python, no torch. The KV tensors themselves live in the model runner; this module
only hands out block ids. Vocabulary:

- ``find_cached_prefix(seq)``: the longest run of full blocks of ``seq`` already in the
  cache (prefix caching by chained hashes), never the whole sequence: its last token must
  be computed to produce logits.
- ``allocate(seq, num_new_tokens, cached_blocks)``: make room for the next tokens; all or
  nothing, so a failed call changes nothing.
- ``cache_full_blocks(seq)``: publish the hashes of blocks that the step just filled.
- ``free(seq)``: drop the sequence's references; blocks whose count reaches zero join the
  free list but keep their contents and hash until reused (LRU eviction).

Block keys are SHA-256 digests chained from a root that names everything besides the
tokens that decides a block's KV (model, dtype, KV-cache dtype): a 64-bit ``hash()`` of
(parent, tokens) can collide (two parents congruent modulo 2**61 - 1 already do), and a
collision would silently serve another prefix's KV. Token ids are hashed as the bytes of
one int64 array per call, so a 100k-token prompt costs a few milliseconds.
"""

from __future__ import annotations

import hashlib
import json
from collections import OrderedDict

import numpy as np

from inference.sequence import Sequence

_HASH_SCHEME = b"pagoda-prefix-cache-sha256-v1"


class Block:
    __slots__ = ("block_id", "ref_count", "hash", "token_ids")

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.ref_count = 0
        self.hash: bytes | None = None
        self.token_ids: tuple[int, ...] = ()


def prefix_cache_root(**identity: object) -> bytes:
    """The digest every sequence's chain starts from. ``identity`` names what, besides the
    tokens, decides a block's KV (model, dtype, KV-cache dtype; a LoRA adapter chains from a root of its own):
    engines that differ in any of it never share a key."""
    canonical = json.dumps(identity, sort_keys=True, default=str, separators=(",", ":"))
    return hashlib.sha256(_HASH_SCHEME + b"\0" + canonical.encode()).digest()


def hash_block(parent: bytes, token_bytes: bytes, extra_key: bytes = b"") -> bytes:
    """SHA-256 of (parent digest, the block's token ids as little-endian int64, an extra
    key for what varies per request, such as an adapter). The parent is a fixed-size digest
    and the tokens are length-prefixed, so the encoding is unambiguous."""
    digest = hashlib.sha256(parent)
    digest.update(len(token_bytes).to_bytes(4, "little"))
    digest.update(token_bytes)
    digest.update(extra_key)
    return digest.digest()


def token_bytes(token_ids: list[int]) -> bytes:
    """The canonical encoding of token ids for ``hash_block``."""
    return np.fromiter(token_ids, dtype="<i8", count=len(token_ids)).tobytes()


class BlockManager:
    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        enable_prefix_caching: bool = True,
        root_hash: bytes = prefix_cache_root(),
    ):
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.enable_prefix_caching = enable_prefix_caching
        self.root_hash = root_hash
        self.blocks = [Block(i) for i in range(num_blocks)]
        # Free blocks in eviction order: the first is reused first. Blocks holding cached
        # content go to the back when freed; empty ones to the front.
        self.free_block_ids: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self.hash_to_block_id: dict[bytes, int] = {}
        self.prefix_cache_queries = 0  # prompt tokens looked up
        self.prefix_cache_hits = 0  # of those, served from the cache

    # -- queries ---------------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        return len(self.free_block_ids)

    @property
    def usage(self) -> float:
        """Fraction of blocks referenced by live sequences (vllm:kv_cache_usage_perc)."""
        return 1.0 - self.num_free_blocks / self.num_blocks

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    # -- prefix caching --------------------------------------------------------------
    def _update_block_hashes(self, seq: Sequence) -> None:
        """Extend ``seq.block_hashes`` to cover every full block of its tokens."""
        size = self.block_size
        hashes = seq.block_hashes
        start, end = len(hashes), seq.num_known_tokens // size
        if start >= end:
            return
        data = token_bytes(seq.token_ids[start * size : end * size])
        parent = hashes[-1] if hashes else self._chain_root(seq)
        step = size * 8
        for offset in range(0, len(data), step):
            parent = hash_block(parent, data[offset : offset + step])
            hashes.append(parent)

    def _chain_root(self, seq: Sequence) -> bytes:
        """Where a sequence's chain starts: the engine's root, or for a LoRA adapter's
        sequence a root of that adapter's own (its KV differs from the base model's)."""
        lora = seq.lora_request
        if lora is None:
            return self.root_hash
        return hash_block(self.root_hash, b"", lora.cache_key())

    def find_cached_prefix(self, seq: Sequence) -> list[int]:
        """Block ids holding the longest cached prefix of ``seq`` (empty if none). A request
        for prompt logprobs reads nothing from the cache (as in vLLM): every prompt token's
        hidden state must be computed; its blocks are still published for others."""
        if not self.enable_prefix_caching or seq.params.prompt_logprobs is not None:
            return []
        self._update_block_hashes(seq)
        size = self.block_size
        # Leave at least one token to compute.
        max_blocks = min((seq.num_tokens - 1) // size, len(seq.block_hashes))
        found: list[int] = []
        for i in range(max_blocks):
            block_id = self.hash_to_block_id.get(seq.block_hashes[i])
            if block_id is None:
                break
            found.append(block_id)
        return found

    def cache_full_blocks(self, seq: Sequence) -> None:
        """Publish blocks that are now full of computed tokens for later reuse."""
        if not self.enable_prefix_caching:
            return
        num_full = seq.num_computed_tokens // self.block_size
        if num_full <= seq.num_published_blocks:
            return
        self._update_block_hashes(seq)
        num_full = min(num_full, len(seq.block_hashes))  # blocks of known tokens only
        size = self.block_size
        start = seq.num_published_blocks
        seq.num_published_blocks = num_full
        for i in range(start, num_full):
            block = self.blocks[seq.block_table[i]]
            if block.hash is not None:
                continue
            h = seq.block_hashes[i]
            if h in self.hash_to_block_id:
                continue  # same content already cached in another block
            block.hash = h
            block.token_ids = tuple(seq.token_ids[i * size : (i + 1) * size])
            self.hash_to_block_id[h] = block.block_id

    # -- allocation ------------------------------------------------------------------
    def allocate(
        self, seq: Sequence, num_new_tokens: int, cached_blocks: list[int] | None = None
    ) -> bool:
        """Give ``seq`` blocks for ``num_new_tokens`` more tokens after what it has computed
        (after the cached prefix, if given). Returns False, changing nothing, if the free
        blocks do not suffice."""
        have_slots = len(seq.block_table) * self.block_size
        if not cached_blocks and have_slots >= seq.num_computed_tokens + num_new_tokens:
            return True  # decode fast path: the next slots are in the last block already
        cached_blocks = cached_blocks or []
        num_computed = seq.num_computed_tokens + len(cached_blocks) * self.block_size
        num_needed = self.blocks_needed(num_computed + num_new_tokens)
        num_new_blocks = num_needed - len(seq.block_table) - len(cached_blocks)
        # Cached blocks that nobody references sit in the free list: taking them costs
        # free blocks too.
        num_revived = sum(1 for b in cached_blocks if self.blocks[b].ref_count == 0)
        if max(num_new_blocks, 0) + num_revived > self.num_free_blocks:
            return False
        if not seq.block_table and seq.num_computed_tokens == 0:
            self._record_prefix_lookup(seq, len(cached_blocks))
        for block_id in cached_blocks:
            block = self.blocks[block_id]
            if block.ref_count == 0:
                del self.free_block_ids[block_id]
            block.ref_count += 1
            seq.block_table.append(block_id)
        seq.num_computed_tokens = num_computed
        for _ in range(num_new_blocks):
            seq.block_table.append(self._take_free_block())
        return True

    def _record_prefix_lookup(self, seq: Sequence, num_cached_blocks: int) -> None:
        if not self.enable_prefix_caching:
            return
        num_hit = num_cached_blocks * self.block_size
        seq.num_cached_tokens = max(seq.num_cached_tokens, num_hit)
        # Count prompts once: a resumed (preempted) sequence is not a new query.
        if seq.num_preemptions == 0:
            self.prefix_cache_queries += seq.num_prompt_tokens
            self.prefix_cache_hits += num_hit

    def _take_free_block(self) -> int:
        block_id, _ = self.free_block_ids.popitem(last=False)
        block = self.blocks[block_id]
        if block.hash is not None:
            # Evict: this block's old content is no longer findable.
            if self.hash_to_block_id.get(block.hash) == block_id:
                del self.hash_to_block_id[block.hash]
            block.hash = None
            block.token_ids = ()
        block.ref_count = 1
        return block_id

    def free(self, seq: Sequence) -> None:
        """Release the sequence's blocks, last block first, so that on eviction a
        sequence's tail goes before its (more shareable) prefix."""
        for block_id in reversed(seq.block_table):
            block = self.blocks[block_id]
            block.ref_count -= 1
            if block.ref_count < 0:
                raise RuntimeError(f"block {block_id} freed more often than allocated")
            if block.ref_count == 0:
                self.free_block_ids[block_id] = None
                if block.hash is None:
                    self.free_block_ids.move_to_end(block_id, last=False)
        seq.block_table = []

    # -- live resizing (``inference.reconfigure``) ---------------------------------------
    def grow(self, num_blocks: int) -> None:
        """Add empty blocks up to ``num_blocks``: they are reused before cached ones."""
        new_ids = range(self.num_blocks, num_blocks)
        self.blocks.extend(Block(i) for i in new_ids)
        for block_id in reversed(new_ids):
            self.free_block_ids[block_id] = None
            self.free_block_ids.move_to_end(block_id, last=False)
        self.num_blocks = max(self.num_blocks, num_blocks)

    def shrink_moves(self, num_blocks: int) -> list[tuple[int, int]] | None:
        """(from, to) block copies that empty every block at or past ``num_blocks``: each
        referenced block there moves to a free one below, emptiest first (a block without
        cached content before one with). None if the free blocks below do not suffice."""
        used = [b.block_id for b in self.blocks[num_blocks:] if b.ref_count > 0]
        targets = [i for i in self.free_block_ids if i < num_blocks][: len(used)]
        if len(targets) < len(used):
            return None
        return list(zip(used, targets))

    def shrink(self, num_blocks: int, moves: list[tuple[int, int]],
               live_seqs: list[Sequence]) -> None:
        """Drop every block at or past ``num_blocks`` after ``moves`` (``shrink_moves``,
        whose KV the runner has copied): the moved blocks' references, counts and hashes
        go to their new ids, and the dropped free blocks' cached content is forgotten."""
        remap = dict(moves)
        for src, dst in moves:
            old, new = self.blocks[src], self.blocks[dst]
            if new.hash is not None and self.hash_to_block_id.get(new.hash) == dst:
                del self.hash_to_block_id[new.hash]
            del self.free_block_ids[dst]
            new.ref_count, new.hash, new.token_ids = old.ref_count, old.hash, old.token_ids
            if old.hash is not None and self.hash_to_block_id.get(old.hash) == src:
                self.hash_to_block_id[old.hash] = dst
            old.ref_count, old.hash, old.token_ids = 0, None, ()
        for seq in live_seqs:
            seq.block_table = [remap.get(b, b) for b in seq.block_table]
        for block in self.blocks[num_blocks:]:
            if block.ref_count:
                raise RuntimeError(f"block {block.block_id} is still referenced")
            if block.hash is not None and self.hash_to_block_id.get(block.hash) == block.block_id:
                del self.hash_to_block_id[block.hash]
            self.free_block_ids.pop(block.block_id, None)
        del self.blocks[num_blocks:]
        self.num_blocks = num_blocks

    # -- consistency (used by tests) ---------------------------------------------------
    def check_invariants(self, live_seqs: list[Sequence]) -> None:
        counts = [0] * self.num_blocks
        for seq in live_seqs:
            for block_id in seq.block_table:
                counts[block_id] += 1
        for block in self.blocks:
            if block.ref_count != counts[block.block_id]:
                raise AssertionError(
                    f"block {block.block_id}: ref_count {block.ref_count} "
                    f"but referenced {counts[block.block_id]} times"
                )
            if (block.ref_count == 0) != (block.block_id in self.free_block_ids):
                raise AssertionError(f"block {block.block_id}: free list disagrees")
        for h, block_id in self.hash_to_block_id.items():
            if self.blocks[block_id].hash != h:
                raise AssertionError(f"hash index points at block {block_id} of another hash")
