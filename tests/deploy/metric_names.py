"""The series service/metrics.py defines, and a check that a PromQL expression (an alert rule, a dashboard panel)
uses only those series and their labels. Read with ast, so a renamed metric breaks the tests, not an alert or a
panel silently."""

from __future__ import annotations

import ast
import re

from deploy_helpers import REPO

TARGET_LABELS = {"job", "instance", "namespace", "pod"}  # added by the scrape, not by the service


def defined_metrics() -> dict[str, tuple[str, set[str]]]:
    """{series name: (type, labels)} from service/metrics.py, histogram and counter suffixes included."""
    tree = ast.parse((REPO / "service" / "metrics.py").read_text())
    out = {}
    for node in ast.walk(tree):
        if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)):
            continue
        kind = node.func.id
        if kind not in ("Counter", "Gauge", "Histogram", "Summary") or not node.args:
            continue
        name = ast.literal_eval(node.args[0])
        labels = set()
        if len(node.args) >= 3:
            labels = set(ast.literal_eval(node.args[2]))
        for kw in node.keywords:
            if kw.arg == "labelnames":
                labels = set(ast.literal_eval(kw.value))
        if kind == "Counter":
            base = name.removesuffix("_total")
            series = [base + "_total", base + "_created"]
        elif kind in ("Histogram", "Summary"):
            series = [name + s for s in ("_bucket", "_count", "_sum", "_created")]
            labels = labels | ({"le"} if kind == "Histogram" else {"quantile"})
        else:
            series = [name]
        for s in series:
            out[s] = (kind, labels)
    return out


METRICS = defined_metrics()


def series_in(expr: str) -> set[str]:
    return set(re.findall(r"\bskillcache_[a-z_]+\b", expr))


def expr_problems(expr: str) -> list[str]:
    """What in `expr` the service does not export: unknown series, or labels none of its series carry (selectors
    and by/on/without/ignoring groupings). Empty when every name and label is real."""
    names = series_in(expr)
    problems = [] if names else ["the expression uses no skillcache series"]
    allowed = set(TARGET_LABELS)
    for name in sorted(names):
        if name not in METRICS:
            problems.append(f"{name} is not defined in service/metrics.py")
        else:
            allowed |= METRICS[name][1]
    used = set()
    for selector in re.findall(r"\{([^}]*)\}", expr):
        used |= set(re.findall(r"([a-z_]+)\s*(?:=~|!~|!=|=)", selector))
    for group in re.findall(r"\b(?:by|on|without|ignoring)\s*\(([^)]*)\)", expr):
        used |= {label.strip() for label in group.split(",") if label.strip()}
    if used - allowed:
        problems.append(f"labels {sorted(used - allowed)} are not on {sorted(names)}")
    return problems
