"""The rate limit service on a real Redis Cluster (three primaries): a domain's keys in one hash
tag by default, or spread over `shards: N` tags, each call still ONE script call in one slot."""

from __future__ import annotations

import random
from collections.abc import Iterator

import pytest
from redis.crc import key_slot

from gateway.keys import shard_tags
from tests.support.cluster import RedisCluster
from tests.support.gateway_proc import GatewayProcess
from tests.support.ports import free_port
from tests.support.rls_client import OK, OVER_LIMIT, Descriptor, RlsClient, remaining

pytestmark = pytest.mark.clock_windows  # counts under windows aligned to the clock (tests/conftest.py)

CONFIG = """\
version: 1
redis: {{mode: cluster, url: "{url}", timeout: 500ms}}
rls:
  domains:
    flat:
      descriptors:
        - {{key: user, limit: {{name: user, algorithm: fixed_window, limit: 3, window: 1m}}}}
        - {{key: site, limit: {{name: site, algorithm: gcra, rate: 1/min, burst: 8}}}}
    spread:
      shards: 4
      descriptors:
        - {{key: user, limit: {{name: user, algorithm: fixed_window, limit: 4, window: 1m}}}}
        - {{key: site, limit: {{name: site, algorithm: gcra, rate: 1/min, burst: 8}}}}
"""


@pytest.fixture(scope="module")
def service(cluster: RedisCluster, tmp_path_factory: pytest.TempPathFactory) -> Iterator[RlsClient]:
    tmp = tmp_path_factory.mktemp("rls-cluster")
    port = free_port()
    gateway = GatewayProcess(CONFIG.format(url=cluster.url), tmp, args=("--rls-port", str(port)))
    gateway.start()
    client = RlsClient(port)
    try:
        yield client
    finally:
        client.close()
        gateway.stop()


def unique() -> str:
    return f"u{random.getrandbits(40):x}"


def test_a_domain_decides_all_descriptors_in_one_call_on_a_cluster(service: RlsClient) -> None:
    site = unique()
    a = [service.ask("flat", [("user", "a" + site)], [("site", site)]).overall_code for _ in range(5)]
    assert a == [OK, OK, OK, OVER_LIMIT, OVER_LIMIT]
    b = [service.ask("flat", [("user", "b" + site)], [("site", site)]).overall_code for _ in range(4)]
    assert b == [OK, OK, OK, OVER_LIMIT]  # the site's 8: 3 + 3, and b's own 3
    assert remaining(service.ask("flat", Descriptor([("site", site)], hits=0))) == [2]


def test_shards_spread_calls_over_slots_and_never_admit_past_a_limit(service: RlsClient) -> None:
    """The first descriptor's values choose the shard: its rule keeps its whole limit there; the
    site, split over 4 shards, holds 2 in each, so all the users together get at most 8."""
    slots = {key_slot(tag.encode()) for tag in shard_tags("rls.spread", 4)}
    assert len(slots) == 4  # one per quarter of the slot space: every primary gets some
    site = unique()
    admitted = 0
    for n in range(40):
        user = f"{site}-{n}"
        answers = [service.ask("spread", [("user", user)], [("site", site)]).overall_code for _ in range(5)]
        assert answers.count(OK) <= 4, answers  # the user's whole limit, in its shard
        admitted += answers.count(OK)
    assert admitted == 8, admitted  # 40 users spread over all 4 shards: every share is spent
