"""Block accounting for the paged KV cache, with a prefix cache of full blocks.

The K/V tensors themselves live in the runner (one pool per layer, `num_blocks` x `block_size` slots);
this module only decides which block holds what. Blocks carry a reference count: a block shared by
several sequences (a cached prefix, or the prompt of n samples) is freed when the last one lets go.

Prefix cache: a full block is registered under a hash chained over its parent block's hash and its own
tokens. A lookup is confirmed by comparing the stored tokens and the parent's *serial* (a number given
to each registration and never reused), so a hash collision, or a parent evicted and reused since, can
never yield a wrong hit: a hit means the whole prefix up to that block is token-for-token equal.
Blocks whose count drops to zero stay registered in the free queue, which doubles as the LRU: new
blocks are taken from its front, evicting the registration they carried (least recently freed first).

A block's keys and values depend on the LoRA adapter that computed them, so a sequence's chain starts at
its adapter's root: the root hash and the first block's parent serial are the adapter's own (a serial given
once per adapter, never reused), so no block is shared across adapters, nor with the base model.
"""

from __future__ import annotations

from collections import OrderedDict

from pipeline.engine.sequence import Sequence

_ROOT = 0  # the "parent serial" of a sequence's first block
_NO_IDENTITY = -1  # a block whose content could not be registered (hash collision): children never match


def extend_block_hashes(seq: Sequence, block_size: int, num_tokens: int) -> list[int]:
    """Chained hashes of the full blocks inside seq.token_ids[:num_tokens] (memoized on the sequence), the
    chain rooted at seq's adapter."""
    hashes = seq.block_hashes
    for i in range(len(hashes), num_tokens // block_size):
        parent = hashes[-1] if hashes else (_ROOT if seq.adapter is None else hash((_ROOT, seq.adapter)))
        hashes.append(hash((parent, tuple(seq.token_ids[i * block_size : (i + 1) * block_size]))))
    return hashes


class KVCacheManager:
    """Allocates blocks to sequences, shares them by reference count, and caches full prefix blocks."""

    def __init__(self, num_blocks: int, block_size: int, prefix_caching: bool = True):
        if num_blocks < 1:
            raise ValueError(f"the KV cache must hold at least one block, got {num_blocks}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.prefix_caching = prefix_caching
        self.ref_count = [0] * num_blocks
        # Blocks with ref_count 0; the front is taken first (never-cached blocks are put there on free).
        self.free: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self.cached: dict[int, int] = {}  # chained hash -> block
        self.hash_of: list[int | None] = [None] * num_blocks
        self.tokens_of: list[tuple[int, ...] | None] = [None] * num_blocks
        self.serial_of: list[int | None] = [None] * num_blocks
        self.parent_serial_of: list[int | None] = [None] * num_blocks
        self.children: dict[int, set[int]] = {}  # parent serial -> registered blocks continuing it
        self._next_serial = 1
        self._roots: dict[str, int] = {}  # adapter -> the parent serial of its chains' first blocks
        self.evictions = 0
        # (src, dst) block copies the runner must make before the next forward: partial-block reuse and forks.
        self.pending_copies: list[tuple[int, int]] = []

    @property
    def num_free(self) -> int:
        return len(self.free)

    def blocks_needed(self, seq: Sequence, num_new_tokens: int) -> int:
        total = seq.num_computed + num_new_tokens
        return max(0, -(-total // self.block_size) - len(seq.block_table))

    def is_idle_whole(self) -> bool:
        """True when no block is referenced and every block is back in the free queue."""
        return all(c == 0 for c in self.ref_count) and len(self.free) == self.num_blocks

    # -- prefix cache -------------------------------------------------------------------------------
    def _root(self, seq: Sequence) -> int:
        """The parent serial of seq's first block: _ROOT for the base model, its adapter's own otherwise."""
        if seq.adapter is None:
            return _ROOT
        if seq.adapter not in self._roots:
            self._roots[seq.adapter] = self._next_serial
            self._next_serial += 1
        return self._roots[seq.adapter]

    def match_prefix(self, seq: Sequence) -> list[int]:
        """Cached blocks equal to the leading full blocks of seq that end at or before the first position
        whose output it needs (`Sequence.first_needed`: at least its last position is computed, for its
        logits). None for a request that wants prompt logprobs: every prompt position's logits are needed."""
        if not self.prefix_caching:
            return []
        limit = (seq.num_tokens - 1) // self.block_size
        hashes = extend_block_hashes(seq, self.block_size, limit * self.block_size)
        usable = min(limit, seq.first_needed // self.block_size)  # hashes past it are still wanted (admission)
        matched: list[int] = []
        parent_serial = self._root(seq)
        for i in range(usable):
            block = self.cached.get(hashes[i])
            if block is None or self.parent_serial_of[block] != parent_serial:
                break
            if self.tokens_of[block] != tuple(seq.token_ids[i * self.block_size : (i + 1) * self.block_size]):
                break
            matched.append(block)
            parent_serial = self.serial_of[block]
        return matched

    def match_partial(self, seq: Sequence, matched: list[int]) -> tuple[int, int] | None:
        """(block, r): a registered block continuing the matched chain whose first r >= 1 tokens equal
        seq's next tokens (the longest such), so those r positions can be copied instead of computed.
        Token-level reuse past the last shared full block: rows sharing a prefix that ends mid-block. It
        stops before the first position whose output seq needs (`Sequence.first_needed`)."""
        if not self.prefix_caching:
            return None
        start = len(matched) * self.block_size
        want = seq.token_ids[start : start + min(self.block_size, seq.first_needed - start)]
        parent = self.serial_of[matched[-1]] if matched else self._root(seq)
        best = None
        for block in self.children.get(parent, ()):
            r = 0
            for a, b in zip(self.tokens_of[block], want):
                if a != b:
                    break
                r += 1
            if r and (best is None or r > best[1]):
                best = (block, r)
        return best

    def admit(self, seq: Sequence, matched: list[int], partial: tuple[int, int] | None = None) -> None:
        """Start seq's block table with the matched cached blocks (taking a reference on each) and, with
        `partial`, a fresh block that receives a copy of the partly matching block's K/V."""
        assert not seq.block_table, "sequence already holds blocks"
        for block in matched:
            self._take(block)
        seq.block_table = list(matched)
        seq.block_serials = [self.serial_of[b] for b in matched]
        seq.num_computed = len(matched) * self.block_size
        if partial is not None:
            # Copies run before the next forward writes anything, so the source stays intact even if it
            # is handed out again (even as this very destination) in the same step.
            dst = self._pop_free()
            self.pending_copies.append((partial[0], dst))
            seq.block_table.append(dst)
            seq.num_computed += partial[1]

    def commit(self, seq: Sequence) -> None:
        """Register seq's blocks that became full and computed, so later sequences can reuse them."""
        if not self.prefix_caching:
            return
        bs = self.block_size
        full = seq.num_computed // bs
        hashes = extend_block_hashes(seq, bs, full * bs)
        for i in range(len(seq.block_serials), full):
            parent_serial = seq.block_serials[i - 1] if i else self._root(seq)
            if parent_serial == _NO_IDENTITY:
                seq.block_serials.append(_NO_IDENTITY)
                continue
            tokens = tuple(seq.token_ids[i * bs : (i + 1) * bs])
            block, existing = seq.block_table[i], self.cached.get(hashes[i])
            if existing is None:
                self.cached[hashes[i]] = block
                self.children.setdefault(parent_serial, set()).add(block)
                self.hash_of[block], self.tokens_of[block] = hashes[i], tokens
                self.serial_of[block], self.parent_serial_of[block] = self._next_serial, parent_serial
                self._next_serial += 1
                seq.block_serials.append(self.serial_of[block])
            elif self.tokens_of[existing] == tokens and self.parent_serial_of[existing] == parent_serial:
                # Computed twice (two sequences prefilled the same prefix at once): same content, so it
                # shares the registered twin's identity; this copy stays unregistered.
                seq.block_serials.append(self.serial_of[existing])
            else:
                seq.block_serials.append(_NO_IDENTITY)

    # -- allocation ---------------------------------------------------------------------------------
    def allocate(self, seq: Sequence, num_new_tokens: int) -> bool:
        """Give seq enough blocks for `num_new_tokens` more tokens; False (and no change) if too few free."""
        needed = self.blocks_needed(seq, num_new_tokens)
        if needed > len(self.free):
            return False
        for _ in range(needed):
            seq.block_table.append(self._pop_free())
        return True

    def release(self, seq: Sequence) -> None:
        """Drop seq's references. Tail blocks go first into the queue so shared heads outlive them."""
        for block in reversed(seq.block_table):
            self._drop(block)
        seq.block_table = []
        seq.block_serials = []
        seq.num_computed = 0

    def truncate(self, seq: Sequence, num_computed: int) -> None:
        """Roll seq's cache back to its first `num_computed` positions (rejected speculative tokens): blocks
        past them are dropped, and the kept last block's stale slots are simply written again later.
        Registrations only ever cover full blocks of confirmed tokens, so none is undone."""
        assert num_computed <= seq.num_computed, "truncate only rolls back"
        keep = -(-num_computed // self.block_size)
        for block in reversed(seq.block_table[keep:]):
            self._drop(block)
        del seq.block_table[keep:]
        full = num_computed // self.block_size
        del seq.block_serials[full:]
        del seq.block_hashes[full:]
        seq.num_computed = num_computed

    def _drop(self, block: int) -> None:
        count = self.ref_count[block] - 1
        if count < 0:
            raise AssertionError(f"block {block} released more often than taken")
        self.ref_count[block] = count
        if count == 0:
            self.free[block] = None
            if self.hash_of[block] is None:
                self.free.move_to_end(block, last=False)  # nothing worth keeping: reuse first

    def fork(self, parent: Sequence, child: Sequence) -> bool:
        """Let child share parent's computed blocks. A partly filled last block is copied (the two will
        write different tokens into it, see pending_copies); False when no block is free for that copy
        (the child must then recompute instead)."""
        table = list(parent.block_table)
        partial = parent.num_computed % self.block_size != 0
        if partial:
            if not self.free:
                return False
            dst = self._pop_free()
            self.pending_copies.append((table[-1], dst))
            table[-1] = dst
        for block in table[:-1] if partial else table:
            self._take(block)
        child.block_table = table
        full = parent.num_computed // self.block_size
        child.block_serials = parent.block_serials[:full]
        child.block_hashes = parent.block_hashes[:full]
        child.num_computed = parent.num_computed
        return True

    def _take(self, block: int) -> None:
        if self.ref_count[block] == 0:
            del self.free[block]
        self.ref_count[block] += 1

    def _pop_free(self) -> int:
        block, _ = self.free.popitem(last=False)
        if self.hash_of[block] is not None:
            if self.cached.get(self.hash_of[block]) == block:
                del self.cached[self.hash_of[block]]
            siblings = self.children.get(self.parent_serial_of[block])
            if siblings is not None:
                siblings.discard(block)
                if not siblings:
                    del self.children[self.parent_serial_of[block]]
            self.hash_of[block] = self.tokens_of[block] = None
            self.serial_of[block] = self.parent_serial_of[block] = None
            self.evictions += 1
        self.ref_count[block] = 1
        return block
