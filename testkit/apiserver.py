#!/usr/bin/env python3
"""A stand-in Kubernetes API server for netreap's tests.

No kube-apiserver can be installed on the machines these tests run on, so
this small server plays one. It follows the API's conventions where netreap
depends on them, rather than whatever our client happens to send:

- every write bumps one global resourceVersion; objects carry theirs;
- PUT with a stale metadata.resourceVersion -> 409 Conflict; a merge patch
  naming a stale metadata.resourceVersion -> 409 Conflict;
- JSON patch (application/json-patch+json, RFC 6902): a failed `test` op,
  or a path that does not exist -> 422 Invalid, and nothing is applied;
- DELETE with preconditions (resourceVersion, uid) that do not hold -> 409;
- POST of an existing name -> 409 AlreadyExists; unknown object -> 404;
- list and watch honour fieldSelector (spec.nodeName, metadata.name,
  metadata.namespace; any other field -> 400, as the real server refuses
  fields it does not index) and namespaces;
- watch streams ADDED/MODIFIED/DELETED after the given resourceVersion (an
  object leaving a field selector is DELETED for that watch), BOOKMARK
  events every second with allowWatchBookmarks=true, and ends after
  timeoutSeconds.

Test controls (not Kubernetes), under /_control/:
- GET  /_control/log       every request served: method, path, query,
                            content type, body, status;
- POST /_control/hook      {"method": "PATCH", "path": P, "ops": [...]}:
                            before the next request of that method to that
                            path, apply the JSON patch `ops` to the object
                            as another writer would (a concurrent allocator
                            between netreap's read and its patch).

Usage: apiserver.py PORTFILE   (binds 127.0.0.1:0, writes the port there)
"""

import copy
import json
import sys
import threading
import time
import uuid
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import parse_qs, urlparse

LOCK = threading.Condition()
STATE = {"rv": 1000}
# (group_version, plural) -> {(namespace, name): object}
OBJECTS = {}
# Every write: (rv, type, group_version, plural, object, old object)
HISTORY = []
LOG = []
HOOKS = []

KINDS = {
    ("v1", "pods"): ("Pod", True),
    ("v1", "nodes"): ("Node", False),
    ("v1", "namespaces"): ("Namespace", False),
    ("whereabouts.cni.cncf.io/v1alpha1", "ippools"): ("IPPool", True),
    ("whereabouts.cni.cncf.io/v1alpha1", "overlappingrangeipreservations"): (
        "OverlappingRangeIPReservation",
        True,
    ),
    ("events.k8s.io/v1", "events"): ("Event", True),
}

SELECTABLE = {"spec.nodeName", "metadata.name", "metadata.namespace"}


class ApiError(Exception):
    def __init__(self, code, reason, message):
        super().__init__(message)
        self.code, self.reason, self.message = code, reason, message

    def status(self):
        return {
            "kind": "Status",
            "apiVersion": "v1",
            "metadata": {},
            "status": "Failure",
            "message": self.message,
            "reason": self.reason,
            "code": self.code,
        }


def now_rfc3339():
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())


def bump():
    STATE["rv"] += 1
    return str(STATE["rv"])


def record(kind, gv, plural, obj, old=None):
    HISTORY.append((STATE["rv"], kind, gv, plural, copy.deepcopy(obj), copy.deepcopy(old)))
    LOCK.notify_all()


def field(obj, path):
    cur = obj
    for part in path.split("."):
        if not isinstance(cur, dict):
            return ""
        cur = cur.get(part)
    return "" if cur is None else str(cur)


def parse_selector(text):
    """fieldSelector 'a=b,c!=d' -> [(field, op, value)]; 400 on others."""
    out = []
    if not text:
        return out
    for term in text.split(","):
        if "!=" in term:
            key, value = term.split("!=", 1)
            op = "!="
        elif "==" in term:
            key, value = term.split("==", 1)
            op = "="
        elif "=" in term:
            key, value = term.split("=", 1)
            op = "="
        else:
            raise ApiError(400, "BadRequest", f"invalid field selector {term!r}")
        if key not in SELECTABLE:
            raise ApiError(400, "BadRequest", f'field label not supported: "{key}"')
        out.append((key, op, value))
    return out


def matches(obj, namespace, selector):
    if obj is None:
        return False
    if namespace is not None and obj.get("metadata", {}).get("namespace") != namespace:
        return False
    for key, op, value in selector:
        got = field(obj, key)
        if (got == value) != (op == "="):
            return False
    return True


# RFC 6901 / 6902 -----------------------------------------------------------


def pointer(path):
    if path == "":
        return []
    if not path.startswith("/"):
        raise ApiError(422, "Invalid", f"invalid JSON pointer {path!r}")
    return [p.replace("~1", "/").replace("~0", "~") for p in path[1:].split("/")]


def resolve(doc, parts):
    cur = doc
    for p in parts:
        if isinstance(cur, dict) and p in cur:
            cur = cur[p]
        elif isinstance(cur, list) and p.isdigit() and int(p) < len(cur):
            cur = cur[int(p)]
        else:
            raise ApiError(422, "Invalid", "path " + "/" + "/".join(parts) + " does not exist")
    return cur


def json_patch(doc, ops):
    doc = copy.deepcopy(doc)
    if not isinstance(ops, list):
        raise ApiError(400, "BadRequest", "a JSON patch is a list of operations")
    for op in ops:
        kind, parts = op.get("op"), pointer(op.get("path", ""))
        if kind == "test":
            if resolve(doc, parts) != op.get("value"):
                raise ApiError(
                    422,
                    "Invalid",
                    f"the server rejected our request due to an error in our request: "
                    f"test operation failed at {op.get('path')}",
                )
            continue
        parent = resolve(doc, parts[:-1])
        last = parts[-1]
        if kind == "remove":
            if isinstance(parent, dict) and last in parent:
                del parent[last]
            elif isinstance(parent, list) and last.isdigit() and int(last) < len(parent):
                del parent[int(last)]
            else:
                raise ApiError(422, "Invalid", f"cannot remove missing {op.get('path')}")
        elif kind in ("add", "replace"):
            if kind == "replace":
                resolve(doc, parts)
            if isinstance(parent, dict):
                parent[last] = copy.deepcopy(op.get("value"))
            elif isinstance(parent, list):
                if last == "-":
                    parent.append(copy.deepcopy(op.get("value")))
                else:
                    parent.insert(int(last), copy.deepcopy(op.get("value")))
            else:
                raise ApiError(422, "Invalid", f"cannot {kind} at {op.get('path')}")
        else:
            raise ApiError(422, "Invalid", f"unsupported op {kind!r}")
    return doc


def merge_patch(target, patch):
    if not isinstance(patch, dict):
        return copy.deepcopy(patch)
    target = copy.deepcopy(target) if isinstance(target, dict) else {}
    for k, v in patch.items():
        if v is None:
            target.pop(k, None)
        else:
            target[k] = merge_patch(target.get(k), v)
    return target


# Routing -------------------------------------------------------------------


def route(path):
    """-> (gv, plural, namespace, name, subresource) or None."""
    parts = [p for p in path.split("/") if p]
    if parts[:2] == ["api", "v1"]:
        gv, rest = "v1", parts[2:]
    elif len(parts) >= 3 and parts[0] == "apis":
        gv, rest = parts[1] + "/" + parts[2], parts[3:]
    else:
        return None
    namespace = None
    if len(rest) >= 3 and rest[0] == "namespaces":
        namespace, rest = rest[1], rest[2:]
    if not rest:
        return None
    plural = rest[0]
    name = rest[1] if len(rest) > 1 else None
    sub = rest[2] if len(rest) > 2 else None
    if (gv, plural) not in KINDS:
        raise ApiError(404, "NotFound", f"the server could not find the requested resource ({gv} {plural})")
    return gv, plural, namespace, name, sub


class Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def log_message(self, *args):
        pass

    def body(self):
        n = int(self.headers.get("Content-Length") or 0)
        raw = self.rfile.read(n) if n else b""
        return json.loads(raw) if raw else None

    def send(self, code, obj):
        data = json.dumps(obj).encode()
        try:
            self.send_response(code)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)
        except (BrokenPipeError, ConnectionResetError):
            # The client went away (a watch cancelled, an agent stopped).
            self.close_connection = True

    def handle_any(self, method):
        url = urlparse(self.path)
        query = {k: v[-1] for k, v in parse_qs(url.query).items()}
        entry = {
            "method": method,
            "path": url.path,
            "query": query,
            "content_type": self.headers.get("Content-Type"),
        }
        try:
            body = self.body()
            entry["body"] = body
            if url.path.startswith("/_control/"):
                return self.control(method, url.path, body)
            if url.path == "/version":
                return self.send(200, {"major": "1", "minor": "33", "gitVersion": "v1.33.0-netreap-standin"})
            r = route(url.path)
            if r is None:
                raise ApiError(404, "NotFound", f"no route {url.path}")
            gv, plural, namespace, name, sub = r
            if method == "GET" and name is None and query.get("watch") in ("true", "1"):
                entry["status"] = 200
                with LOCK:
                    LOG.append(entry)
                return self.watch(gv, plural, namespace, query)
            code, obj = self.serve(method, gv, plural, namespace, name, sub, query, body)
            entry["status"] = code
            with LOCK:
                LOG.append(entry)
            return self.send(code, obj)
        except ApiError as e:
            entry["status"] = e.code
            with LOCK:
                LOG.append(entry)
            return self.send(e.code, e.status())

    def control(self, method, path, body):
        with LOCK:
            if path == "/_control/log" and method == "GET":
                return self.send(200, LOG)
            if path == "/_control/hook" and method == "POST":
                HOOKS.append(body)
                return self.send(200, {"hooks": len(HOOKS)})
        raise ApiError(404, "NotFound", path)

    def serve(self, method, gv, plural, namespace, name, sub, query, body):
        kind, namespaced = KINDS[(gv, plural)]
        with LOCK:
            store = OBJECTS.setdefault((gv, plural), {})
            for hook in list(HOOKS):
                if hook.get("method") == method and hook.get("path") == self.path.split("?")[0]:
                    HOOKS.remove(hook)
                    key = (namespace, name)
                    if key in store:
                        old = store[key]
                        new = json_patch(old, hook["ops"])
                        new["metadata"]["resourceVersion"] = bump()
                        store[key] = new
                        record("MODIFIED", gv, plural, new, old)
            if method == "GET" and name is None:
                selector = parse_selector(query.get("fieldSelector"))
                items = [o for o in store.values() if matches(o, namespace, selector)]
                items.sort(key=lambda o: (o["metadata"].get("namespace") or "", o["metadata"]["name"]))
                return 200, {
                    "kind": kind + "List",
                    "apiVersion": gv,
                    "metadata": {"resourceVersion": str(STATE["rv"])},
                    "items": items,
                }
            key = (namespace if namespaced else None, name)
            if method == "POST" and name is None:
                obj = body or {}
                meta = obj.setdefault("metadata", {})
                if not meta.get("name"):
                    raise ApiError(422, "Invalid", "metadata.name: Required value")
                key = (namespace if namespaced else None, meta["name"])
                if key in store:
                    raise ApiError(409, "AlreadyExists", f'{plural} "{meta["name"]}" already exists')
                if namespaced:
                    meta["namespace"] = namespace
                meta["uid"] = str(uuid.uuid4())
                meta["creationTimestamp"] = now_rfc3339()
                meta["resourceVersion"] = bump()
                obj["kind"], obj["apiVersion"] = kind, gv
                store[key] = obj
                record("ADDED", gv, plural, obj)
                return 201, obj
            if key not in store:
                raise ApiError(404, "NotFound", f'{plural} "{name}" not found')
            old = store[key]
            if method == "GET":
                return 200, old
            if method == "PUT":
                rv = (body or {}).get("metadata", {}).get("resourceVersion")
                if rv is not None and rv != old["metadata"]["resourceVersion"]:
                    raise ApiError(409, "Conflict", f"the object has been modified; please apply your changes to the latest version and try again")
                new = copy.deepcopy(body)
                new["metadata"] = {**old["metadata"], **new.get("metadata", {})}
            elif method == "PATCH":
                ctype = (self.headers.get("Content-Type") or "").split(";")[0]
                if ctype == "application/json-patch+json":
                    new = json_patch(old, body)
                elif ctype in ("application/merge-patch+json", "application/strategic-merge-patch+json"):
                    rv = (body or {}).get("metadata", {}).get("resourceVersion")
                    if rv is not None and rv != old["metadata"]["resourceVersion"]:
                        raise ApiError(409, "Conflict", "the object has been modified; please apply your changes to the latest version and try again")
                    new = merge_patch(old, body)
                else:
                    raise ApiError(415, "UnsupportedMediaType", f"unsupported patch type {ctype!r}")
                for fixed in ("name", "namespace", "uid", "creationTimestamp"):
                    if new.get("metadata", {}).get(fixed) != old["metadata"].get(fixed):
                        raise ApiError(422, "Invalid", f"metadata.{fixed}: field is immutable")
            elif method == "DELETE":
                pre = (body or {}).get("preconditions") or {}
                if pre.get("resourceVersion") not in (None, old["metadata"]["resourceVersion"]):
                    raise ApiError(409, "Conflict", "Precondition failed: ResourceVersion in precondition does not match")
                if pre.get("uid") not in (None, old["metadata"]["uid"]):
                    raise ApiError(409, "Conflict", "Precondition failed: UID in precondition does not match")
                del store[key]
                bump()
                record("DELETED", gv, plural, old, old)
                return 200, {"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Success", "details": {"name": name, "kind": plural, "uid": old["metadata"]["uid"]}}
            else:
                raise ApiError(405, "MethodNotAllowed", method)
            new["metadata"]["resourceVersion"] = bump()
            new["kind"], new["apiVersion"] = kind, gv
            store[key] = new
            record("MODIFIED", gv, plural, new, old)
            return 200, new

    def watch(self, gv, plural, namespace, query):
        kind, _ = KINDS[(gv, plural)]
        selector = parse_selector(query.get("fieldSelector"))
        since = int(query.get("resourceVersion") or STATE["rv"])
        timeout = float(query.get("timeoutSeconds") or 290)
        bookmarks = query.get("allowWatchBookmarks") in ("true", "1")
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Transfer-Encoding", "chunked")
        self.end_headers()
        deadline = time.monotonic() + timeout
        next_bookmark = time.monotonic() + 1.0
        pos = 0
        try:
            while time.monotonic() < deadline:
                out = []
                with LOCK:
                    while pos < len(HISTORY):
                        rv, etype, egv, eplural, obj, old = HISTORY[pos]
                        pos += 1
                        if rv <= since or (egv, eplural) != (gv, plural):
                            continue
                        now_in = etype != "DELETED" and matches(obj, namespace, selector)
                        was_in = old is not None and matches(old, namespace, selector)
                        if now_in and etype == "ADDED":
                            out.append({"type": "ADDED", "object": obj})
                        elif now_in:
                            out.append({"type": "MODIFIED" if was_in else "ADDED", "object": obj})
                        elif was_in:
                            out.append({"type": "DELETED", "object": obj})
                    if not out:
                        LOCK.wait(timeout=0.2)
                    current = STATE["rv"]
                if bookmarks and time.monotonic() >= next_bookmark and not out:
                    out.append({
                        "type": "BOOKMARK",
                        "object": {"kind": kind, "apiVersion": gv, "metadata": {"resourceVersion": str(current)}},
                    })
                    next_bookmark = time.monotonic() + 1.0
                for event in out:
                    data = json.dumps(event).encode() + b"\n"
                    self.wfile.write(b"%x\r\n%s\r\n" % (len(data), data))
                self.wfile.flush()
            self.wfile.write(b"0\r\n\r\n")
            self.wfile.flush()
        except (BrokenPipeError, ConnectionResetError):
            return

    def do_GET(self):
        self.handle_any("GET")

    def do_POST(self):
        self.handle_any("POST")

    def do_PUT(self):
        self.handle_any("PUT")

    def do_PATCH(self):
        self.handle_any("PATCH")

    def do_DELETE(self):
        self.handle_any("DELETE")


def main():
    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    server.daemon_threads = True
    with open(sys.argv[1] + ".tmp", "w") as f:
        f.write(str(server.server_address[1]))
    import os

    os.rename(sys.argv[1] + ".tmp", sys.argv[1])
    server.serve_forever()


if __name__ == "__main__":
    main()
