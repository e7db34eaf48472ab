-- wrk hooks for bench/check.py on the check port: the forward-auth question Traefik or Caddy would
-- ask about bench/run.py's request (GET /api/items/42 as bench-user), and one JSON line at the end.
wrk.method = "GET"
wrk.path = "/"
wrk.headers["X-Forwarded-Method"] = "GET"
wrk.headers["X-Forwarded-Uri"] = "/api/items/42"
wrk.headers["X-Forwarded-Host"] = "bench"
wrk.headers["X-User-Id"] = "bench-user"

done = function(summary, latency, requests)
  local e = summary.errors
  io.write(string.format(
    'BENCH_JSON {"requests":%d,"duration_us":%d,"bytes":%d,'
      .. '"errors":{"connect":%d,"read":%d,"write":%d,"status":%d,"timeout":%d},'
      .. '"latency_us":{"min":%d,"mean":%.1f,"stdev":%.1f,"p50":%d,"p90":%d,"p99":%d,"max":%d}}\n',
    summary.requests, summary.duration, summary.bytes,
    e.connect, e.read, e.write, e.status, e.timeout,
    latency.min, latency.mean, latency.stdev,
    latency:percentile(50), latency:percentile(90), latency:percentile(99), latency.max))
end
