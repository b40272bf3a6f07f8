"""Several Ray nodes on this machine, started the way Ray's own tests do
(`ray.cluster_utils.Cluster`): `pdserve serve --ray-address` spreads a pool over the nodes, and
when a node goes away its worker is placed again on another and the system keeps serving."""
from __future__ import annotations

import asyncio
import os
import time

import pytest

os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")  # the nodes on loopback, read when ray is imported

from pdserve.engine import SamplingParams  # noqa: E402
from pdserve.v1 import generation_pb2 as gen  # noqa: E402
from serve_system import serve_config, start_system, stream_all, tokens  # noqa: E402

PROMPTS = ["def fibonacci(n):", "import os\nimport sys", "class Foo:\n    pass", "x = [1, 2"]
GREEDY = dict(temperature=0, max_tokens=40, ignore_eos=True)


@pytest.fixture(scope="module")
def ray_cluster():
    from ray.cluster_utils import Cluster

    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "include_dashboard": False})
    nodes = [cluster.add_node(num_cpus=1) for _ in range(2)]
    cluster.wait_for_nodes()
    yield cluster, nodes
    cluster.shutdown()


def check_serves(system, offline) -> None:
    requests = [gen.GenerateRequest(prompt=p, sampling_params=gen.SamplingParams(**GREEDY)) for p in PROMPTS]
    got = asyncio.run(stream_all(system.grpc_address, requests))
    assert [tokens(m) for m in got] == [o.token_ids for o in offline.generate(PROMPTS, SamplingParams(**GREEDY))]


def test_pools_spread_over_nodes_and_survive_losing_one(ray_cluster, serving_model, offline, tmp_path):
    cluster, nodes = ray_cluster
    config = serve_config(serving_model, prefill=1, decode=2, spec=False)
    system = start_system(tmp_path, "multinode", config, "--ray-address", cluster.address)
    try:
        decode = system.workers("decode")
        assert len({w["node_id"] for w in decode}) == 2  # SPREAD: one decode worker per node
        check_serves(system, offline)

        by_id = {n.node_id: n for n in nodes}
        victim = next(w for w in decode if w["node_id"] in by_id)  # on a node we may remove (not the head)
        cluster.remove_node(by_id[victim["node_id"]])
        check_serves(system, offline)  # on what remains, during the move

        moved = system.wait_workers(lambda ws: any(w["worker_id"] == victim["worker_id"] and w["node_id"] !=
                                                   victim["node_id"] for w in ws), timeout_s=180)
        assert len([w for w in moved if w["role"] == "decode"]) == 2
        deadline = time.monotonic() + 60
        while True:  # the router follows the move, then serves with both again
            try:
                check_serves(system, offline)
                break
            except AssertionError:
                assert time.monotonic() < deadline
                time.sleep(1)
    finally:
        code, _ = system.stop(timeout_s=90)
    assert code == 0
