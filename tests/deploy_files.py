"""What the deploy tests share: the deploy folder, README's metric table, the metric names a
PromQL expression reads."""
from __future__ import annotations

import re

from pdserve.cluster.config import REPO

DEPLOY = REPO / "deploy"


def documented_metrics() -> set[str]:
    """The names in README's metric table ("## Metrics")."""
    readme = (REPO / "README.md").read_text()
    table = readme[readme.index("| metric |", readme.index("## Metrics\n")):]
    table = table[:table.index("\n\n")]
    return {n for row in table.splitlines()[2:] for n in re.findall(r"`([a-z0-9_:]+)", row.split(" | ")[0])}


def referenced_metrics(expr: str) -> set[str]:
    """pdserve and process metric names a PromQL expression reads (a histogram's series as its name)."""
    names = set(re.findall(r"\b(pdserve:[a-z0-9_]+|process_[a-z_]+)", expr))
    return {n if n.endswith("_total") else re.sub(r"_(bucket|sum|count)$", "", n) for n in names}
