"""Decisions a Redis has run, read from its MONITOR feed.

INFO commandstats counts every script call, and a gateway process makes calls of its own that are
no decision: the overrides poll (gateway/overrides.py) runs one script call per route every second,
so a count taken around a few requests drifted by a whole poll now and then (CI saw 194 == 186 on
an 8-route config). The feed names each EVALSHA's script, so those of the gateway's other scripts
are left out. A NOSCRIPT call shows in the feed like any other: its count comes from INFO's
`failed_calls`, read in the same MULTI as the marker that closes the count, so both are of one
instant.
"""

from __future__ import annotations

import threading
import uuid

import redis

from gateway.limiter import LEASES
from gateway.overrides import CHANGED, COMMAND, DELETE, DROP, PUT
from tests.support.redis_proc import RedisProcess

NOT_DECISIONS = {script.sha.decode() for script in (LEASES, CHANGED, COMMAND, DELETE, DROP, PUT)}


class ScriptFeed:
    """Counts the decision scripts run since it started (EVALSHA of any other script than
    NOT_DECISIONS, and EVAL) by a thread reading MONITOR."""

    def __init__(self, proc: RedisProcess) -> None:
        self.proc = proc
        self._seen = threading.Condition()
        self._calls = 0
        self._markers: dict[str, int] = {}  # marker -> calls counted when the feed reached it
        self._failed_at_start = self._failed(proc.client().info("commandstats"))
        ready = threading.Event()
        self._thread = threading.Thread(target=self._read, args=(ready,), daemon=True)
        self._thread.start()
        if not ready.wait(10):
            raise RuntimeError("MONITOR did not start")

    @staticmethod
    def _failed(stats: dict[str, dict[str, int]]) -> int:
        return int(stats.get("cmdstat_evalsha", {}).get("failed_calls", 0))

    def _read(self, ready: threading.Event) -> None:
        client = redis.Redis(host="127.0.0.1", port=self.proc.port)
        try:
            with client.monitor() as feed:  # type: ignore[no-untyped-call]
                ready.set()
                while True:
                    words = feed.next_command()["command"].split(" ", 2)
                    name = words[0].upper()
                    with self._seen:
                        if name == "EVAL" or (name == "EVALSHA" and words[1] not in NOT_DECISIONS):
                            self._calls += 1
                        elif name == "ECHO" and words[1].startswith("feed-marker-"):
                            self._markers[words[1]] = self._calls
                            self._seen.notify_all()
        except (redis.ConnectionError, OSError):  # the server stopped
            pass
        finally:
            client.close()

    def decisions(self) -> int:
        """Decision scripts Redis ran, to this instant, that did not fail (NOSCRIPT)."""
        marker = f"feed-marker-{uuid.uuid4().hex}"
        client = self.proc.client()
        try:
            with client.pipeline(transaction=True) as pipe:
                pipe.echo(marker)
                pipe.info("commandstats")
                _, stats = pipe.execute()
        finally:
            client.close()
        with self._seen:
            if not self._seen.wait_for(lambda: marker in self._markers, timeout=10):
                raise RuntimeError("the MONITOR feed fell silent")
            calls = self._markers.pop(marker)
        return calls - (self._failed(stats) - self._failed_at_start)


_feeds: dict[int, ScriptFeed] = {}


def decisions(proc: RedisProcess) -> int:
    """Decision scripts `proc` has run since the first time it was asked about (counts are to be
    compared with each other)."""
    feed = _feeds.get(id(proc))
    if feed is None or feed.proc is not proc:
        feed = _feeds[id(proc)] = ScriptFeed(proc)
    return feed.decisions()
