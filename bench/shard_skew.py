"""Under-admission of a split rule (`shards: N`), measured on the split arithmetic itself.

A rule whose identity differs from the route's first rule holds `shard_share(L, N, s)` in shard s;
a request goes to the shard of its first-rule identity (gateway.keys.shard_of, the real hash). This
replays a flash sale: K identities (users) with a demand distribution, requests arriving in random
order, against a quota of L split over N shards, and counts what is admitted:

    static       the shipped design: a shard admits until its own share is spent
    borrow-1     a refused request tries one neighbour shard (s+1 mod N) in a second call
    borrow-2     ... and the next one in a third

(Trying every shard would admit exactly min(demand, L), at up to N calls per refused request.)
It prints the admitted fraction of min(demand, L) (1.0 = no under-admission) and, for the borrowing
variants, the script calls per request they cost. No Redis: the shares and the
hash are the gateway's own functions, and a quota's outcome depends on nothing else.

    .venv/bin/python bench/shard_skew.py
"""

from __future__ import annotations

import argparse
import random
import statistics

from gateway.config import shard_share
from gateway.keys import shard_of


def demands(users: int, total: int, skew: float, rng: random.Random) -> list[int]:
    """Requests per user: `total` in all, each from a user drawn with Zipf weights of exponent
    `skew` (0 = every user alike)."""
    weights = [1.0 / (rank + 1) ** skew for rank in range(users)]
    rng.shuffle(weights)
    out = [0] * users
    for user in rng.choices(range(users), weights, k=total):
        out[user] += 1
    return out


def replay(limit: int, shards: int, per_user: list[int], borrow: int, rng: random.Random) -> tuple[int, int]:
    """(admitted, script calls) for one sale."""
    left = [shard_share(limit, shards, s) for s in range(shards)]
    home = [shard_of([f"user-{u}".encode()], shards) for u in range(len(per_user))]
    arrivals = [u for u, n in enumerate(per_user) for _ in range(n)]
    rng.shuffle(arrivals)
    admitted = calls = 0
    for user in arrivals:
        shard = home[user]
        for hop in range(borrow + 1):
            calls += 1
            at = (shard + hop) % shards
            if left[at] > 0:
                left[at] -= 1
                admitted += 1
                break
    return admitted, calls


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--limit", type=int, default=10_000)
    parser.add_argument("--runs", type=int, default=3)
    args = parser.parse_args()
    rng = random.Random(12)
    print(f"quota {args.limit}; admitted / min(demand, quota) (mean of {args.runs} runs); "
          "calls per request for the borrowing variants")
    print(f"{'shards':>6} {'users':>7} {'demand':>7} {'skew':>5} | {'static':>7} {'borrow-1':>8} "
          f"{'calls':>5} {'borrow-2':>8} {'calls':>5}")
    for shards in (6, 48, 192):
        for users, demand_x, skew in ((1_000, 1.0, 0.0), (100_000, 1.0, 0.0), (100_000, 1.1, 0.0),
                                      (100_000, 1.5, 0.0), (100_000, 3.0, 0.0),
                                      (1_000, 1.0, 1.0), (100_000, 1.0, 1.0), (100_000, 1.5, 1.0)):
            if users < shards * 10:
                continue
            total = int(args.limit * demand_x)
            rows: dict[int, list[tuple[float, float]]] = {0: [], 1: [], 2: []}
            for _ in range(args.runs):
                per_user = demands(users, total, skew, rng)
                want = min(sum(per_user), args.limit)
                for borrow in rows:
                    admitted, calls = replay(args.limit, shards, per_user, borrow, rng)
                    rows[borrow].append((admitted / want, calls / sum(per_user)))
            static, one, two = (rows[b] for b in (0, 1, 2))
            print(f"{shards:>6} {users:>7} {demand_x:>6.1f}x {skew:>5.1f} | "
                  f"{statistics.mean(a for a, _ in static):>7.4f} "
                  f"{statistics.mean(a for a, _ in one):>8.4f} {statistics.mean(c for _, c in one):>5.2f} "
                  f"{statistics.mean(a for a, _ in two):>8.4f} {statistics.mean(c for _, c in two):>5.2f}")


if __name__ == "__main__":
    main()
