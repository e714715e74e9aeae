"""The production stack's files, read as data: the compose file's services and mounts, and that every
metric the alert rules and the Grafana dashboard ask for is one the trainer exports."""

from __future__ import annotations

import json
import re

import pytest
import yaml
from helpers import ROOT, free_port

DOCKER = ROOT / "docker"


@pytest.mark.unit
def test_the_compose_stack_has_every_service_and_its_files():
    compose = yaml.safe_load((DOCKER / "compose.yaml").read_text())
    services = compose["services"]
    assert {"postgres", "minio", "api-server", "scheduler", "dag-processor", "triggerer", "prometheus",
            "grafana"} <= set(services)
    for name, svc in services.items():
        for mount in svc.get("volumes", []):
            source = mount.split(":", 1)[0]
            if source.startswith("."):
                assert (DOCKER / source).exists(), f"{name}: {source}"
    assert "postgresql" in services["scheduler"]["environment"]["AIRFLOW__DATABASE__SQL_ALCHEMY_CONN"]
    prom = yaml.safe_load((DOCKER / "prometheus" / "prometheus.yml").read_text())
    assert prom["rule_files"] == ["/etc/prometheus/ballast-rules.yml"]
    assert prom["scrape_configs"][0]["file_sd_configs"][0]["files"] == ["/var/lib/ballast/prometheus/targets/*.json"]


_VAR = re.compile(r"\$\{(\w+)(?::([-?])([^}]*))?\}")
SECRET = re.compile(r"PASSWORD|SECRET|_KEY|SQL_ALCHEMY_CONN")


def _interpolate(value: str, env: dict[str, str]) -> str:
    """Compose's interpolation of `${X}`, `${X:-default}` and `${X:?message}` (unset or empty: the error)."""
    def one(m: re.Match) -> str:
        name, op, arg = m.groups()
        if env.get(name):
            return env[name]
        if op == "?":
            raise KeyError(f"{name}: {arg}")
        return arg if op == "-" else ""

    return _VAR.sub(one, value)


@pytest.mark.unit
def test_the_compose_stack_binds_loopback_and_takes_every_secret_from_env():
    """Issue 21, item 12: every port was published on all interfaces, with fixed secrets in the file."""
    text = (DOCKER / "compose.yaml").read_text()
    compose = yaml.safe_load(text)
    example = dict(line.split("=", 1) for line in (DOCKER / ".env.example").read_text().splitlines()
                   if line and not line.startswith("#"))
    for name, svc in compose["services"].items():
        for mapping in svc.get("ports", []):
            host = _interpolate(mapping, {}).split(":")
            assert len(host) == 3 and host[0] == "127.0.0.1", f"{name}: {mapping} is published beyond loopback"
            assert _interpolate(mapping, {"BALLAST_BIND_ADDRESS": "10.0.0.5"}).startswith("10.0.0.5:")
        env = svc.get("environment", {})
        for var, value in (env.items() if isinstance(env, dict) else []):
            if SECRET.search(var):
                assert "${" in str(value), f"{name}: {var} is a literal in compose.yaml; take it from docker/.env"
                with pytest.raises(KeyError, match=r"set \w+ in docker/\.env"):
                    _interpolate(str(value), {})  # unset: compose stops, naming it
    required = set(re.findall(r"\$\{(\w+):\?", text))
    assert {"POSTGRES_PASSWORD", "AIRFLOW_FERNET_KEY", "AIRFLOW_JWT_SECRET", "MINIO_ROOT_PASSWORD",
            "GRAFANA_ADMIN_PASSWORD"} <= required <= set(example), sorted(required - set(example))
    assert all(example[v] == "" for v in required if SECRET.search(v)), "no secret value ships in .env.example"
    for old in ("ballast-secret", "change-me-for-anything-shared", "airflow:airflow@"):
        assert old not in text
    filled = {v: "x" * 12 for v in required}
    assert "x" * 12 + "@postgres" in _interpolate(compose["services"]["scheduler"]["environment"][
        "AIRFLOW__DATABASE__SQL_ALCHEMY_CONN"], filled)
    assert ".env" in (DOCKER / ".gitignore").read_text().split()
    assert "local use only" in text.lower() and "SIMPLE_AUTH_MANAGER_ALL_ADMINS" in text


@pytest.mark.unit
def test_rules_and_dashboard_ask_only_for_metrics_the_trainer_exports(tmp_path):
    from ballast.training.config.run import RunIdentity
    from ballast.training.monitor import Metrics

    metrics = Metrics(out_dir=tmp_path, rank=0, port=free_port(), identity=RunIdentity(pipeline="p"))
    exported = set()
    for family in metrics.registry.collect():
        exported |= {family.name, f"{family.name}_total"}
    rules = (DOCKER / "prometheus" / "ballast-rules.yml").read_text()
    dashboard = json.loads((DOCKER / "grafana" / "dashboards" / "ballast-training.json").read_text())
    exprs = " ".join(t["expr"] for p in dashboard["panels"] for t in p["targets"])
    for source, text in (("rules", rules), ("dashboard", exprs)):
        asked = set(re.findall(r"ballast_train_\w+", text))
        assert asked and asked <= exported, f"{source}: {sorted(asked - exported)}"
    labels = set(re.findall(r"by \(([^)]*)\)", rules + exprs))
    for group in labels:
        assert {x.strip() for x in group.split(",")} <= {"pipeline", "run", "try", "node", "rank", "kind",
                                                         "failure_class", "phase"}, group
