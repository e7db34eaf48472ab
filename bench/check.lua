-- wrk hooks for bench/check.py on the check port: bench/report.lua (its request headers and its
-- JSON line; bench/check.py names it in BENCH_REPORT_LUA), asking the forward-auth question Traefik
-- or Caddy would ask about bench/run.py's request (GET /api/items/42 as bench-user).
dofile(os.getenv("BENCH_REPORT_LUA"))
wrk.path = "/"
wrk.headers["X-Forwarded-Method"] = "GET"
wrk.headers["X-Forwarded-Uri"] = "/api/items/42"
wrk.headers["X-Forwarded-Host"] = "bench"
