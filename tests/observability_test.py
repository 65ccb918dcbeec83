"""deploy/ against the real thing: promtool checks, Debian's Prometheus scraping a live
relgen-server with deploy's scrape config (target rewritten to loopback), every dashboard and
alert expression returning data, the dashboard's provisioning format and metric names, and static
checks of the Dockerfile and the compose file (Docker cannot run on these machines).
Run by CTest with RELGEN_SERVER_BIN, RELGEN_BENCH_BIN, RELGEN_CLIENT_BIN and RELGEN_GOLDEN_DIR."""
import json
import os
import re
import shutil
import socket
import subprocess
import tempfile
import time
import unittest
import urllib.parse
import urllib.request

import yaml

SOURCE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEPLOY = os.path.join(SOURCE, "deploy")


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


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
        model = os.path.join(os.environ["RELGEN_GOLDEN_DIR"], "engine", "skew")
        cls.server = subprocess.Popen(
            [os.environ["RELGEN_SERVER_BIN"], "--model", model, "--listen", "127.0.0.1:0", "--metrics_listen",
             "127.0.0.1:0", "--kv_cache_tokens", "8192"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        for line in cls.server.stdout:
            m = re.search(r"gRPC on (127\.0\.0\.1:\d+).*metrics on (127\.0\.0\.1:\d+)", line)
            if m:
                cls.grpc, cls.metrics = m.group(1), m.group(2)
                break
        else:
            raise RuntimeError("relgen-server did not start")
        # deploy's scrape config with the target on loopback and a quick interval.
        cfg = yaml.safe_load(open(os.path.join(DEPLOY, "prometheus", "prometheus.yml")))
        cfg["global"]["scrape_interval"] = "1s"
        cfg["global"]["evaluation_interval"] = "1s"
        cfg["scrape_configs"][0]["static_configs"] = [{"targets": [cls.metrics]}]
        shutil.copy(os.path.join(DEPLOY, "prometheus", "alerts.yml"), cls.tmp)
        cls.config = os.path.join(cls.tmp, "prometheus.yml")
        yaml.safe_dump(cfg, open(cls.config, "w"))
        cls.prom_port = free_port()
        cls.prom = subprocess.Popen(
            ["prometheus", f"--config.file={cls.config}", f"--storage.tsdb.path={cls.tmp}/data",
             f"--web.listen-address=127.0.0.1:{cls.prom_port}"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        # Load: a serving run (streams) and a few refused requests, for every series to move.
        subprocess.run([os.environ["RELGEN_BENCH_BIN"], "serve", "--server", cls.grpc, "--concurrency", "4",
                        "--num_requests", "24", "--prompt_len", "24", "--output_len", "16"],
                       check=True, capture_output=True, timeout=300)
        for _ in range(3):
            subprocess.run([os.environ["RELGEN_CLIENT_BIN"], "generate", "--server", cls.grpc, "--top_p", "2",
                            "--prompt", "x"], capture_output=True, timeout=30)
        time.sleep(3)
        subprocess.run([os.environ["RELGEN_BENCH_BIN"], "serve", "--server", cls.grpc, "--concurrency", "2",
                        "--num_requests", "8", "--prompt_len", "24", "--output_len", "16"],
                       check=True, capture_output=True, timeout=300)
        time.sleep(4)

    @classmethod
    def tearDownClass(cls):
        for p in (cls.prom, cls.server):
            p.terminate()
            p.wait(timeout=30)
        shutil.rmtree(cls.tmp, ignore_errors=True)

    def query(self, expr):
        url = f"http://127.0.0.1:{self.prom_port}/api/v1/query?" + urllib.parse.urlencode({"query": expr})
        body = json.load(urllib.request.urlopen(url, timeout=10))
        self.assertEqual(body["status"], "success", expr)
        return body["data"]["result"]

    def test_promtool_checks(self):
        for args in (["check", "config", self.config], ["check", "rules", os.path.join(DEPLOY, "prometheus", "alerts.yml")]):
            r = subprocess.run(["promtool"] + args, capture_output=True, text=True)
            self.assertEqual(r.returncode, 0, r.stdout + r.stderr)

    def test_every_expression_returns_data(self):
        exprs = [e.replace("$__rate_interval", "1m").replace("$__range", "5m") for e in dashboard_exprs()]
        exprs += [without_threshold(r["expr"]) for r in alert_rules()]
        missing = [e for e in exprs if not self.query(e)]
        self.assertEqual(missing, [], "expressions without data")
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

    def test_operations_doc_lists_every_panel(self):
        doc = open(os.path.join(SOURCE, "docs", "operations.md")).read()
        for p in dashboard()["panels"]:
            self.assertIn(p["title"], doc)


class StaticDeployTest(unittest.TestCase):
    def test_dockerfile(self):
        text = open(os.path.join(SOURCE, "Dockerfile")).read()
        froms = re.findall(r"^FROM\s+(\S+)", text, re.M)
        self.assertGreaterEqual(len(froms), 2, "multi-stage")
        for image in froms:
            self.assertRegex(image, r":[0-9][\w.-]*$", f"pinned tag: {image}")
        users = re.findall(r"^USER\s+(\S+)", text, re.M)
        self.assertTrue(users and users[-1] not in ("root", "0"), "non-root user")
        self.assertRegex(text, r'HEALTHCHECK[^\n]*\\\n\s*CMD \["[^"]*relgen-client", "health"')
        self.assertRegex(text, r"(?m)^EXPOSE 50051 9400$")
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
