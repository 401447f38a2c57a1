"""PagePool and its prefix cache against a model: random steps from a state machine."""

import numpy as np
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from mstar.engine.resources.kv.pages import PageKeys, PagePool
from mstar.engine.resources.kv.tails import PER_ANCHOR


class Model:
    """The documented pool in plain Python: lists and dicts."""

    def __init__(self, num_pages):
        self.refcount = [0] * num_pages
        self.stack = list(range(num_pages - 1, -1, -1))  # top at the end
        self.queue = []  # cached-unowned, eviction order
        self.chain = {}  # registered page -> (namespace, tokens from 0)
        self.page_of = {}  # (namespace, tokens) -> page
        self.parent = {}
        self.gen = [0] * num_pages
        self.twin = {}  # duplicate page -> (twin, twin's gen then)
        self.evicted = 0
        self.tails = {}  # anchor (page or namespace) -> [(tail page, tokens)], oldest first

    def alloc(self, n):
        take = min(n, len(self.stack))
        out = self.stack[len(self.stack) - take :]
        del self.stack[len(self.stack) - take :]
        batch, self.queue = self.queue[: n - take], self.queue[n - take :]
        for anchor, held in list(self.tails.items()):  # evicted tails are forgotten
            self._set(anchor, [(p, t) for p, t in held if p not in batch])
        registered = [p for p in batch if p in self.chain]
        self.evicted += len(registered)
        self.unregister(registered)
        for p in out + batch:
            self.refcount[p] = 1
            self.twin.pop(p, None)
        return out + batch

    def unregister(self, pages):
        gone_all = list(pages)
        while pages:
            for p in pages:
                del self.page_of[self.chain.pop(p)]
                self.gen[p] += 1
            gone = set(pages)
            pages = sorted(p for p in self.chain if self.parent[p] in gone)
            gone_all += pages
            loose = [p for p in pages if self.refcount[p] == 0]
            self.queue = [p for p in self.queue if p not in loose]
            self.stack += loose
        orphans = [p for a in gone_all for p, _ in self.tails.pop(a, [])]
        self.queue = [p for p in self.queue if p not in orphans]
        self.stack += orphans

    def is_tail(self, page):
        return any(p == page for held in self.tails.values() for p, _ in held)

    def cache_tail(self, page, anchor, tokens):
        """A tail under ``anchor`` unless covered; the tails it covers, then
        the oldest past ``PER_ANCHOR``, to the free stack."""
        held = self.tails.get(anchor, [])
        n = len(tokens)
        if any(t[:n] == tokens for _, t in held if len(t) >= n):
            return
        covered = [len(t) <= n and tokens[: len(t)] == t for _, t in held]
        kept = [h for h, c in zip(held, covered) if not c]
        gone = [p for (p, _), c in zip(held, covered) if c]
        while len(kept) >= PER_ANCHOR:
            gone.append(kept.pop(0)[0])
        self.tails[anchor] = [*kept, (page, tokens)]
        self.queue = [p for p in self.queue if p not in gone]
        self.stack += gone

    def holder(self, page):
        """The registered page holding ``page``'s chain, or None."""
        if page in self.chain:
            return page
        twin, gen = self.twin.get(page, (-1, -1))
        return twin if twin in self.chain and self.gen[twin] == gen else None

    def _set(self, anchor, held):
        if held:
            self.tails[anchor] = held
        else:
            self.tails.pop(anchor, None)

    def share(self, pages):
        for p in pages:
            if self.refcount[p] == 0:
                self.queue.remove(p)
            self.refcount[p] += 1

    def release(self, pages):
        dead = []
        for p in pages:
            self.refcount[p] -= 1
            if self.refcount[p] == 0:
                dead.append(p)
        kept = [p for p in dead if p in self.chain or self.is_tail(p)]
        self.queue += kept[::-1]
        self.stack += [p for p in dead if p not in kept]

    def register(self, pages, chains, parent):
        if parent >= 0 and parent not in self.chain:
            twin, gen = self.twin.get(parent, (-1, -1))
            if twin not in self.chain or self.gen[twin] != gen:
                return
            parent = twin
        for p, chain in zip(pages, chains):
            if p in self.chain:
                parent = p
            elif chain in self.page_of:
                parent = self.page_of[chain]
                self.twin[p] = (parent, self.gen[parent])
            else:
                self.chain[p], self.page_of[chain], self.parent[p] = chain, p, parent
                parent = p

    def lookup(self, chains):
        out = []
        for chain in chains:
            if chain not in self.page_of:
                break
            out.append(self.page_of[chain])
        return out


PS = 2
PREFIXES = [(0, 1, 0, 1, 0, 1, 0, 1), (0, 1, 0, 1, 2, 2, 0, 0), (1, 1, 1, 1, 1, 1, 1, 1)]


class PoolMachine(RuleBasedStateMachine):
    """Streams that share prefixes, register late or never, fork and go;
    the pool must match the model after every rule."""

    def __init__(self):
        super().__init__()
        self.pool = PagePool(8, PS)
        self.model = Model(8)
        self.streams = []  # [namespace, tokens, pages (list), registered pages]

    def chains(self, namespace, tokens, start, stop):
        return [(namespace, tuple(tokens[: (i + 1) * PS])) for i in range(start, stop)]

    @rule(
        prefix=st.sampled_from(PREFIXES),
        cut=st.sampled_from([0, 2, 4, 5, 6, 8, 8]),
        tail=st.lists(st.integers(0, 1), max_size=4),
        namespace=st.sampled_from(["", "x"]),
    )
    def new_stream(self, prefix, cut, tail, namespace):
        tokens = list(prefix[:cut]) + tail
        keys = self.pool.page_keys(np.array(tokens, dtype=np.int64), None, namespace)
        matched = self.pool.lookup(keys)
        assert matched.tolist() == self.model.lookup(
            self.chains(namespace, tokens, 0, len(keys.hashes))
        )
        need = -(-len(tokens) // PS) - len(matched)
        if need + np.count_nonzero(self.pool.refcount[matched] == 0) > self.pool.num_free:
            return  # sharing the cached-unowned ones takes them out of num_free
        self.pool.share(matched)
        self.model.share(matched.tolist())
        fresh = self.pool.alloc(need)
        assert fresh.tolist() == self.model.alloc(need)
        pages = matched.tolist() + fresh.tolist()
        self.streams.append([namespace, tokens, pages, len(matched)])

    @precondition(lambda self: self.streams)
    @rule(data=st.data(), extra=st.lists(st.integers(0, 1), max_size=4))
    def recompute(self, data, extra):
        """A stream computing another's tokens (and more) without a lookup,
        as two requests admitted in the same step do: duplicates."""
        s = data.draw(st.sampled_from(self.streams))
        tokens = s[1] + extra
        need = -(-len(tokens) // PS)
        if need <= self.pool.num_free:
            pages = self.pool.alloc(need)
            assert pages.tolist() == self.model.alloc(need)
            self.streams.append([s[0], tokens, pages.tolist(), 0])

    @precondition(lambda self: self.streams)
    @rule(data=st.data(), everything=st.booleans())
    def register_more(self, data, everything):
        s = data.draw(st.sampled_from(self.streams))
        namespace, tokens, pages, done = s
        full = len(tokens) // PS
        if done == full:
            return
        upto = full if everything else data.draw(st.integers(done + 1, full))
        keys = self.pool.page_keys(np.array(tokens, dtype=np.int64), None, namespace)
        part = PageKeys(keys.hashes[done:upto], keys.tokens[done:upto], namespace)
        parent = pages[done - 1] if done else -1
        self.pool.register(np.array(pages[done:upto], dtype=np.int32), part, parent)
        self.model.register(pages[done:upto], self.chains(namespace, tokens, done, upto), parent)
        s[3] = upto

    @precondition(lambda self: self.streams)
    @rule(data=st.data())
    def fork(self, data):
        s = data.draw(st.sampled_from(self.streams))
        full = len(s[1]) // PS
        if full < len(s[2]) and self.pool.num_free == 0:
            return
        shared = s[2][:full]
        self.pool.share(np.array(shared, dtype=np.int32))
        self.model.share(shared)
        copy = []
        if full < len(s[2]):
            copy = self.pool.alloc(1).tolist()
            assert copy == self.model.alloc(1)
        self.streams.append([s[0], s[1], shared + copy, min(s[3], full)])

    @precondition(lambda self: self.streams)
    @rule(data=st.data())
    def release(self, data, i=None):
        i = data.draw(st.integers(0, len(self.streams) - 1)) if i is None else i
        s = self.streams.pop(i)
        self.pool.release(np.array(s[2], dtype=np.int32))
        self.model.release(s[2])

    @precondition(lambda self: self.streams)
    @rule(data=st.data())
    def leave_tail(self, data):
        """A stream with a partial last page of its own goes, leaving it
        as a tail under the page holding its last full one (its namespace)."""
        i = data.draw(st.integers(0, len(self.streams) - 1))
        namespace, tokens, pages, _ = self.streams[i]
        full = len(tokens) // PS
        if full == len(pages) or self.pool.refcount[pages[-1]] != 1:
            return
        anchor = self.model.holder(pages[full - 1]) if full else namespace
        assert anchor == (self.pool.registry.holder(pages[full - 1]) if full else namespace)
        if anchor is None:
            return
        rest = tuple(tokens[full * PS :])
        self.pool.cache_tail(pages[-1], anchor, np.array(rest, dtype=np.int64))
        self.model.cache_tail(pages[-1], anchor, rest)
        self.release(data, i)

    @rule(n=st.integers(0, 4))
    def alloc_and_free(self, n):
        n = min(n, self.pool.num_free)
        got = self.pool.alloc(n)
        assert got.tolist() == self.model.alloc(n)
        self.pool.release(got)
        self.model.release(got.tolist())

    @invariant()
    def matches_the_model(self):
        pool, model = self.pool, self.model
        pool.check()
        assert pool.refcount.tolist() == model.refcount
        assert pool.num_cached == len(model.queue)
        assert pool.num_free == len(model.stack) + len(model.queue)
        assert pool.free_pages()[: len(model.stack)].tolist() == model.stack
        assert sorted(np.flatnonzero(pool.registry.registered).tolist()) == sorted(model.chain)
        assert pool.num_evicted == model.evicted
        tails = sorted((str(a), p, tuple(t.tolist())) for a, p, t in pool.tails.entries())
        assert tails == sorted((str(a), p, t) for a, held in model.tails.items() for p, t in held)
        for page, (_, tokens) in model.chain.items():  # each page holds what its key claims
            assert pool.registry.tokens[page].tolist() == list(tokens[-PS:])
        for namespace, tokens, _, _ in self.streams:  # and every stream its own
            full = len(tokens) // PS
            keys = pool.page_keys(np.array(tokens, dtype=np.int64), None, namespace)
            got = pool.lookup(keys)
            assert got.tolist() == model.lookup(self.chains(namespace, tokens, 0, full))
            assert all(
                pool.registry.tokens[p].tolist() == tokens[i * PS : (i + 1) * PS]
                for i, p in enumerate(got)
            )


TestPoolMachine = PoolMachine.TestCase
TestPoolMachine.settings = settings(max_examples=150, stateful_step_count=60, deadline=None)
