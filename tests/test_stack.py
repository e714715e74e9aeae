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


@pytest.mark.unit
def test_rules_and_dashboard_ask_only_for_metrics_the_trainer_exports(tmp_path):
    from training.config.run import RunIdentity
    from training.monitor import Metrics

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
