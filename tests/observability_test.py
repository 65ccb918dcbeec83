"""deploy/ against the real thing: promtool checks, Debian's Prometheus scraping a live
relgen-server with deploy's scrape config (target rewritten to loopback), every dashboard and
alert expression returning data, the dashboard's provisioning format and metric names, and static
checks of the Dockerfile and the compose file (Docker cannot run on these machines).
Run by CTest with RELGEN_SERVER_BIN, RELGEN_BENCH_BIN, RELGEN_CLIENT_BIN and RELGEN_GOLDEN_DIR."""
import json
import os
import re
import shutil
import subprocess
import tempfile
import threading
import time
import unittest
import urllib.error
import urllib.parse
import urllib.request

import yaml

SOURCE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEPLOY = os.path.join(SOURCE, "deploy")


def start_server(tmp):
    """A relgen-server on loopback ports of its own choosing; returns (process, grpc, metrics)."""
    model = os.path.join(os.environ["RELGEN_GOLDEN_DIR"], "engine", "skew")
    server = subprocess.Popen(
        [os.environ["RELGEN_SERVER_BIN"], "--model", model, "--listen", "127.0.0.1:0", "--metrics_listen",
         "127.0.0.1:0", "--http_listen", "127.0.0.1:0", "--kv_cache_tokens", "8192"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    for line in server.stdout:
        m = re.search(r"gRPC on (127\.0\.0\.1:\d+).*metrics on (127\.0\.0\.1:\d+)", line)
        if m:
            return server, m.group(1), m.group(2)
    raise RuntimeError("relgen-server did not start")


def start_prometheus(tmp, target):
    """Debian's Prometheus with deploy's config (target rewritten to loopback, 1 s intervals) on a
    port of its own choosing; returns (process, port)."""
    cfg = yaml.safe_load(open(os.path.join(DEPLOY, "prometheus", "prometheus.yml")))
    cfg["global"]["scrape_interval"] = "1s"
    cfg["global"]["evaluation_interval"] = "1s"
    cfg["scrape_configs"][0]["static_configs"] = [{"targets": [target]}]
    shutil.copy(os.path.join(DEPLOY, "prometheus", "alerts.yml"), tmp)
    config = os.path.join(tmp, "prometheus.yml")
    yaml.safe_dump(cfg, open(config, "w"))
    prom = subprocess.Popen(
        ["prometheus", f"--config.file={config}", f"--storage.tsdb.path={tmp}/data", "--web.listen-address=127.0.0.1:0"],
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    for line in prom.stderr:
        m = re.search(r'msg="Listening on" address=127\.0\.0\.1:(\d+)', line)
        if m:
            # Keep reading its log so it never blocks on a full pipe.
            threading.Thread(target=lambda: [None for _ in prom.stderr], daemon=True).start()
            return prom, config, int(m.group(1))
    raise RuntimeError("prometheus did not start")


def query(port, expr):
    url = f"http://127.0.0.1:{port}/api/v1/query?" + urllib.parse.urlencode({"query": expr})
    body = json.load(urllib.request.urlopen(url, timeout=10))
    if body["status"] != "success":
        raise RuntimeError(f"{expr}: {body}")
    return body["data"]["result"]


def all_exprs():
    exprs = [e.replace("$__rate_interval", "1m").replace("$__range", "5m") for e in dashboard_exprs()]
    return exprs + [without_threshold(r["expr"]) for r in alert_rules()]


def wait_for_data(port, exprs, give_up_s=120):
    """Polls until every expression returns data; returns those that still have none at the bound
    (a bound for failing runs only: a passing run leaves as soon as all have data)."""
    missing = exprs
    deadline = time.monotonic() + give_up_s
    while missing and time.monotonic() < deadline:
        try:
            missing = [e for e in exprs if not query(port, e)]
        except urllib.error.URLError:  # Prometheus answers 503 until its storage is ready
            pass
        if missing:
            time.sleep(0.5)
    return missing


def dashboard():
    return json.load(open(os.path.join(DEPLOY, "grafana", "dashboards", "relgen.json")))


def dashboard_exprs():
    return [t["expr"] for p in dashboard()["panels"] if p["type"] != "row" for t in p["targets"]]


def alert_rules():
    return [r for g in yaml.safe_load(open(os.path.join(DEPLOY, "prometheus", "alerts.yml")))["groups"] for r in g["rules"]]


def without_threshold(expr):
    """An alert's expression without its final comparison, so that it returns data when calm."""
    m = re.match(r"^(.*\S)\s*(>|<|==|>=|<=|!=)\s*[0-9.e+-]+\s*$", expr, re.S)
    return m.group(1) if m else expr


class ObservabilityTest(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.tmp = tempfile.mkdtemp(prefix="relgen-obs-")
        cls.server, cls.grpc, cls.metrics = start_server(cls.tmp)
        cls.prom, cls.config, cls.prom_port = start_prometheus(cls.tmp, cls.metrics)
        # Load: a serving run (streams) and a few refused requests, for every series to move; the
        # second run starts once Prometheus has seen the first, so rates see two levels.
        subprocess.run([os.environ["RELGEN_BENCH_BIN"], "serve", "--server", cls.grpc, "--concurrency", "4",
                        "--num_requests", "24", "--prompt_len", "24", "--output_len", "16"],
                       check=True, capture_output=True, timeout=300)
        for _ in range(3):
            subprocess.run([os.environ["RELGEN_CLIENT_BIN"], "generate", "--server", cls.grpc, "--top_p", "2",
                            "--prompt", "x"], capture_output=True, timeout=30)
        missing = wait_for_data(cls.prom_port, ['relgen_requests_total{finish_reason="length"} >= 24',
                                                'relgen_request_errors_total{code="INVALID_ARGUMENT"} >= 3'])
        if missing:
            raise AssertionError(f"Prometheus never saw the first run's traffic: {missing}")
        subprocess.run([os.environ["RELGEN_BENCH_BIN"], "serve", "--server", cls.grpc, "--concurrency", "2",
                        "--num_requests", "8", "--prompt_len", "24", "--output_len", "16"],
                       check=True, capture_output=True, timeout=300)

    @classmethod
    def tearDownClass(cls):
        for p in (cls.prom, cls.server):
            p.terminate()
            p.wait(timeout=30)
        shutil.rmtree(cls.tmp, ignore_errors=True)

    def query(self, expr):
        return query(self.prom_port, expr)

    def test_promtool_checks(self):
        for args in (["check", "config", self.config], ["check", "rules", os.path.join(DEPLOY, "prometheus", "alerts.yml")]):
            r = subprocess.run(["promtool"] + args, capture_output=True, text=True)
            self.assertEqual(r.returncode, 0, r.stdout + r.stderr)

    def test_series_moved_by_the_traffic(self):
        # The two serving runs: 32 requests of 12..36 prompt and 8..24 output tokens (the bench's
        # lengths at its default spread of 0.5), each finishing by length; 3 refused requests.
        # Idle, every one of these is 0 or absent, so this fails on a server that counted nothing.
        n = 24 + 8
        self.assertEqual(wait_for_data(self.prom_port, [
            f'relgen_requests_total{{finish_reason="length"}} >= {n}',
            'relgen_request_errors_total{code="INVALID_ARGUMENT"} >= 3',
            f"relgen_prompt_tokens_total >= {n * 12}",
            f"relgen_generation_tokens_total >= {n * 8}",
            f"sum(relgen_time_to_first_token_seconds_count) >= {n}",
            f"sum(relgen_e2e_request_latency_seconds_count) >= {n}",
            f"sum(relgen_time_per_output_token_seconds_count) >= {n * 7}",
            f"sum(relgen_request_generation_tokens_count) >= {n}",
            f"sum(relgen_request_generation_tokens_sum) >= {n * 8}",
            "sum(relgen_time_to_first_token_seconds_sum) > 0",
        ]), [], "series that did not move by what the traffic implies")

    def test_every_expression_returns_data(self):
        self.assertEqual(wait_for_data(self.prom_port, all_exprs()), [], "expressions without data")
        self.assertEqual(float(self.query('up{job="relgen"}')[0]["value"][1]), 1.0)

    def test_dashboard_provisioning_and_metric_names(self):
        d = dashboard()
        self.assertEqual(d["uid"], "relgen-overview")
        ds = yaml.safe_load(open(os.path.join(DEPLOY, "grafana", "provisioning", "datasources", "prometheus.yml")))
        uid = ds["datasources"][0]["uid"]
        prov = yaml.safe_load(open(os.path.join(DEPLOY, "grafana", "provisioning", "dashboards", "relgen.yml")))
        self.assertEqual(prov["apiVersion"], 1)
        self.assertEqual(prov["providers"][0]["type"], "file")
        exported = set()
        body = urllib.request.urlopen(f"http://{self.metrics}/metrics", timeout=10).read().decode()
        for line in body.splitlines():
            if line.startswith("# TYPE "):
                name, kind = line.split()[2:4]
                exported |= {name + s for s in ("_bucket", "_sum", "_count")} if kind == "histogram" else {name}
        ids = set()
        for p in d["panels"]:
            self.assertNotIn(p["id"], ids)
            ids.add(p["id"])
            if p["type"] == "row":
                continue
            self.assertEqual(p["datasource"]["uid"], uid, p["title"])
            self.assertTrue(p["targets"], p["title"])
            for t in p["targets"]:
                self.assertEqual(t["datasource"]["uid"], uid)
                for name in re.findall(r"\b((?:relgen|process)_[a-z0-9_]+)", t["expr"]):
                    self.assertIn(name, exported, f"{p['title']}: {name}")

    def test_prefix_cache_counters_and_hit_ratio(self):
        """Two requests with the same long prompt: the second finds the first's blocks in the prefix
        cache; the counters are scraped and the dashboard's hit ratio over them is in (0, 1]."""
        self.assertEqual(wait_for_data(self.prom_port, ["relgen_prefix_cache_hits_total",
                                                        "relgen_prefix_cache_queries_total",
                                                        'relgen_kv_cache_blocks{state="cached"}']), [])
        before = float(self.query("relgen_prefix_cache_hits_total")[0]["value"][1])
        prompt = "A prompt long enough to fill several blocks of the KV cache, sent twice. " * 3  # 220 bytes
        for _ in range(2):
            subprocess.run([os.environ["RELGEN_CLIENT_BIN"], "generate", "--server", self.grpc, "--max_new_tokens", "2",
                            "--temperature", "0", "--prompt", prompt], check=True, capture_output=True, timeout=30)
        self.assertEqual(wait_for_data(self.prom_port, [f"relgen_prefix_cache_hits_total > {before}"]), [])
        [ratio] = [t["expr"] for p in dashboard()["panels"] if p["title"] == "Prefix cache hit ratio" for t in p["targets"]]
        ratio = ratio.replace("$__rate_interval", "5m")  # wide enough to hold the hits whenever this runs
        self.assertEqual(wait_for_data(self.prom_port, [ratio + " > 0"]), [], ratio)
        value = float(self.query(ratio)[0]["value"][1])
        self.assertGreater(value, 0.0)
        self.assertLessEqual(value, 1.0)

    def test_operations_doc_lists_every_panel(self):
        doc = open(os.path.join(SOURCE, "docs", "operations.md")).read()
        for p in dashboard()["panels"]:
            self.assertIn(p["title"], doc)


class IdleServerTest(unittest.TestCase):
    """A freshly started server that has served nothing: every panel and alert still has data (0s,
    not "No data"), since every known label value of every counter exists from start-up."""

    def test_every_expression_returns_data_when_idle(self):
        tmp = tempfile.mkdtemp(prefix="relgen-obs-idle-")
        server, _, metrics = start_server(tmp)
        prom, _, port = start_prometheus(tmp, metrics)
        try:
            self.assertEqual(wait_for_data(port, all_exprs()), [], "expressions without data on an idle server")
            errors = query(port, "relgen_request_errors_total")
            self.assertEqual({(r["metric"]["api"], r["metric"]["code"]): r["value"][1] for r in errors},
                             {(api, c): "0" for api in ("grpc", "http")
                              for c in ("CANCELLED", "INVALID_ARGUMENT", "DEADLINE_EXCEEDED", "RESOURCE_EXHAUSTED",
                                        "INTERNAL", "UNAVAILABLE", "UNAUTHENTICATED", "NOT_FOUND")})
            self.assertEqual(float(query(port, "sum(relgen_requests_received_total)")[0]["value"][1]), 0.0)
        finally:
            for p in (prom, server):
                p.terminate()
                p.wait(timeout=30)
            shutil.rmtree(tmp, ignore_errors=True)


class StaticDeployTest(unittest.TestCase):
    def test_dockerfile(self):
        text = open(os.path.join(SOURCE, "Dockerfile")).read()
        # Base images are build arguments: check the defaults (ARG lines before the first FROM).
        head = text[: re.search(r"^FROM", text, re.M).start()]
        defaults = dict(re.findall(r"^ARG\s+(\w+)=(\S+)", head, re.M))
        froms = [re.sub(r"\$\{?(\w+)\}?", lambda m: defaults.get(m.group(1), m.group(0)), image)
                 for image in re.findall(r"^FROM\s+(\S+)", text, re.M)]
        self.assertGreaterEqual(len(froms), 2, "multi-stage")
        for image in froms:
            self.assertRegex(image, r":[0-9][\w.-]*$", f"pinned tag: {image}")
        users = re.findall(r"^USER\s+(\S+)", text, re.M)
        self.assertTrue(users and users[-1] not in ("root", "0"), "non-root user")
        self.assertRegex(text, r'HEALTHCHECK[^\n]*\\\n\s*CMD \["[^"]*relgen-client", "health"')
        self.assertRegex(text, r"(?m)^EXPOSE 50051 8000 9400$")
        self.assertIn("--device\", \"auto", text)
        self.assertIn("COPY models/default", text)

    def test_compose(self):
        c = yaml.safe_load(open(os.path.join(DEPLOY, "docker-compose.yml")))
        services = c["services"]
        self.assertEqual(set(services), {"relgen", "relgen-cpu", "prometheus", "grafana"})
        gpu = services["relgen"]["deploy"]["resources"]["reservations"]["devices"][0]
        self.assertEqual(gpu["capabilities"], ["gpu"])
        self.assertEqual(services["relgen-cpu"]["profiles"], ["cpu"])
        for name in ("prometheus", "grafana"):
            self.assertRegex(services[name]["image"], r":v?[0-9][\w.]*$", name)
        for name, svc in services.items():
            for vol in svc.get("volumes", []):
                src = vol.split(":")[0]
                if src.startswith("."):
                    self.assertTrue(os.path.exists(os.path.join(DEPLOY, src)), f"{name}: {src}")
        self.assertIn("models", c["volumes"])

    def test_k8s(self):
        docs = list(yaml.safe_load_all(open(os.path.join(DEPLOY, "k8s", "relgen.yaml"))))
        kinds = {d["kind"]: d for d in docs}
        self.assertEqual(set(kinds), {"Deployment", "Service", "HorizontalPodAutoscaler"})
        pod = kinds["Deployment"]["spec"]["template"]
        c = pod["spec"]["containers"][0]
        self.assertIn("nvidia.com/gpu", c["resources"]["limits"])
        for probe, path in (("startupProbe", "/readyz"), ("readinessProbe", "/readyz"), ("livenessProbe", "/healthz")):
            self.assertEqual(c[probe]["httpGet"], {"path": path, "port": 9400})
        self.assertEqual(pod["metadata"]["annotations"]["prometheus.io/port"], "9400")
        self.assertEqual(kinds["Service"]["spec"]["clusterIP"], "None")


if __name__ == "__main__":
    unittest.main(verbosity=2)
