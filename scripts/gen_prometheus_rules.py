"""Write deploy/prometheus/rules.yaml: the alert rules of deploy/kubernetes/alerts.yaml
as a plain Prometheus rules file, for Prometheus without the Operator and for
``promtool check rules`` (which does not read a PrometheusRule object).

    python scripts/gen_prometheus_rules.py          # rewrite deploy/prometheus/rules.yaml
    python scripts/gen_prometheus_rules.py --check  # exit 1 when it is stale

alerts.yaml is the one to edit; a test fails while the committed file differs.
"""

from __future__ import annotations

import sys
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parent.parent
SOURCE = ROOT / "deploy" / "kubernetes" / "alerts.yaml"
TARGET = ROOT / "deploy" / "prometheus" / "rules.yaml"
HEADER = """\
# Generated from deploy/kubernetes/alerts.yaml (the PrometheusRule's spec.groups) by
# scripts/gen_prometheus_rules.py: edit that file, then run the script. Load this one
# with `rule_files:` in prometheus.yml; check it with `promtool check rules`.
"""


def render() -> str:
    groups = yaml.safe_load(SOURCE.read_text())["spec"]["groups"]
    body = yaml.safe_dump({"groups": groups}, sort_keys=False, width=1000, allow_unicode=True)
    return HEADER + body


def main() -> int:
    made = render()
    if "--check" in sys.argv[1:]:
        if not TARGET.exists() or TARGET.read_text() != made:
            print(f"{TARGET.relative_to(ROOT)} is stale: run {Path(__file__).name}")
            return 1
        return 0
    TARGET.parent.mkdir(parents=True, exist_ok=True)
    TARGET.write_text(made)
    return 0


if __name__ == "__main__":
    sys.exit(main())
