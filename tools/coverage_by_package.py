"""Line coverage per package, from the data `make test` left (pytest-cov, xdist workers combined).

Prints one table (package, statements, missed, cover), writes the HTML report and a JSON summary
under build/coverage/ (ignored by git), and exits 1 when the total falls below
`[tool.coverage.report] fail_under` in pyproject.toml: the figure measured when it was last raised.
"""

from __future__ import annotations

import json
import sys
from collections import defaultdict
from pathlib import Path

import coverage

ROOT = Path(__file__).resolve().parent.parent
OUT = ROOT / "build" / "coverage"


def main() -> int:
    cov = coverage.Coverage(config_file=str(ROOT / "pyproject.toml"))
    cov.load()
    per_package: dict[str, list[int]] = defaultdict(lambda: [0, 0])  # statements, missed
    for path in cov.get_data().measured_files():
        rel = Path(path).resolve().relative_to(ROOT)
        _, statements, _, missing, _ = cov.analysis2(path)
        package = rel.parts[0] if len(rel.parts) > 1 else "(top)"
        per_package[package][0] += len(statements)
        per_package[package][1] += len(missing)
    total_statements = sum(s for s, _ in per_package.values())
    total_missed = sum(m for _, m in per_package.values())
    total = 100.0 * (total_statements - total_missed) / max(total_statements, 1)

    print(f"\n{'package':<16}{'statements':>12}{'missed':>9}{'cover':>8}")
    rows = {}
    for package, (statements, missed) in sorted(per_package.items()):
        pct = 100.0 * (statements - missed) / max(statements, 1)
        rows[package] = {"statements": statements, "missed": missed, "percent": round(pct, 2)}
        print(f"{package:<16}{statements:>12}{missed:>9}{pct:>7.1f}%")
    print(f"{'TOTAL':<16}{total_statements:>12}{total_missed:>9}{total:>7.1f}%")

    OUT.mkdir(parents=True, exist_ok=True)
    cov.html_report(directory=str(OUT / "html"))
    summary = {"total_percent": round(total, 2), "packages": rows}
    (OUT / "by_package.json").write_text(json.dumps(summary, indent=2) + "\n")
    print(f"report: {OUT / 'html' / 'index.html'}")

    floor = float(cov.get_option("report:fail_under"))
    if total < floor:
        print(f"coverage {total:.2f}% is below fail_under = {floor} (pyproject.toml)", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
