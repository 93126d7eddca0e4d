"""Benchmark results: one `Section` per measurement, printed as rich tables, saved as JSON,
a markdown table (for the README) and PNG plots.
"""

from __future__ import annotations

import json
import math
import textwrap
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable


@dataclass
class Target:
    """A stated goal: ``value <op> threshold`` (op is "<=", ">=" or "=="), measured in this run."""

    name: str
    value: float
    threshold: float
    op: str
    detail: str = ""

    @property
    def met(self) -> bool:
        if self.op == ">=":
            return self.value >= self.threshold
        if self.op == "<=":
            return self.value <= self.threshold
        return math.isclose(self.value, self.threshold, rel_tol=1e-9)

    def as_dict(self) -> dict[str, Any]:
        return {**asdict(self), "met": self.met}


@dataclass
class Section:
    """One benchmark's outcome: display table, raw data, targets and notes."""

    name: str
    title: str
    columns: list[str]
    rows: list[list[Any]] = field(default_factory=list)
    data: dict[str, Any] = field(default_factory=dict)
    targets: list[Target] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    plot: Callable[[Any, "Section"], None] | None = None

    def as_dict(self) -> dict[str, Any]:
        return {"name": self.name, "title": self.title, "columns": self.columns, "rows": self.rows,
                "data": self.data, "targets": [t.as_dict() for t in self.targets], "notes": self.notes}


def fmt(v: Any) -> str:
    """A compact display string: 3 significant digits for floats, thousands separators for ints,
    "n/a" for None (a measure an engine did not run)."""
    if v is None:
        return "n/a"
    if isinstance(v, bool):
        return "yes" if v else "no"
    if isinstance(v, int):
        return f"{v:,}"
    if isinstance(v, float):
        if math.isnan(v):
            return "n/a"
        if v != 0 and (abs(v) >= 1e5 or abs(v) < 1e-2):
            return f"{v:.3g}"
        return f"{v:,.3g}" if abs(v) < 100 else f"{v:,.0f}"
    return str(v)


def print_sections(sections: list[Section], header: dict[str, Any]) -> None:
    """Print every section as a rich table, followed by its targets and notes."""
    from rich.console import Console
    from rich.markup import escape
    from rich.table import Table

    console = Console(width=None if Console().is_terminal else 130)
    console.print(f"[bold]kvshare bench[/bold]  {json.dumps(header, default=str)}")
    for s in sections:
        table = Table(title=s.title, title_justify="left")
        if "elapsed_s" in s.data:
            table.caption = f"{s.data['elapsed_s']} s"
        for c in s.columns:
            table.add_column(c, justify="right" if c not in ("engine", "mode", "quantity", "throughput") else "left")
        for r in s.rows:
            table.add_row(*[fmt(v) for v in r])
        console.print(table)
        for t in s.targets:
            mark = "[green]MET[/green]" if t.met else "[red]MISSED[/red]"
            console.print(f"  target {t.name}: {fmt(t.value)} {t.op} {fmt(t.threshold)}  {mark}  {t.detail}")
        for n in s.notes:
            console.print(f"  [dim]{escape(n)}[/dim]")


def markdown(sections: list[Section], header: dict[str, Any] | None = None,
             plots: dict[str, str] | None = None) -> str:
    """README-ready markdown: run facts, one table (and plot) per section, then a targets table."""
    out: list[str] = []
    if header:
        lb, la = header.get("load_before", {}), header.get("load_after", {})
        out.append(f"Command `{header.get('command') or 'kvshare bench ' + str(header.get('which'))}`, "
                   f"{header.get('date_utc')}, {header.get('elapsed_s')} s; torch {header.get('torch')}, "
                   f"transformers {header.get('transformers')}, {header.get('device')} {header.get('dtype')}, "
                   f"{header.get('threads')} torch thread(s) on {lb.get('cpu_count')} cores; load average "
                   f"{lb.get('loadavg_1m')} before, {la.get('loadavg_1m')} after.\n")
    for s in sections:
        out.append(f"**{s.title}**\n")
        out.append("| " + " | ".join(s.columns) + " |")
        out.append("|" + "|".join("---" for _ in s.columns) + "|")
        for r in s.rows:
            out.append("| " + " | ".join(fmt(v) for v in r) + " |")
        out.append("")
        out.extend(f"- {n}" for n in s.notes)
        if s.notes:
            out.append("")
        if plots and s.name in plots:
            out.append(f"![{s.name}]({plots[s.name]})\n")
    targets = [t for s in sections for t in s.targets]
    if targets:
        out.append("| target | measured | goal | met |")
        out.append("|---|---|---|---|")
        for t in targets:
            out.append(f"| {t.name} | {fmt(t.value)} | {t.op} {fmt(t.threshold)} | {'yes' if t.met else 'no'} |")
        out.append("")
    return "\n".join(out)


def save(sections: list[Section], header: dict[str, Any], out_dir: Path, stem: str) -> dict[str, Path]:
    """Write `<stem>.json`, `<stem>.md` and one `<stem>-<section>.png` per plotted section."""
    out_dir.mkdir(parents=True, exist_ok=True)
    paths: dict[str, Path] = {}
    js = out_dir / f"{stem}.json"
    js.write_text(json.dumps({"header": header, "sections": [s.as_dict() for s in sections]},
                             indent=2, default=_json_default) + "\n")
    paths["json"] = js
    plotted = [s for s in sections if s.plot is not None]
    if plotted:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        for s in plotted:
            fig, ax = plt.subplots(figsize=(6.4, 4.0))
            s.plot(ax, s)  # type: ignore[misc]
            ax.set_title("\n".join(textwrap.wrap(s.title, 75)), fontsize=9)
            ax.margins(y=0.15)
            fig.tight_layout()
            png = out_dir / f"{stem}-{s.name}.png"
            fig.savefig(png, dpi=110)
            plt.close(fig)
            paths[s.name] = png
    md = out_dir / f"{stem}.md"
    md.write_text(markdown(sections, header, {s.name: f"{stem}-{s.name}.png" for s in plotted}) + "\n")
    paths["markdown"] = md
    return paths


def _json_default(o: Any) -> Any:
    if isinstance(o, Path):
        return str(o)
    if isinstance(o, float) and math.isnan(o):
        return None
    if hasattr(o, "as_dict"):
        return o.as_dict()
    return str(o)
