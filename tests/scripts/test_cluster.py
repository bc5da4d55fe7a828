"""Scale-out, end to end: scripts/cluster starts a real Redis, three `loraplex serve` processes and
the real proxies from deploy/ (nginx, and HAProxy when installed); the tests talk to them over
127.0.0.1 with real clients and stop a replica with a real SIGKILL."""
from __future__ import annotations

import json
import os
import secrets
import shutil
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
from tests.repo import ROOT_DIR as ROOT

TOKEN = "cluster-admin-token-0123456789"
REPLICAS = 3
SETTLE_INTERVAL = 1.0  # --usage-settle-interval of the replicas; --lease-ttl stays at its default

K8S = ROOT / "deploy" / "kubernetes"


def _binary(name: str) -> str | None:
    # As scripts/cluster finds them: Debian puts both in /usr/sbin, off a normal user's PATH.
    return shutil.which(name) or shutil.which(name, path="/usr/local/sbin:/usr/sbin:/sbin")


NO_NGINX = "nginx is not installed, so the cluster tests cannot run: `apt-get install nginx` " \
           "(scripts/test installs it when run as root)"
PROXIES = ["nginx", pytest.param("haproxy", marks=pytest.mark.skipif(
    _binary("haproxy") is None, reason="haproxy is not installed: `apt-get install haproxy`"))]


@dataclass
class Cluster:
    proxies: dict[str, str]               # proxy kind -> URL
    replicas: dict[str, dict]             # replica name -> {"url", "pid", ...}
    model: str
    process: subprocess.Popen
    output: Path

    @property
    def url(self) -> str:
        return self.proxies["nginx"]

    def admin(self, method: str, path: str, **kw) -> httpx.Response:
        return httpx.request(method, f"{self.url}{path}", headers={"Authorization": f"Bearer {TOKEN}"},
                             timeout=30, **kw)

    def new_tenant(self, quota: dict | None = None) -> str:
        name = f"c-{secrets.token_hex(4)}"
        assert self.admin("POST", "/admin/tenants", json={"name": name, "quota": quota or {}}).status_code == 201
        return name

    def new_key(self, tenant: str) -> str:
        r = self.admin("POST", f"/admin/tenants/{tenant}/keys")
        assert r.status_code == 201, r.text
        return r.json()["key"]

    def replica_of(self, key: str, proxy: str = "nginx") -> str:
        r = httpx.get(f"{self.proxies[proxy]}/v1/models", headers=_auth(key), timeout=30)
        assert r.status_code == 200, r.text
        return r.headers["x-loraplex-replica"]

    def keys_on(self, want: int, quota: dict | None = None, one_tenant: bool = False,
                proxy: str = "nginx") -> dict[str, str]:
        """Fresh keys until `want` replicas each own one (through `proxy`): {replica: key}."""
        found: dict[str, str] = {}
        tenant = self.new_tenant(quota) if one_tenant else None
        for _ in range(40):
            key = self.new_key(tenant or self.new_tenant(quota))
            found.setdefault(self.replica_of(key, proxy), key)
            if len(found) == want:
                return found
        raise AssertionError(f"40 keys landed on only {sorted(found)}: {proxy} is not spreading tenants")


def _auth(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def _complete(url: str, key: str, model: str, **body) -> httpx.Response:
    return httpx.post(f"{url}/v1/completions", headers=_auth(key), timeout=60,
                      json={"model": model, "prompt": [5, 6, 7, 8], "max_tokens": 8, "temperature": 0, **body})


@pytest.fixture(scope="module")
def cluster(tmp_path_factory, tiny_model_dir) -> Cluster:
    if _binary("nginx") is None:
        pytest.skip(NO_NGINX)
    data = tmp_path_factory.mktemp("cluster")
    output = data / "cluster.out"
    proxies = [a for kind in ("nginx", "haproxy") if _binary(kind) for a in ("--proxy", kind)]
    cmd = [sys.executable, str(ROOT / "scripts" / "cluster"), "--replicas", str(REPLICAS), "--port", "0",
           "--replica-base-port", "0", *proxies, "--model", str(tiny_model_dir), "--data-dir", str(data),
           "--admin-token", TOKEN, "--start-timeout", "120",
           "--device", "cpu", "--kv-cache-blocks", "64", "--max-model-len", "512",
           "--usage-settle-interval", str(SETTLE_INTERVAL)]
    with open(output, "wb") as out:
        process = subprocess.Popen(cmd, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT)
    state_file = data / "cluster" / "run" / "cluster.json"
    deadline = time.monotonic() + 150
    while not state_file.exists():
        if process.poll() is not None or time.monotonic() > deadline:
            process.kill()
            pytest.fail(f"scripts/cluster did not come up:\n{output.read_text(errors='replace')[-4000:]}")
        time.sleep(0.2)
    state = json.loads(state_file.read_text())
    try:
        yield Cluster(proxies={p["kind"]: p["url"] for p in state["proxies"]},
                      replicas={r["name"]: r for r in state["replicas"]}, model=state["model"],
                      process=process, output=output)
    finally:
        process.send_signal(signal.SIGINT)  # what Ctrl-C sends
        try:
            process.wait(30)
        except subprocess.TimeoutExpired:
            process.kill()
            pidfile = data / "cluster" / "redis" / "redis.pid"  # the embedded Redis (server.embedded_redis.server)
            children = {**{r["name"]: r["pid"] for r in state["replicas"]},
                        **{p["kind"]: p["pid"] for p in state["proxies"]},
                        **({"redis": int(pidfile.read_text())} if pidfile.is_file() else {})}
            running = [name for name, pid in children.items() if _alive(pid)]
            for pid in children.values():
                _kill(pid)
            pytest.fail(f"scripts/cluster did not stop within 30 s of Ctrl-C; still running then: {running}\n"
                        f"{output.read_text(errors='replace')[-2000:]}")
        alive = [r["name"] for r in state["replicas"] if _alive(r["pid"])]
        assert not alive, f"replicas left running after Ctrl-C: {alive}"


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def _kill(pid: int) -> None:
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


class Stream(threading.Thread):
    """Reads one SSE completion (in the background, or by run()): when each event arrived, in how
    many network reads, whether it ended with [DONE], or the error that ended it."""

    def __init__(self, url: str, key: str, model: str, max_tokens: int = 480, count_tokens: bool = False) -> None:
        super().__init__(daemon=True)
        self.request = (url, key, {"model": model, "prompt": "once", "max_tokens": max_tokens,
                                "ignore_eos": True, "stream": True, **({"logprobs": 0} if count_tokens else {})})
        self.started = threading.Event()
        self.arrivals: list[float] = []
        self.tokens: list[tuple[float, int]] = []  # (arrival, tokens in the event), with count_tokens
        self.reads = 0
        self.done = False
        self.error: Exception | None = None
        self.replica: str | None = None
        self.ended_at: float | None = None

    def run(self) -> None:
        url, key, body = self.request
        t0 = time.monotonic()
        try:
            with httpx.stream("POST", f"{url}/v1/completions", headers=_auth(key), json=body,
                              timeout=httpx.Timeout(30, read=20)) as r:
                self.replica = r.headers.get("x-loraplex-replica")
                pending = b""
                for chunk in r.iter_bytes():
                    self.reads += 1
                    *events, pending = (pending + chunk).split(b"\n\n")
                    for event in events:
                        self.arrivals.append(time.monotonic() - t0)
                        if event.startswith(b"data: {"):
                            choices = json.loads(event[6:])["choices"]
                            logprobs = choices[0].get("logprobs") if choices else None
                            if logprobs:
                                self.tokens.append((time.monotonic(), len(logprobs["tokens"])))
                        self.done = event == b"data: [DONE]"
                        self.started.set()
        except Exception as e:  # noqa: BLE001 - recorded for the test to judge
            self.error = e
        finally:
            self.ended_at = time.monotonic()
            self.started.set()


@pytest.mark.parametrize("proxy", PROXIES)
def test_a_tenant_stays_on_one_replica_and_tenants_spread(cluster, proxy):
    seen = {}
    for _ in range(6):
        key = cluster.new_key(cluster.new_tenant())
        first = cluster.replica_of(key, proxy)
        for _ in range(3):
            r = _complete(cluster.proxies[proxy], key, cluster.model)
            assert r.status_code == 200 and r.headers["x-loraplex-replica"] == first
            assert cluster.replica_of(key, proxy) == first
        seen[key] = first
    # Six random keys on three replicas all hashing to one: about 1 in 240 by chance.
    more = 0
    while len(set(seen.values())) < 2 and more < 20:
        key = cluster.new_key(cluster.new_tenant())
        seen[key] = cluster.replica_of(key, proxy)
        more += 1
    assert len(set(seen.values())) >= 2, f"all tenants on {set(seen.values())}"


@pytest.mark.parametrize("proxy", PROXIES)
def test_streaming_through_the_proxy_is_incremental(cluster, proxy):
    key = cluster.new_key(cluster.new_tenant())
    stream = Stream(cluster.proxies[proxy], key, cluster.model)
    stream.run()
    events = len(stream.arrivals)
    assert stream.error is None and stream.done and events > 100
    # A proxy that buffered would hand events over in a few large pieces, or all at the end.
    total, tenth = stream.arrivals[-1], stream.arrivals[events // 10]
    assert tenth < 0.5 * total, f"10% of the events took {tenth:.2f} s of {total:.2f} s: buffered?"
    assert stream.reads >= events / 4, f"{events} events came in {stream.reads} reads: buffered?"
    assert stream.replica == cluster.replica_of(key, proxy)


def test_requests_per_minute_hold_across_replicas(cluster):
    """One tenant, two keys that the proxy sends to different replicas: one budget."""
    keys = list(cluster.keys_on(2, quota={"requests_per_minute": 6}, one_tenant=True).values())
    codes, served_by = [], set()
    for i in range(16):
        r = _complete(cluster.url, keys[i % 2], cluster.model, max_tokens=2)
        codes.append(r.status_code)
        if r.status_code == 200:
            served_by.add(r.headers["x-loraplex-replica"])
        else:
            assert r.status_code == 429 and int(r.headers["retry-after"]) >= 1
    assert codes.count(200) == 6 and codes.count(429) == 10, codes
    assert len(served_by) == 2


def test_adapter_upload_and_replace_through_the_proxy(cluster, tiny_adapters):
    tenant = cluster.new_tenant()
    key = cluster.new_key(tenant)
    home = cluster.replica_of(key)

    def upload(name: str, adapter: str, replace: bool = False) -> httpx.Response:
        d = tiny_adapters[adapter]
        files = {f: (f, (d / f).read_bytes()) for f in ("adapter_config.json", "adapter_model.safetensors")}
        return httpx.post(f"{cluster.url}/v1/adapters", headers=_auth(key), timeout=60, files=files,
                          data={"name": name, "replace": "true" if replace else "false"})

    def text(url: str, model: str) -> str:
        r = _complete(url, key, model, max_tokens=12)
        assert r.status_code == 200, r.text
        return r.json()["choices"][0]["text"]

    first = upload("mine", "r4_qv")
    assert first.status_code == 201 and first.headers["x-loraplex-replica"] == home
    r = _complete(cluster.url, key, "mine")
    assert r.status_code == 200 and r.headers["x-loraplex-replica"] == home
    # Every replica serves it (the registry is shared), and now holds the old version in memory.
    old = {name: text(rep["url"], "mine") for name, rep in cluster.replicas.items()}
    assert len(set(old.values())) == 1
    assert upload("reference", "r8_all").status_code == 201
    new = text(cluster.url, "reference")
    assert new != old[home], "the two test adapters generate the same text; pick others"

    replaced = upload("mine", "r8_all", replace=True)
    assert replaced.status_code == 201 and replaced.json()["version"] != first.json()["version"]
    after = {name: text(rep["url"], "mine") for name, rep in cluster.replicas.items()}
    assert after == {name: new for name in cluster.replicas}, "a replica served the replaced version"
    assert text(cluster.url, "mine") == new


def test_stopping_a_replica_moves_only_its_tenants(cluster):
    """Kill -9 one replica mid-stream: its stream ends (no hang), its tenants are served by
    another replica, and every other tenant keeps its replica and its stream. A tenant whose
    max_concurrent_requests were all held on the dead replica is admitted elsewhere within 15 s
    (the leases lapse after --lease-ttl without the dead replica's heartbeat), and its usage
    holds the tokens its streams delivered, less at most a settle interval's worth."""
    owners = {proxy: cluster.keys_on(REPLICAS, proxy=proxy) for proxy in cluster.proxies}
    victim = sorted(cluster.replicas)[0]
    others = set(cluster.replicas) - {victim}
    limited = cluster.keys_on(REPLICAS, quota={"max_concurrent_requests": 2})[victim]
    bystander_keys = [cluster.new_key(cluster.new_tenant()) for _ in range(8)]
    before = {proxy: {key: cluster.replica_of(key, proxy) for key in bystander_keys} for proxy in cluster.proxies}
    survivor = Stream(cluster.url, owners["nginx"][sorted(others)[0]], cluster.model)
    doomed = Stream(cluster.url, owners["nginx"][victim], cluster.model)
    held = [Stream(cluster.url, limited, cluster.model, max_tokens=500, count_tokens=True) for _ in range(2)]
    for s in (survivor, doomed, *held):
        s.start()
        assert s.started.wait(30) and s.arrivals, s.error
    assert all(s.replica == victim for s in held)
    refused = _complete(cluster.url, limited, cluster.model)
    assert refused.status_code == 429 and refused.json()["error"]["code"] == "max_concurrent_requests"
    # Kill as soon as both running streams' usage has been settled once (a request is counted at its
    # first settlement; each stream settles on its own clock): a fixed wait raced a quiet machine,
    # where 400 tokens took ~2 s, and waiting for the first settlement alone raced the second stream's.
    deadline = time.monotonic() + 10 * SETTLE_INTERVAL
    while httpx.get(f"{cluster.url}/v1/usage", headers=_auth(limited), timeout=30).json()["total"][
            "requests"] < len(held):
        assert time.monotonic() < deadline, "no usage settled while the streams ran"
        time.sleep(0.1)
    assert not any(s.done for s in held), "the held streams ended before the kill: make them longer"
    os.kill(cluster.replicas[victim]["pid"], signal.SIGKILL)
    killed_at = time.monotonic()

    while (r := _complete(cluster.url, limited, cluster.model)).status_code != 200:
        # 502: nginx sent the POST on a kept-alive connection to the dead replica, which it does not
        # retry (a POST is not idempotent); the next request goes to a live one.
        assert r.status_code in (429, 502) and time.monotonic() - killed_at < 15, (r.status_code, r.text)
        time.sleep(0.25)
    assert r.headers["x-loraplex-replica"] in others
    admitted_after = time.monotonic() - killed_at
    for s in held:
        s.join(15)
        assert not s.done
    delivered = sum(n for s in held for _, n in s.tokens)
    floor = sum(n for s in held for t, n in s.tokens if t <= killed_at - SETTLE_INTERVAL - 1.0)
    recorded = httpx.get(f"{cluster.url}/v1/usage", headers=_auth(limited), timeout=30).json()["total"]
    recorded_tokens = recorded["completion_tokens"] - r.json()["usage"]["completion_tokens"]
    assert recorded["requests"] == 3 and 0 < recorded_tokens and floor <= recorded_tokens <= delivered + 16, \
        (floor, recorded, delivered, admitted_after)

    doomed.join(15)
    assert not doomed.is_alive(), "the stream on the killed replica hangs"
    assert doomed.replica == victim and not doomed.done and doomed.ended_at - killed_at < 10
    survivor.join(30)
    assert survivor.error is None and survivor.done and len(survivor.arrivals) > 100

    for proxy, url in cluster.proxies.items():
        r = _complete(url, owners[proxy][victim], cluster.model)
        assert r.status_code == 200, (proxy, r.text)
        assert r.headers["x-loraplex-replica"] in others, proxy
        for name in others:
            assert cluster.replica_of(owners[proxy][name], proxy) == name, f"{proxy} moved a live replica's tenant"
        for key, replica in before[proxy].items():
            r = _complete(url, key, cluster.model)
            assert r.status_code == 200, (proxy, r.text)
            if replica != victim:
                assert r.headers["x-loraplex-replica"] == replica, f"{proxy} moved a live replica's tenant"
            else:
                assert r.headers["x-loraplex-replica"] in others
    assert cluster.process.poll() is None, "scripts/cluster stopped when one replica died"
    assert f"{victim} exited" in cluster.output.read_text()


def test_sigterm_drains_a_replica(cluster):
    """SIGTERM (what systemd and Kubernetes send) is a graceful stop: the replica takes no new
    connections, finishes its in-flight stream, and its tenants go on elsewhere."""
    live = sorted(name for name, rep in cluster.replicas.items() if _alive(rep["pid"]))
    assert len(live) >= 2, "needs two live replicas"
    owners = cluster.keys_on(len(live))
    leaving = live[0]
    stream = Stream(cluster.url, owners[leaving], cluster.model)
    stream.start()
    assert stream.started.wait(30) and stream.arrivals, stream.error
    os.kill(cluster.replicas[leaving]["pid"], signal.SIGTERM)
    stream.join(30)
    assert stream.replica == leaving and stream.error is None and stream.done
    r = _complete(cluster.url, owners[leaving], cluster.model)
    assert r.status_code == 200 and r.headers["x-loraplex-replica"] in set(live) - {leaving}


def _core(cfg: str) -> list[str]:
    """HAProxy directives minus comments, the resolvers section and the replica list: what the
    Kubernetes example must share with the config tested here."""
    out, skipping = [], False
    for line in cfg.splitlines():
        text = line.split("#", 1)[0].rstrip()
        if not text:
            continue
        if not text[0].isspace():
            skipping = text.startswith("resolvers ")
        if not skipping and not text.strip().startswith(("server ", "server-template ")):
            out.append(" ".join(text.split()))
    return out


def test_kubernetes_example_matches_the_tested_setup(tmp_path):
    import yaml

    docs = {(d["kind"], d["metadata"]["name"]): d for f in sorted(K8S.glob("*.yaml"))
            for d in yaml.safe_load_all(f.read_text()) if d and d.get("kind") != "Kustomization"}
    haproxy_cfg = docs[("ConfigMap", "loraplex-haproxy")]["data"]["haproxy.cfg"]
    assert _core(haproxy_cfg) == _core((ROOT / "deploy" / "haproxy" / "haproxy.cfg").read_text())
    replicas = docs[("Service", "loraplex-replicas")]["spec"]
    port = replicas["ports"][0]["port"]
    assert replicas["clusterIP"] == "None", "a ClusterIP Service would balance again, undoing the affinity"
    template = next(ln.split() for ln in haproxy_cfg.splitlines() if ln.strip().startswith("server-template"))
    assert template[3] == f"loraplex-replicas.loraplex.svc.cluster.local:{port}" and "resolvers" in template
    pod = docs[("Deployment", "loraplex")]["spec"]["template"]
    container = pod["spec"]["containers"][0]
    args = dict(zip(container["args"][1::2], container["args"][2::2]))
    assert container["args"][0] == "serve" and args["--port"] == str(port) and args["--host"] == "0.0.0.0"
    assert args["--replica-name"] == "$(POD_NAME)" and "--admin-token" not in args
    assert pod["metadata"]["labels"] == replicas["selector"]
    assert container["readinessProbe"]["httpGet"]["path"] == "/health"
    redis_service = docs[("Service", "redis")]["spec"]
    assert args["--redis-url"].endswith(f"@redis:{redis_service['ports'][0]['port']}/0")
    redis_set = docs[("StatefulSet", "redis")]["spec"]
    assert redis_set["volumeClaimTemplates"] and "--appendonly" in redis_set["template"]["spec"]["containers"][0]["args"]
    proxy = docs[("Deployment", "loraplex-haproxy")]["spec"]["template"]["spec"]
    bind = next(ln.split()[1] for ln in haproxy_cfg.splitlines() if ln.strip().startswith("bind"))
    assert bind == f":{proxy['containers'][0]['ports'][0]['containerPort']}"
    if _binary("haproxy"):
        (tmp_path / "haproxy.cfg").write_text(haproxy_cfg)
        check = subprocess.run([_binary("haproxy"), "-c", "-q", "-f", str(tmp_path / "haproxy.cfg")],
                               capture_output=True, text=True)
        assert check.returncode == 0, check.stdout + check.stderr
