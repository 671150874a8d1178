"""Radix prefix cache over whole KV pages (SGLang's ``RadixCache``).

Keys are token ids packed as int32 bytes; a node holds a run of whole pages
(``key``: ``4 * page_size`` bytes per page, ``page_ids``: one id per page), so
a partial last page is never cached. Children are found by the bytes of their
first page. An optional ``extra_key`` (LoRA id, cache salt) selects a separate
tree, so equal tokens under different namespaces never share KV.

Eviction is LRU over unlocked leaves by a logical access clock (every match
and insert is one tick; it also makes TP ranks agree without wall time). The
heap holds at most one live entry per evictable leaf; an entry whose node was
touched since it was pushed is pushed again at its new time when popped, and a
parent that becomes a leaf enters at its own access time. Each access makes at
most one such stale entry, so eviction costs amortised O(log n) per evicted
leaf and never rebuilds a heap over all leaves (as SGLang's Python cores do).
"""

from __future__ import annotations

import heapq
from array import array
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

from kvserve.cache.base import (
    BasePrefixCache,
    InsertResult,
    LockRefError,
    MatchResult,
    PrefixLock,
    duplicate_and_tail_pages,
)
from kvserve.kv import KVOwner, write_row
from kvserve.mem.pools import MemoryPools

_TOKEN_BYTES = 4  # int32 token ids


class TreeNode:
    """A run of cached pages. ``lock_ref > 0`` pins it and all its ancestors."""

    __slots__ = (
        "children", "in_heap", "key", "last_access", "lock_ref", "page_ids", "parent", "uid"
    )

    def __init__(self, key: bytes, page_ids: array, parent: TreeNode | None, uid: int) -> None:
        self.key = key
        self.page_ids = page_ids
        self.children: dict[bytes, TreeNode] = {}
        self.parent = parent
        self.lock_ref = 0
        self.last_access = 0
        self.in_heap = False
        self.uid = uid

    def __repr__(self) -> str:
        return f"TreeNode(uid={self.uid}, pages={len(self.page_ids)}, lock_ref={self.lock_ref})"


@dataclass(slots=True)
class EvictStats:
    """Operation counters of ``evict`` (for cost tests, not timing)."""

    evicted_leaves: int = 0
    nodes_visited: int = 0
    heap_ops: int = 0


def encode_tokens(token_ids: Sequence[int], page_size: int) -> bytes:
    """The page-aligned key of ``token_ids``: its full pages as int32 bytes.

    Raises OverflowError for a token id outside int32.
    """
    packed = array("i", token_ids)
    del packed[len(packed) - len(packed) % page_size :]
    return packed.tobytes()


class RadixCache(BasePrefixCache):
    """Page-granular radix tree with LRU leaf eviction. Sizes in tokens."""

    def __init__(self, pools: MemoryPools) -> None:
        super().__init__(pools)
        self._page_bytes = pools.page_size * _TOKEN_BYTES
        self.stats = EvictStats()
        self.reset()

    # -- lookup -------------------------------------------------------------------
    def match_prefix(self, token_ids: Sequence[int], extra_key: str | None = None) -> MatchResult:
        key = encode_tokens(token_ids, self.pools.page_size)
        root = self._roots.get(extra_key)
        if root is None:
            return MatchResult(array("i"), 0, self._roots[None])
        node, offset, pages = self._walk(root, key)
        return MatchResult(pages, offset // _TOKEN_BYTES, node)

    def _walk(self, root: TreeNode, key: bytes) -> tuple[TreeNode, int, array]:
        """Follow ``key`` from ``root``, splitting a node where the key leaves it.

        Returns the last matched node, the matched length in bytes and the
        matched page ids; every node on the path gets the current access time.
        """
        self._clock += 1
        now = self._clock
        pb = self._page_bytes
        pages = array("i")
        node, offset, end = root, 0, len(key)
        while offset < end:
            child = node.children.get(key[offset : offset + pb])
            if child is None:
                break
            child_key = child.key
            length = len(child_key)
            if key[offset : offset + length] != child_key:
                child = self._split(child, self._common_pages(child_key, key, offset))
                length = len(child.key)
            child.last_access = now
            pages += child.page_ids
            offset += length
            node = child
        return node, offset, pages

    def _common_pages(self, node_key: bytes, key: bytes, offset: int) -> int:
        """Whole pages ``node_key`` shares with ``key[offset:]``; the first page is known equal."""
        pb = self._page_bytes
        lo, hi = 1, min(len(node_key), len(key) - offset) // pb
        while lo < hi:  # largest m in [lo, hi] with equal first m pages
            mid = (lo + hi + 1) // 2
            if key[offset : offset + mid * pb] == node_key[: mid * pb]:
                lo = mid
            else:
                hi = mid - 1
        return lo

    def _split(self, node: TreeNode, num_pages: int) -> TreeNode:
        """Cut ``node`` after ``num_pages`` pages; returns the new upper part."""
        cut = num_pages * self._page_bytes
        parent = node.parent
        assert parent is not None
        upper = TreeNode(node.key[:cut], node.page_ids[:num_pages], parent, self._next_uid())
        upper.lock_ref = node.lock_ref
        upper.last_access = node.last_access
        node.key = node.key[cut:]
        node.page_ids = node.page_ids[num_pages:]
        node.parent = upper
        upper.children[node.key[: self._page_bytes]] = node
        parent.children[upper.key[: self._page_bytes]] = upper
        return upper

    # -- insert -------------------------------------------------------------------
    def insert(
        self, token_ids: Sequence[int], page_ids: Sequence[int], extra_key: str | None = None
    ) -> InsertResult:
        key = encode_tokens(token_ids, self.pools.page_size)
        pb = self._page_bytes
        if len(page_ids) < len(key) // pb:
            raise ValueError(f"{len(key) // pb} pages of key but only {len(page_ids)} page ids")
        root = self._roots.get(extra_key)
        if root is None:
            root = self._roots[extra_key] = TreeNode(b"", array("i"), None, self._next_uid())
            self._namespaces[root.uid] = extra_key
        node, offset, _ = self._walk(root, key)
        if offset < len(key):
            new_pages = array("i", page_ids[offset // pb : len(key) // pb])
            self.pools.allocator.check_used(new_pages)  # the cache takes owned pages only
            leaf = TreeNode(key[offset:], new_pages, node, self._next_uid())
            leaf.last_access = self._clock
            node.children[key[offset : offset + pb]] = leaf
            self._evictable_pages += len(leaf.page_ids)
            self._push(leaf)
            node = leaf
        return InsertResult(offset // _TOKEN_BYTES, node)

    # -- requests -----------------------------------------------------------------
    def cache_unfinished_req(self, req: KVOwner) -> None:
        kv, pools = req.kv, self.pools
        page_size = pools.page_size
        fill = req.fill_ids
        full_pages = min(kv.committed_len, len(fill)) // page_size
        protected_pages = kv.protected_len // page_size
        if full_pages <= protected_pages:
            return
        result = self.insert(fill[: full_pages * page_size], kv.page_ids, req.extra_key)
        canonical = self._path_page_ids(result.last_node)
        before = max(result.prefix_len // page_size, protected_pages)
        # [protected, before): ours duplicate the cache's pages; point the row at the cache's.
        pools.allocator.free(kv.page_ids[protected_pages:before])
        kv.page_ids[protected_pages:before] = canonical[protected_pages:before]
        write_row(pools, kv, protected_pages * page_size, before * page_size)
        new_lock = self.inc_lock_ref(result.last_node)
        if kv.lock is not None:
            self.dec_lock_ref(kv.lock)
        kv.lock = new_lock
        kv.protected_len = full_pages * page_size

    def cache_finished_req(self, req: KVOwner) -> None:
        kv, page_size = req.kv, self.pools.page_size
        fill = req.fill_ids
        # Only tokens whose ids are known can be keyed: fill_ids may be shorter than
        # committed_len if a caller trimmed tokens; those pages are freed, not leaked.
        full_pages = min(kv.committed_len, len(fill)) // page_size
        protected_pages = kv.protected_len // page_size
        before = inserted = protected_pages
        if full_pages > protected_pages:
            result = self.insert(fill[: full_pages * page_size], kv.page_ids, req.extra_key)
            before, inserted = result.prefix_len // page_size, full_pages
            # An in-flight batch may still read the pages just handed over: keep them
            # locked until its results are processed.
            if self._defer_batch is not None:
                self._hold_for_batch(self.inc_lock_ref(result.last_node))
        self.pools.allocator.free(
            duplicate_and_tail_pages(kv.page_ids, protected_pages, before, inserted)
        )
        if kv.lock is not None:
            self.dec_lock_ref(kv.lock)

    # -- locks --------------------------------------------------------------------
    def inc_lock_ref(self, node: TreeNode) -> PrefixLock | None:
        if node.parent is None:
            return None
        num_pages = 0
        n: TreeNode | None = node
        while n is not None and n.parent is not None:
            if n.lock_ref == 0:
                self._evictable_pages -= len(n.page_ids)
                self._protected_pages += len(n.page_ids)
            n.lock_ref += 1
            num_pages += len(n.page_ids)
            n = n.parent
        return PrefixLock(node, num_pages * self.pools.page_size)

    def _check_locked(self, lock: PrefixLock) -> None:
        if lock.node.lock_ref <= 0:
            raise LockRefError(f"dec_lock_ref on unlocked {lock.node!r}")

    def _unlock(self, lock: PrefixLock) -> None:
        self._check_locked(lock)
        n: TreeNode | None = lock.node
        while n is not None and n.parent is not None:
            n.lock_ref -= 1
            if n.lock_ref == 0:
                self._evictable_pages += len(n.page_ids)
                self._protected_pages -= len(n.page_ids)
                if not n.children:
                    self._push(n)
            n = n.parent

    def unlock_gain(self, locks: Sequence[PrefixLock]) -> int:
        receipts: dict[int, int] = {}  # id(node) -> how many of ``locks`` lock it
        nodes: dict[int, TreeNode] = {}
        for lock in locks:
            n: TreeNode | None = lock.node
            while n is not None and n.parent is not None:
                receipts[id(n)] = receipts.get(id(n), 0) + 1
                nodes[id(n)] = n
                n = n.parent
        pages = sum(len(nodes[key].page_ids) for key, count in receipts.items()
                    if count == nodes[key].lock_ref)
        return pages * self.pools.page_size

    def lock_page_ids(self, lock: PrefixLock) -> list[int]:
        return self._path_page_ids(lock.node).tolist()

    def _path_page_ids(self, node: TreeNode) -> array:
        runs = []
        n: TreeNode | None = node
        while n is not None and n.parent is not None:
            runs.append(n.page_ids)
            n = n.parent
        out = array("i")
        for run in reversed(runs):
            out += run
        return out

    # -- eviction -----------------------------------------------------------------
    def _push(self, node: TreeNode) -> None:
        if not node.in_heap:
            node.in_heap = True
            heapq.heappush(self._heap, (node.last_access, node.uid, node))
            self.stats.heap_ops += 1

    def evict(self, num_tokens: int) -> int:
        page_size = self.pools.page_size
        want = -(-num_tokens // page_size)
        heap, stats = self._heap, self.stats
        freed: list[int] = []
        while len(freed) < want and heap:
            stamp, uid, node = heapq.heappop(heap)
            stats.heap_ops += 1
            stats.nodes_visited += 1
            if node.lock_ref or node.children or node.parent is None:
                node.in_heap = False  # no longer an evictable leaf; re-pushed when it is
                continue
            if stamp != node.last_access:  # touched since pushed: re-enter at its real time
                heapq.heappush(heap, (node.last_access, uid, node))
                stats.heap_ops += 1
                continue
            node.in_heap = False
            freed += node.page_ids
            self._evictable_pages -= len(node.page_ids)
            parent = node.parent
            del parent.children[node.key[: self._page_bytes]]
            node.parent = None
            stats.evicted_leaves += 1
            if parent.parent is not None and not parent.children and not parent.lock_ref:
                self._push(parent)
            elif parent.parent is None and not parent.children and parent.uid in self._namespaces:
                del self._roots[self._namespaces.pop(parent.uid)]  # an emptied extra_key tree
        # No batch reads unlocked cache pages, and the caller is waiting for them.
        self.pools.allocator.free(freed, immediate=True)
        return len(freed) * page_size

    # -- sizes --------------------------------------------------------------------
    def evictable_size(self) -> int:
        return self._evictable_pages * self.pools.page_size

    def protected_size(self) -> int:
        return self._protected_pages * self.pools.page_size

    def reset(self) -> None:
        if getattr(self, "_protected_pages", 0):
            raise LockRefError("reset() while requests hold prefix locks")
        if hasattr(self, "_roots"):
            self.pools.allocator.free(list(self.cached_page_ids()), immediate=True)
            for node in list(self._nodes()):  # a stale match result can lock nothing now
                node.parent = None
                node.children = {}
        self._uid = 0
        self._clock = 0
        self._roots: dict[str | None, TreeNode] = {None: TreeNode(b"", array("i"), None, 0)}
        self._namespaces: dict[int, str | None] = {}  # root uid -> extra_key (not the default)
        self._heap: list[tuple[int, int, TreeNode]] = []
        self._evictable_pages = 0
        self._protected_pages = 0

    def _next_uid(self) -> int:
        self._uid += 1
        return self._uid

    # -- checker ------------------------------------------------------------------
    def _nodes(self) -> Iterator[TreeNode]:
        stack = list(self._roots.values())
        while stack:
            node = stack.pop()
            yield node
            stack.extend(node.children.values())

    def cached_page_ids(self) -> Iterator[int]:
        for node in self._nodes():
            yield from node.page_ids

    def num_nodes(self) -> int:
        return sum(1 for _ in self._nodes())

    def lock_path_counts(self, locks: Sequence[PrefixLock]) -> list[str]:
        expected: dict[int, int] = {}
        roots = {id(root) for root in self._roots.values()}
        problems = []
        for lock in locks:
            n: TreeNode = lock.node
            num_pages = 0
            while n.parent is not None:
                expected[n.uid] = expected.get(n.uid, 0) + 1
                num_pages += len(n.page_ids)
                n = n.parent
            if id(n) not in roots:
                problems.append(f"lock on node {lock.node.uid} whose path left the tree")
            elif num_pages * self.pools.page_size != lock.prefix_len:
                problems.append(f"lock on node {lock.node.uid} protects {num_pages} pages, its "
                                f"receipt says {lock.prefix_len} tokens")
        return problems + [
            f"node {node.uid}: lock_ref={node.lock_ref} but {expected.get(node.uid, 0)} "
            "receipts lock it"
            for node in self._nodes()
            if node.parent is not None and node.lock_ref != expected.get(node.uid, 0)
        ]

    def verify(self) -> list[str]:
        problems: list[str] = []
        pb = self._page_bytes
        evictable = protected = 0
        heap_nodes = {id(entry[2]) for entry in self._heap}
        for node in self._nodes():
            for first, child in node.children.items():
                if child.parent is not node:
                    problems.append(f"node {child.uid}: parent link broken")
                if child.key[:pb] != first or not child.key:
                    problems.append(f"node {child.uid}: child key does not start with its dict key")
            if node.parent is None:
                continue
            if len(node.key) != len(node.page_ids) * pb or not node.page_ids:
                problems.append(f"node {node.uid}: key of {len(node.key)} bytes for "
                                f"{len(node.page_ids)} pages")
            if node.lock_ref < 0:
                problems.append(f"node {node.uid}: lock_ref {node.lock_ref} < 0")
            if node.lock_ref > 0 and node.parent.parent is not None and node.parent.lock_ref <= 0:
                problems.append(f"node {node.uid}: locked but its parent {node.parent.uid} is not")
            if node.lock_ref:
                protected += len(node.page_ids)
            else:
                evictable += len(node.page_ids)
                if not node.children and not (node.in_heap and id(node) in heap_nodes):
                    problems.append(f"node {node.uid}: evictable leaf missing from the LRU heap")
        if evictable != self._evictable_pages:
            problems.append(f"evictable pages {self._evictable_pages} != recount {evictable}")
        if protected != self._protected_pages:
            problems.append(f"protected pages {self._protected_pages} != recount {protected}")
        return problems
