"""The replica routers' rules on stand-in replicas (no Ray cluster), and
the replicas application's options."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import numpy as np
import pytest

pytest.importorskip("ray.serve")

from ray.serve._private.common import DeploymentID, ReplicaID

from mstar.engine.resources.kv.keys import ChainHasher
from mstar.serve.replicas import parse_args
from mstar.serve.router import (
    PrefixIndex,
    PrefixRouter,
    RoundRobinRouter,
    route_keys,
)

HASHER = ChainHasher(4)
SYSTEM = [list(range(1, 13)), list(range(100, 112))]  # two prefixes of three pages


def replicas(n: int) -> list:
    dep = DeploymentID(name="EngineReplica", app_name="app")
    return [SimpleNamespace(replica_id=ReplicaID(unique_id=f"r{i}", deployment_id=dep))
            for i in range(n)]  # fmt: skip


def made(cls, **kwargs):
    router = cls.__new__(cls)  # the routing state alone, without Ray's
    router.initialize_state(**kwargs)
    return router


class Calls:
    """Route requests through ``router``: each stays in flight until ``done``."""

    def __init__(self, router, reps) -> None:
        self.router, self.reps, self.n = router, reps, 0

    def send(self, route) -> str:
        self.n += 1
        pending = SimpleNamespace(args=[None, None, route],
                                  metadata=SimpleNamespace(internal_request_id=str(self.n)))  # fmt: skip
        ranks = asyncio.run(self.router.choose_replicas(self.reps, pending))
        chosen = ranks[0][0].replica_id
        self.router.on_request_routed(pending, chosen, None)
        return chosen.unique_id

    def done(self, replica: str, n: int) -> None:
        rid = next(r.replica_id for r in self.reps if r.replica_id.unique_id == replica)
        self.router.on_request_completed(rid, str(n))


def prompt(system: int, question: int) -> bytes:
    return route_keys(HASHER, [*SYSTEM[system], 200 + question, 201, 202, 203, 7])


def test_a_prefix_stays_where_it_was_sent_and_a_new_one_goes_to_the_other_replica():
    calls = Calls(made(PrefixRouter, capacity=100, balance_threshold=2), replicas(2))
    first = calls.send(prompt(0, 0))
    calls.done(first, 1)
    second = calls.send(prompt(1, 0))  # no match anywhere: the replica caching least
    assert second != first
    calls.done(second, 2)
    for q in range(1, 6):
        assert calls.send(prompt(0, q)) == first
        calls.done(first, calls.n)
        assert calls.send(prompt(1, q)) == second
        calls.done(second, calls.n)


def test_loads_apart_by_more_than_the_threshold_send_to_the_least_loaded():
    calls = Calls(made(PrefixRouter, capacity=100, balance_threshold=2), replicas(2))
    home = calls.send(prompt(0, 0))
    # in flight on home: 1, 2, 3; the others 0: still home up to a gap of 2
    assert calls.send(prompt(0, 1)) == home
    assert calls.send(prompt(0, 2)) == home
    assert calls.send(prompt(0, 3)) != home


def test_choices_in_a_burst_count_before_ray_reports_them_routed():
    router, reps = made(PrefixRouter, capacity=100), replicas(2)

    def choose(n: int) -> str:
        pending = SimpleNamespace(args=[None, None, prompt(n % 2, n)],
                                  metadata=SimpleNamespace(internal_request_id=f"b{n}"))  # fmt: skip
        return asyncio.run(router.choose_replicas(reps, pending))[0][0].replica_id.unique_id

    assert sorted(choose(n) for n in range(4)) == ["r0", "r0", "r1", "r1"]


def test_round_robin_takes_turns_whatever_is_cached():
    calls = Calls(made(RoundRobinRouter), replicas(2))
    got = [calls.send(prompt(0, q)) for q in range(4)]
    assert got == ["r0", "r1", "r0", "r1"]


def test_an_int_route_names_the_kth_replica_by_id():
    calls = Calls(made(PrefixRouter), replicas(3))
    assert [calls.send(k) for k in range(4)] == ["r0", "r1", "r2", "r0"]


def test_the_index_drops_the_least_recently_routed_keys_past_its_capacity():
    index = PrefixIndex(capacity=4)
    rid = replicas(1)[0].replica_id
    keys = np.frombuffer(prompt(0, 0), dtype=np.uint64).tolist()
    index.add(rid, keys)
    assert index.match(rid, keys) == len(keys) == 4
    index.add(rid, [1, 2])
    assert index.size(rid) == 4 and index.match(rid, keys) == 0  # its first two went
    with pytest.raises(ValueError, match="capacity >= 1"):
        PrefixIndex(0)


def test_builder_args_read_as_the_fields_they_set():
    config, scaling = parse_args({
        "model": "random", "pages": "48", "no_prefix_cache": "false", "replicas": "3",
        "router": "round-robin", "autoscaling_config": '{"min_replicas": 1, "max_replicas": 4}',
        "kv_events_endpoint": "tcp://127.0.0.1:5557",
    })  # fmt: skip
    assert (config.model, config.pages, config.no_prefix_cache) == ("random", 48, False)
    assert (scaling.replicas, scaling.router) == (3, "round-robin")
    assert scaling.autoscaling_config == {"min_replicas": 1, "max_replicas": 4}
    assert config.kv_events.for_rank(2) == ("tcp://127.0.0.1:5559", None)
    with pytest.raises(ValueError, match="'colour'"):
        parse_args({"colour": "blue"})


def test_builder_args_take_kv_tier_paths_as_they_are():
    config, _ = parse_args({"kv_disk": "/var/kv", "kv_remote": "redis://10.0.0.5:6379",
                            "kv_offload": "eager", "kv_disk_size": "2G"})  # fmt: skip
    assert (config.kv_disk, config.kv_remote) == ("/var/kv", "redis://10.0.0.5:6379")
    assert (config.kv_offload, config.kv_disk_size) == ("eager", "2G")


@pytest.mark.parametrize(
    "args, message",
    [
        (["--replicas", "0"], "--replicas must be >= 1"),
        (["--replicas", "2", "--autoscaling-config", "{nope"], "not JSON"),
        (["--replicas", "2", "--kv-events-endpoint", "ipc:///x"], "tcp://HOST:PORT"),
        (["--replicas", "2", "--kv-events-endpoint", "tcp://*:5557", "--no-prefix-cache"],
         "needs the prefix cache"),
        (["--replicas", "2", "--kv-remote", "http://h:1"], "redis://HOST:PORT"),
        (["--kv-disk", "/tmp/x", "--kv-disk-size", "lots"], "--kv-disk-size"),
        (["--kv-remote", "redis://h:1", "--no-prefix-cache"], "need the prefix cache"),
    ],
)  # fmt: skip
def test_replica_option_mistakes_exit_2_with_one_line_before_ray_starts(capsys, args, message):
    from mstar.cli import main

    assert main(["serve", "--model", "random", *args]) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err
