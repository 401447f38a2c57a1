"""Ray Serve request routers for engine replicas: by cached prefix, in turn,
or by load (``--router prefix|round-robin|least-loaded``).

They run inside each ``DeploymentHandle`` to the replicas (the front's), see
each call's arguments, and rank the replicas; Ray sends the call to the
first of a rank that accepts it. A call's third argument is its route: the
prompt's page keys (``route_keys``: the prefix cache's chain keys, computed
at the front with the replicas' page size, so they equal the keys a replica
registers and publishes), or None for calls without a prompt, or an int
``k``: the ``k``-th replica by replica id (modulo their number), whatever
the policy (``Front`` asks each replica this way).

``PrefixRouter`` follows SGLang's cache-aware rule: when the replicas'
requests in flight differ by more than ``balance_threshold``, the least
loaded; else the replica holding the longest run of the prompt's leading
page keys (ties and no match at all: the least loaded, then the one caching
least). What a replica holds is the router's own estimate: the keys of the
prompts routed to it, each replica's set bounded by its pool (least
recently routed out first). A wrong estimate costs speed only: a replica
verifies every match against its pages.
"""

from __future__ import annotations

from collections import OrderedDict, defaultdict
from itertools import count

import numpy as np
from ray.serve.request_router import (
    PendingRequest,
    ReplicaID,
    ReplicaResult,
    RequestRouter,
    RunningReplica,
)

from mstar.engine.resources.kv.keys import ChainHasher

ROUTERS = ("prefix", "round-robin", "least-loaded")


def route_keys(hasher: ChainHasher, ids: list[int]) -> bytes:
    """The chain keys of ``ids``' full pages, as the route (uint64 bytes)."""
    return hasher.page_keys(np.asarray(ids, dtype=np.int64)).hashes.tobytes()


class PrefixIndex:
    """Per replica, the page keys it is estimated to cache: at most
    ``capacity`` each, least recently routed dropped first."""

    def __init__(self, capacity: int) -> None:
        if capacity < 1:
            raise ValueError(f"expected capacity >= 1, got {capacity}")
        self.capacity = capacity
        self.held: dict[ReplicaID, OrderedDict[int, None]] = defaultdict(OrderedDict)

    def match(self, replica: ReplicaID, keys: list[int]) -> int:
        """How many of ``keys``, from the first, ``replica`` holds."""
        held = self.held.get(replica)
        if not held:
            return 0
        n = 0
        for key in keys:
            if key not in held:
                break
            n += 1
        return n

    def add(self, replica: ReplicaID, keys: list[int]) -> None:
        held = self.held[replica]
        for key in keys:
            held[key] = None
            held.move_to_end(key)
        while len(held) > self.capacity:
            held.popitem(last=False)

    def drop(self, replica: ReplicaID) -> None:
        self.held.pop(replica, None)

    def size(self, replica: ReplicaID) -> int:
        return len(self.held.get(replica, ()))


class _LoadTracking(RequestRouter):
    """Requests in flight per replica, counted from the choice to completion:
    a request counts on the replica ranked first as soon as it is chosen (a
    burst's choices see each other), and moves if Ray sends it elsewhere."""

    def initialize_state(self, **kwargs) -> None:
        self.in_flight: dict[ReplicaID, int] = defaultdict(int)
        self._on: dict[str, ReplicaID] = {}  # request -> the replica it counts on

    def _count(self, request_id: str, replica_id: ReplicaID | None) -> None:
        """Count ``request_id`` on ``replica_id`` (None: on none)."""
        was = self._on.pop(request_id, None)
        if was is not None:
            self.in_flight[was] = max(0, self.in_flight[was] - 1)
        if replica_id is not None:
            self._on[request_id] = replica_id
            self.in_flight[replica_id] += 1

    def on_request_routed(
        self, pending_request: PendingRequest, replica_id: ReplicaID, result: ReplicaResult
    ) -> None:
        self._count(pending_request.metadata.internal_request_id, replica_id)

    def on_request_completed(self, replica_id: ReplicaID, internal_request_id: str) -> None:
        self._count(internal_request_id, None)

    def on_replica_actor_died(self, replica_id: ReplicaID) -> None:
        super().on_replica_actor_died(replica_id)
        self.in_flight.pop(replica_id, None)

    def by_load(self, replicas: list[RunningReplica]) -> list[RunningReplica]:
        return sorted(replicas, key=lambda r: self.in_flight[r.replica_id])

    async def choose_replicas(
        self,
        candidate_replicas: list[RunningReplica],
        pending_request: PendingRequest | None = None,
    ) -> list[list[RunningReplica]]:
        route = _route_of(pending_request)
        if isinstance(route, int):
            ring = sorted(candidate_replicas, key=lambda r: r.replica_id.unique_id)
            ranked = [ring[route % len(ring)]] if ring else []
        else:
            ranked = self.rank(candidate_replicas, pending_request, route)
        if ranked and pending_request is not None:
            self._count(pending_request.metadata.internal_request_id, ranked[0].replica_id)
        return [[r] for r in ranked]

    def rank(
        self, replicas: list[RunningReplica], pending_request: PendingRequest | None, route
    ) -> list[RunningReplica]:
        """The replicas, the most preferred first."""
        raise NotImplementedError


class LeastLoadedRouter(_LoadTracking):
    """The replica with the fewest requests in flight (then the next, ...)."""

    def rank(self, replicas, pending_request, route) -> list[RunningReplica]:
        return self.by_load(replicas)


class RoundRobinRouter(_LoadTracking):
    """Each replica in turn (by replica id), whatever it holds."""

    def initialize_state(self, **kwargs) -> None:
        super().initialize_state(**kwargs)
        self._turn = count()

    def rank(self, replicas, pending_request, route) -> list[RunningReplica]:
        ring = sorted(replicas, key=lambda r: r.replica_id.unique_id)
        i = next(self._turn) % max(1, len(ring))
        return ring[i:] + ring[:i]


class PrefixRouter(_LoadTracking):
    """The replica holding the longest run of the prompt's pages, unless the
    loads are out of balance (see the module)."""

    def initialize_state(
        self, capacity: int = 1 << 16, balance_threshold: int = 8, **kwargs
    ) -> None:
        super().initialize_state(**kwargs)
        if balance_threshold < 0:
            raise ValueError(f"expected balance_threshold >= 0, got {balance_threshold}")
        self.index = PrefixIndex(capacity)
        self.balance_threshold = balance_threshold
        self._keys: dict[str, list[int]] = {}  # routing -> routed

    def rank(self, replicas, pending_request, route) -> list[RunningReplica]:
        ranked = self.by_load(replicas)
        keys = np.frombuffer(route, dtype=np.uint64).tolist() if route else []
        if not ranked or not keys:
            return ranked
        loads = [self.in_flight[r.replica_id] for r in ranked]
        if loads[-1] - loads[0] <= self.balance_threshold:
            # stable sorts: longest match first, then least loaded, then caching least
            ranked.sort(key=lambda r: self.index.size(r.replica_id))
            ranked.sort(key=lambda r: self.in_flight[r.replica_id])
            ranked.sort(key=lambda r: -self.index.match(r.replica_id, keys))
        self._keys[pending_request.metadata.internal_request_id] = keys
        return ranked

    def on_request_routed(
        self, pending_request: PendingRequest, replica_id: ReplicaID, result: ReplicaResult
    ) -> None:
        super().on_request_routed(pending_request, replica_id, result)
        keys = self._keys.pop(pending_request.metadata.internal_request_id, None)
        if keys:
            self.index.add(replica_id, keys)

    def on_request_completed(self, replica_id: ReplicaID, internal_request_id: str) -> None:
        super().on_request_completed(replica_id, internal_request_id)
        self._keys.pop(internal_request_id, None)

    def on_replica_actor_died(self, replica_id: ReplicaID) -> None:
        super().on_replica_actor_died(replica_id)
        self.index.drop(replica_id)


def _route_of(pending_request: PendingRequest | None) -> bytes | int | None:
    if pending_request is None or len(pending_request.args) < 3:
        return None
    return pending_request.args[2]


def router_class(name: str) -> type[RequestRouter]:
    """The router ``--router name`` picks; ``ValueError`` for another name."""
    classes = {"prefix": PrefixRouter, "round-robin": RoundRobinRouter}
    classes["least-loaded"] = LeastLoadedRouter
    if name not in classes:
        raise ValueError(f"expected a router in {ROUTERS}, got {name!r}")
    return classes[name]
