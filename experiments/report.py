"""docs/results.md from the experiments' results files: the headline tables, each with its command, machine and date.

    python -m experiments.report                          # reads results/, writes docs/results.md
    python -m experiments.report --results results/ other/ --out docs/results.md

Every ``results.json`` under the given folders is read (the experiments write
``<folder>/<experiment>/results.json``; a ``--full`` run is told to write
under a folder of its own) and sorted by what it holds -- its experiment,
size, codec and entry size -- not by where it lies. Each table takes the most
recent file that holds it and says that file's command, machine and date
(when the file has no date: the commit date of the file, else its
modification time, and the table says which). A table that none of the files
holds keeps the section ``docs/results.md`` already has, word for word, so a
quick run never erases the record of a full one.

Plots: the few the docs show are copied from beside the chosen results file
into ``docs/img/`` (the rest stay with the results, which are not committed).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import re
import shutil
import subprocess
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

if __package__ in (None, ""):  # run as a file: make the repository root importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import buddy

__all__ = ["Results", "load", "render", "main"]

ROOT = Path(__file__).resolve().parents[1]


@dataclass
class Results:
    """One results file: its contents, where it is, and when it was finished."""

    path: Path
    doc: dict
    date: str  # "YYYY-MM-DD HH:MM TZ"
    date_source: str  # "" when the file says it; else how it was found

    @property
    def experiment(self) -> str:
        return self.doc.get("experiment") or self.path.parent.name

    @property
    def size(self) -> str | None:
        return self.doc.get("size") or self.doc.get("settings", {}).get("size")

    @property
    def command(self) -> str:
        return self.doc.get("command", "(not recorded)")

    def rows(self) -> list[dict]:
        rows = self.doc.get("rows")
        return rows if isinstance(rows, list) else []

    def codec(self) -> tuple[str | None, int | None]:
        """The codec and entry size of a capacity file's rows, or of an over_training file's settings."""
        rows, settings = self.rows(), self.doc.get("settings", {})
        if rows and "codec" in rows[0]:
            return rows[0]["codec"], rows[0].get("entry_bytes")
        return settings.get("codec"), settings.get("entry_bytes")

    def machine(self) -> str:
        env = self.doc.get("environment", {})
        cpu = env.get("cpu") or "unknown CPU"
        cores = f", {env['cpu_count']} cores" if env.get("cpu_count") else ""
        gpu = f"GPU {env['gpu']}" if env.get("gpu") else "no GPU"
        return f"{cpu}{cores}, {gpu}, torch {env.get('torch', '?')}"

    def wall(self) -> str:
        try:
            start, end = (_parse(self.doc[k]) for k in ("started", "finished"))
        except (KeyError, ValueError):
            return ""
        seconds = round((end - start).total_seconds())
        return f"{seconds // 60} min {seconds % 60} s" if seconds >= 60 else f"{seconds} s"

    def source(self) -> str:
        """One line: the command, the machine, the date (and how long the run took)."""
        date = self.date + (f" ({self.date_source})" if self.date_source else "")
        wall = f", {self.wall()} wall time" if self.wall() else ""
        load = self.doc.get("load_average")
        wall += f" (load average {load} at the start)" if isinstance(load, (int, float)) else ""
        return f"`{self.command}` — {self.machine()}; {date}{wall}"


def _parse(stamp: str) -> datetime.datetime:
    """A results file's time stamp (``2026-11-24 06:46:10 UTC``: local time and its zone's name), zone left out."""
    return datetime.datetime.strptime(stamp[:19], "%Y-%m-%d %H:%M:%S")


def _date(doc: dict, path: Path) -> tuple[str, str]:
    """``(date, how it was found)``: the file's ``finished`` (or ``started``), else git's commit date, else mtime."""
    for key in ("finished", "started"):
        if doc.get(key):
            return re.sub(r"(\d\d:\d\d):\d\d", r"\1", doc[key]), ""  # to the minute, the time zone kept
    try:
        out = subprocess.run(
            ["git", "log", "-1", "--format=%cd", "--date=format-local:%Y-%m-%d %H:%M UTC", "--", path.name],
            cwd=path.parent,
            capture_output=True,
            text=True,
            env={**os.environ, "TZ": "UTC"},
        ).stdout.strip()
    except OSError:
        out = ""
    if out:
        return out, "not in the file: the commit date of the file"
    mtime = datetime.datetime.fromtimestamp(path.stat().st_mtime, datetime.timezone.utc)
    return mtime.strftime("%Y-%m-%d %H:%M UTC"), "not in the file: the file's modification time"


def load(folders: Sequence[Path]) -> list[Results]:
    """Every ``results.json`` under ``folders`` (those that exist), oldest first."""
    found = []
    for folder in folders:
        for path in sorted(Path(folder).rglob("results.json")):
            try:
                doc = json.loads(path.read_text())
            except (OSError, ValueError) as exc:
                print(f"  skipped {path}: {exc}", file=sys.stderr)
                continue
            found.append(Results(path, doc, *_date(doc, path)))
    return sorted(found, key=lambda r: r.date)


# ---- formatting -----------------------------------------------------------------------------
def _x(value) -> str:
    return "-" if value is None else f"{float(value):.2f}"


def _pct(value) -> str:
    """A fraction as a percentage; two decimals, so that 9.97 % of traffic does not read as the 10 % bound."""
    return "-" if value is None else f"{100 * float(value):.2f} %"


def _table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "| " + " | ".join("---" for _ in header) + " |"]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


def _by_tensor(
    rows: Sequence[dict], label: Callable[[dict], str], cell: Callable[[dict], str]
) -> tuple[list[str], list[list[str]]]:
    """``(header, rows)``: a row per ``label`` (in the order first seen), a column per tensor (its dtype beside it)."""
    tensors = list(dict.fromkeys((r["tensor"], r["dtype"]) for r in rows))
    cells: dict[str, dict[tuple[str, str], str]] = {}
    for r in rows:
        cells.setdefault(label(r), {}).setdefault((r["tensor"], r["dtype"]), cell(r))
    header = [f"{t} ({d})" for t, d in tensors]
    return header, [[name, *(row.get(t, "-") for t in tensors)] for name, row in cells.items()]


def _runs(files: Sequence[Results]) -> list[Results]:
    """One file per run: files with the same command and start were written by one run; its last one speaks for it."""
    runs: dict[tuple, Results] = {}
    for f in files:
        key = (f.command, f.doc.get("started"))
        if key not in runs or f.doc.get("finished", f.date) >= runs[key].doc.get("finished", runs[key].date):
            runs[key] = f
    return list(runs.values())


def _sources(files: Sequence[Results]) -> str:
    runs = _runs(files)
    if len(runs) == 1:
        return f"Source: {runs[0].source()}."
    return "Sources:\n\n" + "\n".join(f"* {f.source()}" for f in runs)


def _set_of(workload: str) -> str:
    from experiments.workloads import workload_set

    return workload_set(workload) or "other"


@dataclass
class Section:
    """A table of docs/results.md: its heading, the text under it, and the plots to copy beside it."""

    key: str
    title: str
    body: str
    plots: list[tuple[Path, str]] = field(default_factory=list)  # (source PNG, name under docs/img/)


def _latest(files: Sequence[Results], keep: Callable[[Results], bool]) -> Results | None:
    chosen = [f for f in files if keep(f)]
    return chosen[-1] if chosen else None


def _main_job(files: Sequence[Results], experiment: str) -> list[Results]:
    """The main job's files of ``experiment`` (any size but full: that is the record's), oldest first."""
    return [
        r for r in files
        if r.experiment == experiment and r.size != "full" and r.command.startswith("python -m experiments.run")
    ]  # fmt: skip


def _main_capacity(files: Sequence[Results]) -> dict[str, Results]:
    """``{codec: the main job's latest capacity file}``, the default codec first."""
    by_codec: dict[str, Results] = {}
    for r in _main_job(files, "capacity"):
        name = r.codec()[0]
        if name:
            by_codec[name] = r  # oldest first: the last one wins
    default = buddy.defaults().codec
    return dict(sorted(by_codec.items(), key=lambda kv: kv[0] != default))


def _full_capacity(files: Sequence[Results]) -> Results | None:
    """The latest full-size capacity file of the default codec and entry size."""
    want = (buddy.defaults().codec, buddy.defaults().entry_bytes)
    return _latest(files, lambda r: r.experiment == "capacity" and r.size == "full" and r.codec() == want)


def _decide(files: Sequence[Results]) -> Results | None:
    return _latest(files, lambda r: r.experiment == "decide")


def _max_batch(files: Sequence[Results]) -> Results | None:
    return _latest(files, lambda r: r.experiment == "max_batch")


def _plot(result: Results, name: str, as_name: str) -> list[tuple[Path, str]]:
    png = result.path.parent / name
    return [(png, as_name)] if png.is_file() else []


# ---- the tables -----------------------------------------------------------------------------
def _capacity_rows(by_codec: dict[str, Results]) -> tuple[list[str], list[list[str]]]:
    """Per workload (then per set): ideal ratio, capacity and traffic under the default policy, per codec."""
    header = ["workload", "set"]
    for codec, result in by_codec.items():
        entry = result.codec()[1]
        header += [f"{codec}@{entry}: ideal", "capacity", "traffic"]
    headlines = {codec: {r["workload"]: r for r in res.doc.get("headline", [])} for codec, res in by_codec.items()}
    workloads = list(dict.fromkeys(w for h in headlines.values() for w in h))
    rows = []
    for w in workloads:
        first = next(h[w] for h in headlines.values() if w in h)
        summary = first.get("summary")
        name = f"**{w}** (geomean; worst traffic)" if summary else w
        row = [name, first.get("set", _set_of(w))]
        for h in headlines.values():
            r = h.get(w, {})
            row += [_x(r.get("ideal_ratio")), _x(r.get("capacity")), _pct(r.get("overflow_fraction"))]
        rows.append(row)
    return header, rows


def _policy_name(result: Results) -> str:
    from experiments.capacity import HEADLINE_POLICY

    return f"`{HEADLINE_POLICY[0]}({HEADLINE_POLICY[1].replace('%', ' %')})`"


def _with_other_coders(
    header: list[str], rows: list[list[str]], summary: Sequence[dict], by_codec: dict[str, Results]
) -> tuple[list[str], list[list[str]]]:
    """The capacity table with a column per other coder of a compressibility run (zstd-3, lz4, the entropy bound):
    its ideal ratio per workload ("-" on the set rows). buddy's own codecs are in the table already."""
    ours = {(codec, result.codec()[1]) for codec, result in by_codec.items()}
    methods = [m for m in dict.fromkeys((s["method"], s["entry_bytes"]) for s in summary) if m not in ours]
    label = {m: m[0] if m[1] is None else f"{m[0]}@{m[1]}" for m in methods}
    label = {m: {"zstd-3": "zstd-3 (whole tensor)", "lz4": "lz4 (whole tensor)"}.get(v, v) for m, v in label.items()}
    by = {(s["workload"], s["method"], s["entry_bytes"]): s["ratio"] for s in summary}
    rows = [[*row, *(_x(by.get((row[0], *m))) for m in methods)] for row in rows]
    return [*header, *(f"{label[m]}: ideal" for m in methods)], rows


def main_job(files: Sequence[Results]) -> Section | None:
    """The main job's capacity tables (both sets, every codec it ran) and its ideal ratios."""
    by_codec = _main_capacity(files)
    if not by_codec:
        return None
    first = next(iter(by_codec.values()))
    header, rows = _capacity_rows(by_codec)
    comps = _main_job(files, "compressibility")
    comp = comps[-1] if comps else None
    sources = list(by_codec.values())
    if comp is not None and comp.doc.get("summary"):  # the other coders' ideal ratios, as columns of the same rows
        header, rows = _with_other_coders(header, rows, comp.doc["summary"], by_codec)
        sources.append(comp)
    parts = [
        f"Effective capacity (original bytes / device bytes: slots + metadata) under the tracker's default policy, "
        f"{_policy_name(first)}, and the buddy traffic it costs (overflow bytes / activation bytes), over the "
        f"tensors captured at training steps {', '.join(map(str, first.doc.get('points', [])))} ({first.size} size); "
        "*ideal*: the compacted ratio (no slot rounding, no metadata), beside it general-purpose coders' on whole "
        "tensors and the order-0 byte-entropy bound. Capacity counts device bytes only, so the overflow in buddy "
        "memory can lift it above the ideal ratio. The defaults were chosen on the tuning set; the check set was not "
        "used to choose. Set rows: geometric mean, worst traffic.",
        "",
        _table(header, rows),
    ]
    parts += ["", _sources(sources)]
    plots = []
    for codec, result in by_codec.items():
        plots += _plot(result, "capacity_sets.png", f"main-capacity_sets-{codec}.png")
    plots += _plot(by_codec[next(iter(by_codec))], "capacity_overview.png", "main-capacity_overview.png")
    return Section("main", "The main job: capacity on both sets", "\n".join(parts), plots)


def full_capacity(files: Sequence[Results]) -> Section | None:
    """Capacity at full size with the current default codec and entry size."""
    result = _full_capacity(files)
    if result is None:
        return None
    want = result.codec()
    header, rows = _capacity_rows({want[0] or "?": result})
    points = ", ".join(map(str, result.doc.get("points", [])))
    body = "\n".join(
        [
            f"The same table with every workload at its full size, captured at training steps {points}, with the "
            f"default codec and entry size ({want[0]} @ {want[1]} B) under {_policy_name(result)}:",
            "",
            _table(header, rows),
            "",
            _sources([result]),
        ]
    )
    return Section("full_capacity", "Capacity at full size", body)


#: the decision table's rows that are not entry codecs
_WHOLE = {
    "zstd-3": "zstd-3, whole tensor",
    "lz4": "lz4, whole tensor",
    "entropy (bytes)": "order-0 byte entropy",
    "entropy (fields)": "order-0 float-field entropy",
}


def decision(files: Sequence[Results]) -> Section | None:
    """The decision table behind the default codec, entry size and policy."""
    result = _decide(files)
    if result is None:
        return None
    doc = result.doc
    chosen = doc.get("chosen", {})
    entries = [r for r in doc.get("decision", []) if r.get("entry_bytes") is not None and "capacity:geomean" in r]
    whole = [r for r in doc.get("decision", []) if r.get("entry_bytes") is None]
    by = {(r["codec"], r["entry_bytes"], r.get("policy")): r for r in entries}
    policies = list(dict.fromkeys(r.get("policy") for r in entries))
    is_chosen = lambda codec, entry: (codec, entry) == (chosen.get("codec"), chosen.get("entry_bytes"))  # noqa: E731
    header = ["codec @ E", "tuning: ideal", *(f"tuning: {p}" for p in policies)]
    header += ["check: ideal", *(f"check: {p}" for p in policies)]

    def cell(r: dict, prefix: str) -> str:
        capacity = r.get(f"{prefix}capacity:geomean")
        return "-" if capacity is None else f"{capacity:.2f} ({_pct(r.get(f'{prefix}overflow:max'))})"

    rows = []
    for codec, entry in dict.fromkeys((r["codec"], r["entry_bytes"]) for r in entries):
        label = f"{'zstd-3 per entry' if codec == 'zstd-3@E' else codec} @ {entry}"
        label = f"**{label} (default)**" if is_chosen(codec, entry) else label
        first = by[(codec, entry, policies[0])]
        row = [label, _x(first.get("ratio:geomean")), *(cell(by.get((codec, entry, p), {}), "") for p in policies)]
        row += [_x(first.get("check:ratio:geomean")), *(cell(by.get((codec, entry, p), {}), "check:") for p in policies)]
        rows.append(row)
    for r in whole:
        dash = ["-"] * len(policies)
        rows.append([_WHOLE.get(r["method"], r["method"]), _x(r.get("ratio:geomean")), *dash, _x(r.get("check:ratio:geomean")), *dash])
    sets = doc.get("sets", {})
    columns = [(w, f"capacity:{w}", f"ratio:{w}") for members in sets.values() for w in members]
    columns += [("tuning", "capacity:geomean", "ratio:geomean"), ("check", "check:capacity:geomean", "check:ratio:geomean")]
    pick = by.get((chosen.get("codec"), chosen.get("entry_bytes"), chosen.get("policy")))
    per_workload = []
    if pick is not None:
        per_workload.append([f"**capacity: {chosen['codec']} @ {chosen['entry_bytes']}, {chosen['policy']} (default)**",
                             *(_x(pick.get(c)) for _, c, _ in columns)])  # fmt: skip
        per_workload.append([f"ideal ratio: {chosen['codec']} @ {chosen['entry_bytes']}", *(_x(pick.get(i)) for _, _, i in columns)])
    for r in whole:
        per_workload.append([f"ideal ratio: {_WHOLE.get(r['method'], r['method'])}", *(_x(r.get(i)) for _, _, i in columns)])
    body = [
        "For every codec and entry size E: the ideal compacted ratio and the effective capacity under each of the "
        "tracker's policies at 10 % (geometric means over each set; in brackets the worst traffic of its workloads). The "
        "rule: the highest tuning-set capacity among the candidates that kept every tuning workload's traffic within "
        "10 %; within 1 %, the smaller entry, then the faster codec. The check set is never used to choose. "
        "Capacity counts slots and metadata; a version 2 tensor's table (at most 775 B) is not counted here.",
        "",
        _table(header, rows),
    ]
    if per_workload:
        body += ["", "Per workload, the default against whole-tensor coders and the entropy bounds:", "",
                 _table(["", *(name for name, _, _ in columns)], per_workload)]  # fmt: skip
    body += ["", _sources([result])]
    return Section("decision", "The decision table: codec, entry size, policy", "\n".join(body))


def speed(files: Sequence[Results]) -> Section | None:
    """The reference path's CPU speed per codec and entry size, from the decision run."""
    result = _decide(files)
    if result is None:
        return None
    timed = [r for r in result.doc.get("decision", []) if "compress_gbps" in r and r.get("policy") in (None, "BuddyThreshold")]
    sizes = sorted({r["entry_bytes"] for r in timed if r["entry_bytes"] is not None})
    rows: dict[str, dict[int | None, str]] = {}
    for r in timed:
        name = r["codec"] if r["entry_bytes"] is not None else r["method"]
        cell = f"{r['compress_gbps']:.3f} / {r['decompress_gbps']:.3f}"
        rows.setdefault(name, {})[r["entry_bytes"]] = cell
    table = [[name, *(cells.get(e, "-") for e in sizes), cells.get(None, "-")] for name, cells in rows.items()]
    body = "\n".join(
        [
            "GB/s of input, compress / decompress, on the CPU (buddy's torch reference path; zstd-3 and lz4 through "
            "their Python bindings): geometric mean over a 1 MiB sample of each workload's saved tensors, "
            f"{result.machine()}.",
            "",
            _table(["codec", *(f"E = {e} B" for e in sizes), "whole tensor"], table),
            "",
            _sources([result]),
        ]
    )
    return Section("speed", "Codec speed on the CPU", body)


def over_training(files: Sequence[Results]) -> Section | None:
    """The tracker in the loop: per workload and size, the most recent run's summary."""
    latest: dict[tuple[str, str], tuple[Results, dict]] = {}
    for r in files:
        if r.experiment == "over_training":
            for s in r.doc.get("summary", []):
                latest[(r.size or "?", s["workload"])] = (r, s)
    if not latest:
        return None
    order = {"full": 0, "quick": 1}
    keys = sorted(latest, key=lambda k: (order.get(k[0], 2), k[1] not in _members("tuning"), _index(k[1])))
    sources = list({id(r): r for r, _ in (latest[k] for k in keys)}.values())
    number = {id(r): i + 1 for i, r in enumerate(sources)}
    rows = []
    for k in keys:
        r, s = latest[k]
        settings = r.doc.get("settings", {})
        codec, entry = r.codec()
        every = settings.get("every", 1)
        trained = settings.get("steps", s["steps"])
        compressed = f"{s['steps']} of {trained}" if every != 1 else f"{s['steps']}"
        rows.append(
            [k[1], _set_of(k[1]), k[0], compressed, f"{codec} @ {entry}" if codec else "not recorded",
             settings.get("policy", "-").replace("(max_overflow=", "("), _x(s["capacity"]), _pct(s["overflow_fraction"]),
             f"{s['missed']} of {s['predictions']}", f"[{number[id(r)]}]"]
        )  # fmt: skip
    body = [
        "A real training run with buddy's session compressing every saved activation (every n-th step where the "
        "table says \"of\"); each key's slot and table learned from its earlier steps. Capacity and traffic over all "
        "compressed steps; *missed*: predictions of a tensor's overflow off by more than 1 % of its bytes (a miss "
        "moves a slot, never the bound, which each tensor's own size pass checks).",
        "",
        _table(["workload", "set", "size", "compressed steps", "codec @ E", "policy", "capacity", "traffic",
                "missed", "source"], rows),  # fmt: skip
        "",
        "Sources:",
        "",
        *(f"{number[id(r)]}. {r.source()}" for r in sources),
    ]
    if any(not r.codec()[0] for r in sources):
        body += ["", "*not recorded*: the file predates results files recording the codec; the run used buddy's "
                 "defaults of its date."]  # fmt: skip
    plots = []
    for r in sources:
        if r.size == "full":
            plots += _plot(r, "over_training_llama-bf16.png", "over_training-llama-bf16.png")
    return Section("over_training", "The tracker in the loop", "\n".join(body), plots[-1:])


def _members(name: str) -> tuple[str, ...]:
    from experiments.workloads import WORKLOAD_SETS

    return tuple(WORKLOAD_SETS.get(name, ()))


def _index(workload: str) -> int:
    order = [*_members("tuning"), *_members("check")]
    return order.index(workload) if workload in order else len(order)


def max_batch(files: Sequence[Results]) -> Section | None:
    """The largest batch under a memory budget, per method, with the step time at it."""
    result = _max_batch(files)
    if result is None:
        return None
    rows = result.rows()
    methods = list(dict.fromkeys(r["method"] for r in rows))
    by = {(r["workload"], r["method"]): r for r in rows}
    table = []
    notes: dict[str, None] = {}  # the file's notes, in order, once each
    for w in dict.fromkeys(r["workload"] for r in rows):
        cells = [w, _set_of(w)]
        base = by.get((w, "none"), {}).get("step_seconds")
        for m in methods:
            r = by.get((w, m))
            if r is not None and r.get("note"):
                notes.setdefault(r["note"], None)
            if r is None or not r["max_batch"]:
                cells.append("-")
                continue
            capped = ", capped" if r.get("note", "").startswith("search capped") else ""
            cell = f"{r['max_batch']} ({r['vs_none']:.2f}x{capped})"
            if s := r.get("step_seconds"):
                cell += f"; {s:.2f} s" + (f" ({s / base:.1f}x)" if base and m != "none" else "")
            cells.append(cell)
        table.append(cells)
    accounting = result.doc.get("accounting")
    how = (
        "an accounting run: no GPU, so the device bytes each method would hold are counted, not allocated"
        if accounting
        else "measured on the device"
    )
    body = "\n".join(
        [
            f"The largest batch whose step fits the memory a plain step of the base batch needs, per method ({how}; "
            f"size {result.size}), in brackets against no compression; then the step time at that batch on this "
            "machine, in brackets against the plain step at its own batch. A single compressed step per measurement, "
            "so the tracker has no history and each slot is the per-tensor rule's.",
            "",
            _table(["workload", "set", *methods], table),
            "",
            "Notes of the file: " + "; ".join(notes) + "." if notes else "",
            "",
            _sources([result]),
        ]
    )
    return Section("max_batch", "The largest batch", body, _plot(result, "max_batch.png", "max_batch.png"))


def step_cost(files: Sequence[Results]) -> Section | None:
    """CPU time of a training step with buddy's session against without, per workload."""
    result = _latest(files, lambda r: r.experiment == "step_cost")
    if result is None:
        return None
    def known(r: dict, key: str, fmt: str) -> str:  # (columns older files do not have: "-")
        return "-" if r.get(key) is None else format(r[key], fmt)

    rows = [
        [r["workload"], _set_of(r["workload"]), f"{r['codec']} @ {r['entry_bytes']}", r.get("backend", "reference"),
         f"{r['none_cpu_s']:.3f} s",
         f"{r['buddy_cpu_s']:.3f} s", f"**{r['cpu_ratio']:.1f}x**", f"{r['wall_ratio']:.1f}x",
         known(r, "main_ratio", ".2f") + ("x" if r.get("main_ratio") is not None else ""),
         known(r, "ahead_cpu_ratio", ".2f") + ("x" if r.get("ahead_cpu_ratio") is not None else ""),
         f"{known(r, 'host_reads', '.0f')} / {known(r, 'ahead_host_reads', '.0f')}",
         known(r, "tensors", "d"), known(r, "host_per_tensor_us", ",.0f"), known(r, "calls_share", ".0%"),
         _x(r.get("capacity"))]
        for r in result.rows()
    ]  # fmt: skip
    steps = result.rows()[0]["steps"] if result.rows() else "?"
    first = result.rows()[0] if result.rows() else {}
    learn, every = first.get("learn_steps"), first.get("count_every")
    learned = (
        f" (first {learn} compressed steps, the tracker's count warm-up: the timed steps are its steady state, a "
        f"learned key's symbols counted one step in {every})" if learn and every else ""
    )
    body = "\n".join(
        [
            f"One run per workload ({result.size} size), its steps alternately plain and inside "
            "`buddy.compressed_activations()` with buddy's defaults (the backend that ran the codec: its column); the "
            "CPU time of a step "
            "(the process's, all threads: other work on the machine does not stretch it as it does wall time), "
            f"median of {steps} steps of each kind after warm-up{learned}. Wall-time ratio beside it, and the main "
            "thread's "
            "CPU time's: the step's critical path, which neither other work nor the spin-waits of torch's OpenMP "
            "threads lengthen. Per tensor compressed (each is compressed and decompressed once a step), the wall time "
            "buddy adds outside its kernels: the host's work, Python and torch operations around the kernels; and the "
            "share of the added wall time spent in buddy's compresses and decompresses (kernels included: the rest is "
            "outside them -- the hooks' choice of what to take, the model's own operations run slower beside buddy). "
            "The buddy columns size every tensor before its slot is chosen (`strict=True`: a read of the device a "
            "tensor); `strict=False` (ahead, the session's default) takes its slot from the tracker's plan: its "
            "CPU-time ratio beside, and the reads a step of each (a read costs nothing on the CPU; it is what a GPU "
            "waits for).",
            "",
            _table(["workload", "set", "codec @ E", "backend", "plain step (CPU)", "buddy step (CPU)", "buddy / plain (CPU)",
                    "buddy / plain (wall)", "buddy / plain (main thread)", "ahead / plain (CPU)",
                    "reads a step (strict / ahead)", "tensors compressed",
                    "host's work a tensor (us)", "added time in buddy's calls", "capacity"], rows),  # fmt: skip
            "",
            _sources([result]),
        ]
    )
    return Section("step_cost", "Training step cost on the CPU", body)


def frontier(files: Sequence[Results]) -> Section | None:
    """Step time against capacity: every method on the same models (experiments.frontier)."""
    result = _latest(files, lambda r: r.experiment == "frontier")
    if result is None:
        return None
    rows = [
        [r["model"], r["method"], f"{r['step_ms']:,.0f} ms", _x(r.get("vs_none")), _x(r.get("capacity")),
         _x(r.get("buddy_capacity")), _x(r.get("modeled_capacity"))]
        for r in result.rows()
    ]  # fmt: skip
    where = (
        "On the CPU: the models shrunk to a step of a few tenths of a second, every method on the host, CPU times "
        "(not GPU times); capacity from each step's peak resident memory above its start, the least of two more "
        "steps after the timings. There the activations saved are a small part of what a step holds at its peak "
        "(the embedding's and the loss chunks' buffers, gradients) and the resident peak moves by about 15 % from "
        "run to run: read its capacity column for checkpointing's gain and nothing finer. The GPU run of the "
        "runbook (`frontier` phase) measures the allocator's peak."
        if result.doc.get("cpu_run")
        else "On a GPU: capacity from the allocator's peak less the model's state."
    )
    body = "\n".join(
        [
            "Per model, one training step under each method on the same data: step time (median of the timed steps) "
            "against a plain step's, and capacity: the memory a plain step adds at its peak over what the method's "
            "step adds. `buddy-target-F`: `MemoryTarget(fraction=F)`; `buddy-time-F`: `TimeBudget(F)`; "
            "`buddy+checkpoint`: every block checkpointed, buddy compressing what checkpointing keeps; the buddy "
            "ratio: what the session's compressed tensors held on the device against their originals; the saved "
            "peak (modeled): the session's own account of its saved tensors (`buddy.peak`), their peak uncompressed "
            f"over their peak as the step compressed them, no transient buffers counted. {where}",
            "",
            _table(["model", "method", "step", "time vs none", "capacity", "buddy ratio", "saved peak (modeled)"],
                   rows),  # fmt: skip
            "",
            _sources([result]),
        ]
    )
    return Section("frontier", "Step time against capacity", body, _plot(result, "frontier.png", "frontier.png"))


def _cpu_engines_result(files: Sequence[Results]) -> Results | None:
    """The latest bench_codecs run that timed buddy's CPU engines by name (``codec@backend`` methods)."""
    return _latest(files, lambda r: r.experiment == "bench_codecs" and any("@" in x["method"] for x in r.rows()))


def _engine_speed(result: Results) -> str:
    """The README's line on the CPU speed: the default codec's native engine per tensor, lz4's and zstd-3's."""
    codec = buddy.defaults().codec
    spans = {}
    for method in (f"buddy:{codec}@native", "lz4", "zstd-3"):
        rows = [r for r in result.rows() if r["method"] == method]
        if rows:
            spans[method] = tuple(
                f"{min(r[k] for r in rows):.2f}-{max(r[k] for r in rows):.2f}" for k in ("comp_gbps", "decomp_gbps")
            )
    mine = spans.get(f"buddy:{codec}@native")
    if mine is None:
        return f"(the CPU engines' run of {result.date[:10]} did not time `{codec}`'s native engine)"
    others = "; ".join(f"{m}: {c} / {d}" for m, (c, d) in spans.items() if not m.startswith("buddy:"))
    entry = result.doc.get("args", {}).get("entry_bytes", "?")
    threads = result.doc.get("args", {}).get("threads") or result.doc.get("environment", {}).get("torch_threads")
    return (
        f"On the CPU the native engine of `{codec}` @ {entry} B compresses {mine[0]} GB/s and decompresses {mine[1]} "
        f"GB/s per tensor of real activations{f' on {threads} threads' if threads else ''} ({others}, one thread "
        "each; [the CPU engines against lz4 and zstd](docs/results.md#the-cpu-engines-against-lz4-and-zstd))."
    )


def cpu_engines(files: Sequence[Results]) -> Section | None:
    """Compress and decompress GB/s of the CPU engines against lz4 and zstd-3, per tensor, from bench_codecs."""
    result = _cpu_engines_result(files)
    if result is None:
        return None
    rows = [r for r in result.rows() if r["method"] != "memcpy"]
    ratios = _by_tensor(rows, lambda r: r["method"].removeprefix("buddy:").split("@")[0], lambda r: _x(r["ratio"]))
    speeds = _by_tensor(rows, lambda r: r["method"].removeprefix("buddy:"),
                        lambda r: f"{r['comp_gbps']:.3f} / {r['decomp_gbps']:.3f}")  # fmt: skip
    args = result.doc.get("args", {})
    body = "\n".join(
        [
            f"Real activations ({args.get('scale', '?')} scale), buddy at E = {args.get('entry_bytes', '?')} with its "
            "default slot choice, each backend a method (`@native`: the kernel sources built for the host; "
            "`@reference`: the torch reference), next to lz4 and zstd-3 (single-threaded, on the same bytes); "
            f"medians of {args.get('repeats', '?')} runs, decimal GB/s, every round trip checked byte for byte.",
            "",
            "Ratio (every backend of a codec writes the same bytes):",
            "",
            _table(["codec", *ratios[0]], ratios[1]),
            "",
            "Compress / decompress GB/s:",
            "",
            _table(["method", *speeds[0]], speeds[1]),
            "",
            _sources([result]),
        ]
    )
    plots = _plot(result, "speed.png", "cpu_engines.png")
    return Section("cpu_engines", "The CPU engines against lz4 and zstd", body, plots)


#: the committed records of GPU sessions: one folder per session (date and GPU), each phase's JSON in it
GPU_RESULTS = ROOT / "experiments" / "results" / "gpu"


def _gpu_record(folder: Path = GPU_RESULTS, step: str = "bench_cuda") -> tuple[Path, dict, dict[str, dict]] | None:
    """The latest phase record (by folder, then file name) holding a result of ``step``: ``(path, record, its steps
    by name)``."""
    found = []
    for path in sorted(folder.glob("*/*.json")):
        try:
            record = json.loads(path.read_text())
        except (OSError, ValueError):
            continue
        if not isinstance(record, dict):
            continue
        steps = {str(s.get("name")): s for s in record.get("steps", []) if isinstance(s, dict)}
        if (steps.get(step) or {}).get("result"):
            found.append((path, record, steps))
    return found[-1] if found else None


def _gpu_step_time(folder: Path) -> list[str]:
    """The latest GPU step-time table (the ``step`` phase's, with every method, where it is the newest), the
    largest batches beside it where that phase searched them, and what each step held at its peak."""
    got = _gpu_record(folder, "step_time")
    if got is None:
        return []
    path, record, steps = got
    step = steps["step_time"]["result"]
    srows = [
        [r["model"], r["method"], f"{r['step_ms']:,.1f}", _x(r.get("vs_none")),
         f"{r['peak_gib']:.2f}" if r.get("peak_gib") else "-", _x(r.get("capacity"))]
        for r in step.get("rows", [])
    ]  # fmt: skip
    models = step.get("models", {})
    parts = ["", "Training step time (median of the timed steps) and peak device memory, buddy on its kernels: "
             + "; ".join(f"{k}: {v}" for k, v in models.items()) + f" (`{path.parent.name}/{path.name}`).", "",
             _table(["model", "method", "step ms", "vs none", "peak GiB", "capacity"], srows)]  # fmt: skip
    parts += [""] + [f"* {v.strip()}" for v in step.get("verdicts", [])]
    peaks = [r for r in step.get("rows", []) if r.get("memory_peak")]
    if peaks:
        parts += ["", "What each step held at its peak (one more step under the allocator's history; the largest "
                  "sites):", ""]  # fmt: skip
        for r in peaks:
            m = r["memory_peak"]
            top = "; ".join(f"{x['site']} {x['bytes'] / 2**30:.2f}" for x in m["sites"][:4])
            parts.append(f"* {r['model']} / {r['method']}: {m['peak_bytes'] / 2**30:.2f} GiB -- {top} (GiB)")
    batch = (steps.get("max_batch") or {}).get("result")
    if batch and batch.get("rows") and not any(r["max_batch"] for r in batch["rows"]):
        notes = sorted({r.get("note") or "no batch fits" for r in batch["rows"]})
        parts += ["", f"The largest-batch search of the same phase found no batch anywhere: {'; '.join(notes)}."]
    elif batch and batch.get("rows"):
        brows = [
            [r["workload"], r["method"], f"{r['budget_mib']:,.0f}", str(r["max_batch"]), _x(r.get("vs_none")),
             r.get("note") or ""]
            for r in batch["rows"]
        ]  # fmt: skip
        parts += ["", "The largest batch under a real per-process memory cap (`max_batch`, the same phase):", "",
                  _table(["workload", "method", "cap MiB", "max batch", "vs none", "note"], brows)]  # fmt: skip
    return parts


def gpu(files: Sequence[Results], folder: Path = GPU_RESULTS) -> Section | None:
    """The latest GPU session's bench and step times (committed under experiments/results/gpu/)."""
    got = _gpu_record(folder)
    if got is None:
        return None
    path, record, steps = got
    env = record.get("environment", {})
    where = (f"{env.get('gpu', '?')}, driver {env.get('driver', '?')}, CUDA {env.get('cuda', '?')}, torch "
             f"{env.get('torch', '?')}, CuPy {env.get('cupy', '?')}, nvcomp {env.get('nvcomp', '?')}")  # fmt: skip
    source = f"`{record.get('command', '?')}` — {where}; {record.get('finished', '?')}. Files: `{path.parent.relative_to(ROOT)}/`."
    bench = steps["bench_cuda"]["result"]
    args = bench.get("args", {})
    ratios = _by_tensor(bench.get("rows", []), lambda r: r["method"], lambda r: _x(r["ratio"]))
    speeds = _by_tensor(bench.get("rows", []), lambda r: r["method"],
                        lambda r: f"{r['compress_gbps']:,.0f} / {r['decompress_gbps']:,.0f}")  # fmt: skip
    header = ["method"] + [f"{t}: {what}" for t in ratios[0] for what in ("ratio", "GB/s")]
    rows = [[name, *(c for pair in zip(ratio, speed) for c in pair)]
            for (name, *ratio), (_, *speed) in zip(ratios[1], speeds[1])]  # fmt: skip
    parts = [
        f"Every codec with kernels and every nvcomp algorithm on {args.get('mib', '?')} MiB of real activations of "
        f"each dtype, GB/s of input (compress / decompress), median of {args.get('repeats', '?')} timed runs after "
        f"{args.get('warmup', '?')} untimed, every round trip checked byte for byte. A buddy figure includes its buddy memory's traffic over "
        "PCIe (the default policy sends about 10 % of the bytes there) and, in compress, fitting the table (nothing "
        "learned).",
        "",
        _table(header, rows),
    ]
    parts += _gpu_step_time(folder)
    parts += ["", source]
    return Section("gpu", "On a GPU", "\n".join(parts))


SECTIONS = (
    main_job, gpu, decision, full_capacity, over_training, max_batch, step_cost, frontier, cpu_engines, speed,
)  # fmt: skip


def _sets(result: Results) -> dict[str, dict]:
    return {r["set"]: r for r in result.doc.get("headline", []) if r.get("summary")}


def headline(files: Sequence[Results], previous: str = "") -> str | None:
    """The README's table: each set's capacity (and the largest batch, the CPU speed), linking docs/results.md.

    A row (or the line on the CPU speed) whose results file none of ``files`` is keeps what ``previous`` (the
    README's headline block as it was) says, as docs/results.md keeps its sections: a quick run does not erase the
    full-size record.
    """
    rows: list = []
    earlier = previous.splitlines()

    def kept(prefix: str, contains: str = "") -> str | None:
        return next((line for line in earlier if line.startswith(prefix) and contains in line), None)

    def capacity_row(label: str, result: Results, anchor: str):
        sets = _sets(result)
        worst = max((s["overflow_fraction"] for s in sets.values()), default=None)
        cells = [f"{sets[n]['capacity']:.2f}x" if n in sets else "-" for n in ("tuning", "check")]
        rows.append([label, *cells, _pct(worst), f"[{result.date[:10]}](docs/results.md#{anchor})"])

    main = _main_capacity(files)
    for codec, result in main.items():
        entry = result.codec()[1]
        what = "default" if codec == buddy.defaults().codec else "for comparison"
        label = f"capacity, `{codec}` @ {entry} B ({what}), {result.size} size"
        capacity_row(label, result, "the-main-job-capacity-on-both-sets")
    full = _full_capacity(files)
    if full is not None:
        full_codec, entry = full.codec()
        capacity_row(f"capacity, `{full_codec}` @ {entry} B, full size", full, "capacity-at-full-size")
    elif (row := kept("| capacity, ", ", full size |")) is not None:
        rows.append(row)
    batch = _max_batch(files)
    if batch is None:
        if (row := kept("| largest batch against none")) is not None:
            rows.append(row)
    else:
        ratios: dict[str, list[float]] = {}
        for r in batch.rows():
            if r["method"] == "buddy" and r["max_batch"]:
                ratios.setdefault(_set_of(r["workload"]), []).append(r["vs_none"])
        cells = [f"{min(ratios[n]):.2f}x-{max(ratios[n]):.2f}x" if n in ratios else "-" for n in ("tuning", "check")]
        rows.append([f"largest batch against none, {batch.size} size", *cells, "-",
                     f"[{batch.date[:10]}](docs/results.md#the-largest-batch)"])  # fmt: skip
    if not rows:
        return None
    table = _table(["", "tuning set", "check set", "worst traffic", "details"], [])
    for row in rows:  # a row made, or one kept as it was written
        table += "\n" + (row if isinstance(row, str) else _table([""], [row]).splitlines()[-1])
    engines, chosen = _cpu_engines_result(files), _decide(files)
    if engines is not None:
        table += f"\n\n{_engine_speed(engines)}"
    elif chosen is None:
        speed = kept("On the CPU the native engine of") or kept("On the CPU the reference path of")
        if speed is not None:
            table += f"\n\n{speed}"
    else:
        pick = chosen.doc.get("chosen", {})
        speeds = {(r["codec"], r.get("entry_bytes")): r for r in chosen.doc.get("decision", []) if "compress_gbps" in r}
        mine, zstd = speeds.get((pick.get("codec"), pick.get("entry_bytes"))), speeds.get(("zstd-3", None))
        if mine and zstd:
            table += (
                f"\n\nOn the CPU the reference path of `{pick['codec']}` @ {pick['entry_bytes']} B compresses "
                f"{mine['compress_gbps']:.3f} GB/s and decompresses {mine['decompress_gbps']:.3f} GB/s (zstd-3 on whole "
                f"tensors: {zstd['compress_gbps']:.2f} / {zstd['decompress_gbps']:.2f}; "
                "[codec speed](docs/results.md#codec-speed-on-the-cpu))."
            )
    return table


# ---- the page -------------------------------------------------------------------------------
HEADER = """# Results

Generated by `python -m experiments.report` from the experiments' results files; do not edit by hand. Every table
names the command that produced it, the machine it ran on and the date. The experiments write their results under
`results/` (not committed): run the command a table names to get its file back, then `python -m experiments.report`.
How the numbers are read: [choosing.md](choosing.md); what each experiment measures: [experiments.md](experiments.md).
"On a GPU" comes from the latest GPU session's files (committed under `experiments/results/gpu/`); every other table
from the CPU, where a codec runs its default backend (the step-cost table names it).
"""

_BEGIN, _END = "<!-- report:{} -->", "<!-- /report:{} -->"


def _kept(previous: str, key: str) -> str | None:
    begin, end = re.escape(_BEGIN.format(key)), re.escape(_END.format(key))
    match = re.search(f"{begin}\n(.*?){end}", previous, flags=re.S)
    return match.group(1) if match else None


def render(files: Sequence[Results], previous: str = "", img: Path | None = None) -> tuple[str, list[str]]:
    """``(page, notes)``: the Markdown of docs/results.md, and what was generated or kept (for the console).

    ``img`` (docs/img/): where each section's plots are copied; links in the
    page are relative to the page's folder, so ``img`` must be its ``img/``.
    """
    parts, notes = [HEADER], []
    for make in SECTIONS:
        key = make.__name__ if make is not main_job else "main"
        section = make(files)
        if section is None:
            kept = _kept(previous, key)
            if kept is None:
                notes.append(f"{key}: no results file, no earlier section: left out")
                continue
            parts.append(f"{_BEGIN.format(key)}\n{kept}{_END.format(key)}\n")
            notes.append(f"{key}: no results file: the earlier section kept")
            continue
        text = f"## {section.title}\n\n{section.body}\n"
        for source, name in section.plots:
            if img is not None:
                img.mkdir(parents=True, exist_ok=True)
                shutil.copyfile(source, img / name)
                text += f"\n![{name.removesuffix('.png')}](img/{name})\n"
        parts.append(f"{_BEGIN.format(key)}\n{text}{_END.format(key)}\n")
        notes.append(f"{key}: generated")
    return "\n".join(parts), notes


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--results", type=Path, nargs="+", default=[Path("results")], help="folders of results files")
    p.add_argument("--out", type=Path, default=ROOT / "docs" / "results.md")
    p.add_argument("--readme", type=Path, default=ROOT / "README.md", help="whose headline table to update")
    return p.parse_args(argv)


def update_readme(readme: Path, files: Sequence[Results]) -> bool:
    """Replace the README's headline block (between its ``report:headline`` markers) with :func:`headline`."""
    if not readme.is_file():
        return False
    text = readme.read_text()
    begin, end = _BEGIN.format("headline"), _END.format("headline")
    if begin not in text or end not in text:
        return False
    table = headline(files, previous=text.split(begin, 1)[1].split(end, 1)[0])
    if table is None:
        return False
    before, rest = text.split(begin, 1)
    readme.write_text(f"{before}{begin}\n{table}\n{end}{rest.split(end, 1)[1]}")
    return True


def main(argv=None) -> Path:
    args = parse_args(sys.argv[1:] if argv is None else list(argv))
    files = load(args.results)
    print(f"{len(files)} results files under {', '.join(map(str, args.results))}")
    previous = args.out.read_text() if args.out.is_file() else ""
    page, notes = render(files, previous, img=args.out.parent / "img")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(page)
    for note in notes:
        print(f"  {note}")
    print(f"wrote {args.out}")
    if args.readme is not None and update_readme(args.readme, files):
        print(f"updated the headline table of {args.readme}")
    return args.out


if __name__ == "__main__":
    main()
