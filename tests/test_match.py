"""Route matching: templates with parameters, methods, host; first match wins."""

from __future__ import annotations

from gateway.config import Conditions, Route, Upstream
from gateway.match import Router

UP = Upstream("up", "http://127.0.0.1:1")


def route(name: str, path: str, methods: frozenset[str] | None = None, host: str | None = None,
          method_override: str = "honour") -> Route:
    return Route(name=name, path=path, methods=methods, host=host, upstream=UP, limits=(),
                 method_override=method_override)


ROUTER = Router([
    route("seckill", "/seckill/{item_id}", frozenset({"POST"})),
    route("user", "/users/{uid:int}/orders/{oid}"),
    route("admin", "/admin/{rest:path}", host="admin.example"),
    route("files", "/files/{rest:path}"),
    route("exact", "/health.json"),
    route("all", "/{rest:path}"),
])


def name(method: str, path: str, host: str = "shop.example") -> tuple[str, dict[str, str]] | None:
    found = ROUTER.match(method, host, path)
    return (found[0].name, found[1]) if found else None


def test_parameters_and_methods() -> None:
    assert name("POST", "/seckill/42") == ("seckill", {"item_id": "42"})
    # a route naming methods owns its path: the catch-all does not take GET (the app answers 405)
    assert name("GET", "/seckill/42") is None
    assert ROUTER.allowed_methods("shop.example", "/seckill/42") == {"POST"}
    assert ROUTER.allowed_methods("shop.example", "/seckill/42/extra") == frozenset()
    assert name("POST", "/seckill/42/extra") == ("all", {"rest": "seckill/42/extra"})
    assert name("POST", "/seckill/") == ("all", {"rest": "seckill/"})


def test_typed_parameters() -> None:
    assert name("GET", "/users/7/orders/a1") == ("user", {"uid": "7", "oid": "a1"})
    assert name("GET", "/users/seven/orders/a1") == ("all", {"rest": "users/seven/orders/a1"})


def test_host_and_first_match_wins() -> None:
    assert name("GET", "/admin/x/y", host="admin.example") == ("admin", {"rest": "x/y"})
    assert name("GET", "/admin/x/y") == ("all", {"rest": "admin/x/y"})
    assert name("GET", "/files/a/b.txt") == ("files", {"rest": "a/b.txt"})


def test_literal_characters_are_not_regex() -> None:
    assert name("GET", "/health.json") == ("exact", {})
    assert name("GET", "/healthxjson") == ("all", {"rest": "healthxjson"})


def test_no_match() -> None:
    strict = Router([route("only", "/only", frozenset({"GET"}))])
    assert strict.match("POST", "", "/only") is None
    assert strict.match("GET", "", "/only/x") is None


def test_one_trailing_slash_is_the_same_resource() -> None:
    # a slash must not walk around a route's limits to a catch-all (Starlette, Django and Spring < 6
    # serve /seckill/42/ as /seckill/42)
    assert name("POST", "/seckill/42/") == ("seckill", {"item_id": "42"})
    assert name("GET", "/seckill/42/") is None
    assert ROUTER.allowed_methods("shop.example", "/seckill/42/") == {"POST"}
    assert name("POST", "/seckill/42//") == ("all", {"rest": "seckill/42//"})  # merged before matching
    assert name("GET", "/health.json/") == ("exact", {})
    assert name("GET", "/users/7/orders/a1/") == ("user", {"uid": "7", "oid": "a1"})
    trailing = Router([route("dir", "/docs/", frozenset({"GET"}))])
    assert trailing.match("GET", "", "/docs") is not None
    assert trailing.match("GET", "", "/docs/") is not None
    root = Router([route("root", "/", frozenset({"GET"}))])
    assert root.match("GET", "", "/") is not None
    assert root.match("GET", "", "//") is None


def test_a_template_matches_the_whole_path_whatever_its_characters() -> None:
    # a newline is a character like any other: `path` takes it, and no template matches a path
    # that only begins like it (Python's `$` would also match before a final newline)
    strict = Router([route("files", "/files/{rest:path}", frozenset({"GET"})), route("one", "/x/{id}"),
                     route("exact", "/health.json")])
    assert strict.match("GET", "", "/files/a\nb") == (strict.routes[0].route, {"rest": "a\nb"})
    assert strict.match("GET", "", "/health.json\n") is None
    assert strict.match("GET", "", "/x/7\n") == (strict.routes[1].route, {"id": "7\n"})
    assert strict.allowed_methods("", "/files/a\nb") == {"GET", "HEAD"}


def test_a_route_that_asks_who_is_asking_is_passed_over_when_not_met() -> None:
    pro = Route(name="pro", path="/api/{rest:path}", methods=frozenset({"GET"}), host=None, upstream=UP, limits=(),
                when=Conditions(headers=((b"x-plan", frozenset({b"pro"})),)))
    router = Router([pro, route("free", "/api/{rest:path}", frozenset({"GET"})), route("all", "/{rest:path}")])
    assert router.conditional

    def named(meets: bool, method: str = "GET") -> str | None:
        found = router.match(method, "h", "/api/x", lambda r: meets)
        return found[0].name if found else None

    assert named(True) == "pro"
    assert named(False) == "free"  # the tier's path still has a route: the next one that matches
    # the 405 rule is about methods alone: a POST is refused by the routes' methods, not by the tier
    assert named(False, "POST") is None and router.allowed_methods("h", "/api/x") == {"GET", "HEAD"}
    assert Router([pro]).match("GET", "h", "/api/x", lambda r: False) is None
    assert not ROUTER.conditional


def test_a_get_route_takes_head_and_an_override_is_matched_as_the_method_it_names() -> None:
    router = Router([route("read", "/items", methods=frozenset({"GET"})),
                     route("remove", "/items", methods=frozenset({"DELETE"})),
                     route("rest", "/{rest:path}")])
    assert router.match("HEAD", "", "/items") == (router.routes[0].route, {})
    assert router.match("POST", "", "/items") is None  # owned by GET and DELETE: a 405, not the catch-all's
    assert router.match("POST", "", "/items", override="DELETE") == (router.routes[1].route, {})
    assert router.match("POST", "", "/items", override="HEAD") == (router.routes[0].route, {})
    assert router.allowed_methods("", "/items") == {"GET", "HEAD", "DELETE"}


def test_a_route_whose_upstream_ignores_overrides_matches_the_request_line() -> None:
    router = Router([route("literal", "/x", methods=frozenset({"GET"}), method_override="ignore"),
                     route("rest", "/{rest:path}")])
    assert router.match("POST", "", "/x", override="GET") is None
    assert router.match("GET", "", "/x", override="DELETE") == (router.routes[0].route, {})
