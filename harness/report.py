"""The run's summary: a table on the terminal, and report.json, report.md and plots next to the case files.

``harness run`` and ``harness sweep`` write the same report: one record per matrix row (``row_record``),
the unavailable compositions with their reasons, and (a sweep) its findings and settings.
"""

from __future__ import annotations

import json
import os
from collections import defaultdict
from pathlib import Path

from properties.verdict import CHECKS
from search.outcome import (ADAPTER_ERROR, AT_RISK_RATIO, finding_kind, row_at_risk, throughput,
                            unexplained_headroom)


def row_record(r) -> dict:
    """A row's outcome (``search.outcome.RowOutcome``, or its record already) as the report's row."""
    return r if isinstance(r, dict) else r.record()


def _report_data(results, skipped, device: str, profile: str, findings=None, extra=None) -> dict:
    from search.casefile import package_versions

    data = {"device": device, "profile": profile, "versions": package_versions(),
            "rows": [row_record(r) for r in results],
            "unavailable": [{"composition": c, "reason": why} for c, why in skipped]}
    if findings is not None:
        data["findings"] = list(findings)
    return data | (extra or {})


def _write_atomic(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(text)
    tmp.replace(path)


def write_json_report(results, skipped, path: Path, device: str, profile: str) -> None:
    """report.json alone (a run writes it as each row ends)."""
    _write_atomic(path, json.dumps(_report_data(results, skipped, device, profile), indent=1))


def write_reports(results, skipped, out_dir: Path, device: str, profile: str, *, findings=None,
                  extra: dict | None = None) -> list[Path]:
    """report.json, report.md and the plots (``harness.plots``) in ``out_dir``; returns the paths written."""
    from harness.plots import write_plots

    data = _report_data(results, skipped, device, profile, findings, extra)
    out_dir = Path(out_dir)
    _write_atomic(out_dir / "report.json", json.dumps(data, indent=1))
    plots = write_plots(data["rows"], out_dir)
    _write_atomic(out_dir / "report.md", markdown(data, [p.name for p in plots]))
    _write_atomic(out_dir / "junit.xml", junit_xml(data))
    summary = os.environ.get("GITHUB_STEP_SUMMARY")
    if summary:  # under GitHub Actions: the report, without its plots (they are files of the artifact), on the job's page
        with open(summary, "a") as f:
            f.write(markdown(data, []) + "\n")
    return [out_dir / "report.md", out_dir / "report.json", out_dir / "junit.xml", *plots]


def _one_line(text) -> str:
    return " ".join(str(text or "").split())


def junit_xml(data: dict) -> str:
    """The report as JUnit XML, what CI systems read: one test case per row (class ``harness.COMPOSITION``, name
    ``MODE-PROPERTY``). A finding is a ``failure`` whose message is its one-line summary and whose text ends with
    the command that replays it; an adapter error (the harness's, not the engine's) is an ``error``; a row that
    did not run and an unavailable composition are ``skipped``, with the reason; known failures are passes that
    name their ledger entries. A sweep's findings that belong to no row (a composition's) get a case each."""
    import xml.etree.ElementTree as ET

    rows = data["rows"]
    findings = data.get("findings") or []
    by_row = {f["row"]: f for f in findings if f.get("row")}
    suite = ET.Element("testsuite", name=f"harness {data['profile']} on {data['device']}")
    versions = data.get("versions") or {}
    if versions:
        props = ET.SubElement(suite, "properties")
        for name, version in versions.items():
            ET.SubElement(props, "property", name=name, value=str(version))
    counts = {"tests": 0, "failures": 0, "errors": 0, "skipped": 0}
    seconds = 0.0

    def case(classname: str, name: str, time_s: float = 0.0):
        counts["tests"] += 1
        return ET.SubElement(suite, "testcase", classname=classname, name=name, time=f"{time_s:.3f}")

    def finding(parent, kind: str, summary, text, case_file) -> None:
        tag = "error" if kind == ADAPTER_ERROR else "failure"
        counts["errors" if tag == "error" else "failures"] += 1
        el = ET.SubElement(parent, tag, type=kind, message=_one_line(summary))
        repro = f"\nreproduce: python -m harness repro {case_file}" if case_file else ""
        el.text = f"{text or summary}{repro}"

    for r in rows:
        seconds += r["seconds"]
        el = case(f"harness.{r['composition']}", f"{r['mode']}-{r['property']}", r["seconds"])
        if r["status"] == "not run":
            counts["skipped"] += 1
            ET.SubElement(el, "skipped", message="not reached (the run or sweep stopped first)")
        elif not r["ok"]:
            f = by_row.get(r["row"], {})
            finding(el, f.get("kind") or finding_kind(r["status"]),
                    r.get("headline") or f.get("reason") or r["failure"], r["failure"] or f.get("reason"),
                    r.get("case_file") or f.get("case_file"))
        if r.get("known"):
            steered = r.get("steered") or {}
            ET.SubElement(el, "system-out").text = "known failures (docs/findings/known-failures.toml): " + \
                ", ".join(f"{k} ({n} case(s)" + (f"; then {steered[k]} of its batches not run)" if steered.get(k)
                                                 else ")") for k, n in r["known"].items())
    ran = {r["row"] for r in rows}
    for f in findings:
        if f.get("row") in ran:
            continue
        el = case(f"harness.{f.get('composition') or f.get('row')}", f.get("property") or f["kind"])
        finding(el, f["kind"], f.get("reason"), f.get("reason"), f.get("case_file"))
    for u in data["unavailable"]:
        el = case(f"harness.{u['composition']}", "unavailable")
        counts["skipped"] += 1
        ET.SubElement(el, "skipped", message=_one_line(u["reason"]))
    suite.set("time", f"{seconds:.3f}")
    for k, v in counts.items():
        suite.set(k, str(v))
    ET.indent(suite)
    return ET.tostring(suite, encoding="unicode", xml_declaration=True) + "\n"


def _ratio(r: dict) -> float | None:
    return None if r["worst_error"] is None or not r["bound"] else r["worst_error"] / r["bound"]


def _cell_text(text: str) -> str:
    """``text`` as one markdown table cell: its pipes escaped, its lines joined."""
    return text.replace("|", "\\|").replace("\n", " ")


def _cell(rows: list[dict]) -> str:
    """A composition x property cell: counts over the rows that ran, and how many did not run."""
    if not rows:
        return "-"
    ran = [r for r in rows if r["status"] != "not run"]
    not_run = len(rows) - len(ran)
    if not ran:
        return "not run" + (f" ({not_run})" if not_run > 1 else "")
    tail = f", {not_run} not run" if not_run else ""
    bad = [r["status"] for r in ran if not r["ok"]]
    if bad:
        return f"**{bad[0].upper()}**" + (f" ({len(bad)}/{len(ran)})" if len(ran) > 1 else "") + tail
    return f"ok ({len(ran)})" + tail


def how_badly(r: dict | None) -> str:
    """'element 0.21 / 6.6e-07 (×3.2e+05) at layer 0: request 0, token 1, head 3' for a row's failing case (the
    check that failed, its value and bound), else '-'."""
    at = (r or {}).get("failure_at") or {}
    err, bound, where = at.get("worst_error"), at.get("bound"), at.get("where")
    if err is None or not bound:
        return f"at {where}" if where else "-"
    check = f"{at['check']} " if at.get("check") else ""
    return f"{check}{err:.3g} / {bound:.3g} (×{err / bound:.3g})" + (f" at {where}" if where else "")


def headroom_cell(rows: list[dict]) -> str:
    """The largest ratio of each check over the rows' passing cases, ``0.12 / 0.31`` (relative L2 / element),
    bold where above :data:`AT_RISK_RATIO`."""
    merged = {c: max([(r.get("headroom") or {}).get(c, 0.0) for r in rows] or [0.0]) for c in CHECKS}
    if not any((r.get("headroom") or {}) for r in rows):
        return "-"
    return " / ".join(f"**{merged[c]:.2f}**" if merged[c] > AT_RISK_RATIO else f"{merged[c]:.2f}" for c in CHECKS)


def markdown(data: dict, plot_names: list[str]) -> str:
    """The report as Markdown: summary, findings, composition x property, worst error, throughput."""
    rows = data["rows"]
    comps = list(dict.fromkeys(r["composition"] for r in rows))
    props = list(dict.fromkeys(r["property"] for r in rows))
    modes = list(dict.fromkeys(r["mode"] for r in rows))
    failed = [r for r in rows if not r["ok"]]
    cases = sum(r["cases"] for r in rows)
    seconds = sum(r["seconds"] for r in rows)
    out = ["# Harness report", "",
           f"device **{data['device']}**, profile **{data['profile']}**: {len(rows)} rows, "
           f"{sum(r['status'] == 'passed' for r in rows)} passed, {len(failed)} failed, "
           f"{sum(r['status'] == 'not run' for r in rows)} not run; {cases} cases in {seconds:.1f}s of search", ""]
    versions = data.get("versions") or {}
    if versions.get("sglang"):
        commit = f" (checkout {versions['sglang-commit']})" if versions.get("sglang-commit") else ""
        out += [f"engine: SGLang {versions['sglang']}{commit}", ""]
    sweep = data.get("sweep")
    if sweep:
        out += [f"sweep: budget {sweep['budget_s']:.0f}s, {sweep['elapsed_s']:.0f}s spent, rounds "
                f"{sweep['rounds'][0]}-{sweep['rounds'][1]}, {sweep['workers']} worker(s), shard "
                f"{sweep['shard'] or 'all'}, seed {sweep['seed']}"
                + (f", mutant `{sweep['mutant']}`" if sweep.get("mutant") else "")
                + (", **interrupted**" if sweep.get("interrupted") else ""), ""]
    findings = data.get("findings")
    if findings is None:
        findings = [{"kind": r["status"] if finding_kind(r["status"]) != ADAPTER_ERROR else ADAPTER_ERROR,
                     "row": r["row"], "reason": r["failure"], "case_file": r["case_file"]} for r in failed]
    adapter_errors = [f for f in findings if f["kind"] == ADAPTER_ERROR]
    findings = [f for f in findings if f["kind"] != ADAPTER_ERROR]
    if adapter_errors:  # the harness's own failures around the engine's classes: never the engine's findings
        out += ["## Adapter errors (the harness's, not the engine's: exit status 3 when nothing else failed)", "",
                "| row | reason | case |", "|---|---|---|"]
        out += [f"| {f.get('row') or f.get('composition')} | "
                f"{(f.get('reason') or '').replace('|', chr(92) + '|').replace(chr(10), ' ')} | "
                f"{f.get('case_file') or '-'} |" for f in adapter_errors] + [""]
    out += ["## Findings", ""]
    if findings:
        by_id = {r["row"]: r for r in rows}
        out += ["| kind | row | worst / bound (×ratio) at | reason (with the tolerance applied) | reproduce |",
                "|---|---|---|---|---|"]
        for f in findings:
            repro = f"`python -m harness repro {f['case_file']}`" if f.get("case_file") else "-"
            reason = _cell_text(f.get("reason") or "")
            badly = how_badly(by_id.get(f.get("row"))).replace("|", "\\|")
            out.append(f"| {f['kind']} | {f.get('row') or f.get('composition')} | {badly} | {reason} | {repro} |")
    else:
        out.append("none")
    by_prop, by_mode = defaultdict(list), defaultdict(list)
    for r in rows:
        by_prop[r["composition"], r["property"]].append(r)
        by_mode[r["composition"], r["mode"]].append(r)
    known = [(r["row"], k, n, (r.get("steered") or {}).get(k, 0)) for r in rows for k, n in (r.get("known") or {}).items()]
    if known:
        out += ["", "## Known failures (docs/findings/known-failures.toml)", "",
                "Cases that failed exactly as a ledger entry describes: triaged and reported upstream, so not findings. "
                "Once a row has met an entry, its later draws with what that bug needs are not run (`not run`): the "
                "search goes to the rest of the row's batches.",
                "", "| row | ledger entry | cases | not run |", "|---|---|---:|---:|"]
        out += [f"| {row} | `{k}` | {n} | {m} |" for row, k, n, m in known]
    alone = [(r["row"], c) for r in rows for c in r.get("passed_alone_cases") or ()]
    if alone:
        out += ["", "## Failures that passed alone in a fresh process", "",
                "Found on CUDA where something else may have caused them, then replayed alone in fresh processes, "
                "passing every time (or failing only as a ledger entry describes): not findings. The cause is a "
                "ledger entry whose stray writes that process's earlier batches reached, or `mps-fault`: a CUDA "
                "error in a client of an MPS daemon (`--mps`), which any worker's GPU fault reaches, replayed outside "
                "MPS. Each case is kept, with what its replays printed beside it (`CASE.alone.log`).",
                "", "| row | cause | the failure | its case |", "|---|---|---|---|"]
        out += [f"| {row} | `{c['entry']}` | {_cell_text(c['reason'])} | `{c['case']}` |" for row, c in alone]
    out += ["", "## Pass/fail: composition x property (over modes)", "",
            "Each cell counts the rows (one per mode) that ran: `ok (N)` all N passed, `**FAILED** (F/N)` F of N "
            "had a finding; rows that did not run (a stopped or short run) are counted apart as `not run`; "
            "`-`: no such row.", "",
            "| composition | " + " | ".join(props) + " |", "|---|" + "---|" * len(props)]
    out += [f"| {c} | " + " | ".join(_cell(by_prop[c, p]) for p in props) + " |" for c in comps]
    if "pass_fail.png" in plot_names:
        out += ["", "![pass/fail](pass_fail.png)"]
    out += ["", "## Worst error / bound: composition x mode (over properties; above 1 fails)", "",
            "| composition | " + " | ".join(modes) + " |", "|---|" + "---|" * len(modes)]
    for c in comps:
        cells = []
        for m in modes:
            ratios = [x for x in (_ratio(r) for r in by_mode[c, m]) if x is not None]
            cells.append(f"{max(ratios):.3f}" if ratios else "-")
        out.append(f"| {c} | " + " | ".join(cells) + " |")
    if "worst_error.png" in plot_names:
        out += ["", "![worst error / bound](worst_error.png)"]
    at_risk = [r for r in rows if row_at_risk(r)]
    known_near = defaultdict(int)
    for r in rows:
        for k, n in (r.get("near_misses_known") or {}).items():
            known_near[k] += n
    out += ["", f"## Headroom: the largest error / bound on passing cases (relative L2 / element; above "
                f"{AT_RISK_RATIO:g}: at risk)", "",
            "A bound that correct code comes close to is a false finding waiting to happen, or a sign that the bound "
            "is right and the code is not. A passing case that a ledger entry explains (a known bug's mild instance) "
            "is counted in the table but does not put its row at risk.", ""]
    out += ([f"**At risk** ({len(at_risk)} row(s)):", ""]
            + [f"- `{r['row']}`: " + ", ".join(f"{c} {unexplained_headroom(r)[c]:.2f}" for c in row_at_risk(r))
               for r in at_risk] + [""]) if at_risk else ["No row at risk.", ""]
    if known_near:
        out += ["Near misses explained by the ledger: " + ", ".join(f"`{k}` {n} case(s)" for k, n in known_near.items()),
                ""]
    out += ["| composition | " + " | ".join(props) + " |", "|---|" + "---|" * len(props)]
    out += [f"| {c} | " + " | ".join(headroom_cell(by_prop[c, p]) for p in props) + " |" for c in comps]
    out += ["", "## Throughput", "", "| composition | cases | seconds | cases/s |", "|---|---:|---:|---:|"]
    for c, n, s in throughput(rows):
        out.append(f"| {c} | {n} | {s:.1f} | {n / s if s else 0:.2f} |")
    if "cases_per_second.png" in plot_names:
        out += ["", "![cases per second](cases_per_second.png)"]
    if data["unavailable"]:
        out += ["", "## Unavailable here", ""] + [f"- `{u['composition']}`: {u['reason']}" for u in data["unavailable"]]
    return "\n".join(out) + "\n"


def campaign_markdown(reports: list[tuple[str, dict]]) -> str:
    """Several runs' ``report.json`` (each named by where it came from) as one table per device: per composition,
    the cases checked, the findings (rows that failed) and the known failures matched, then the largest headroom
    ratio per property over the composition's passing cases (relative L2 / element; bold: at risk)."""
    out = ["| run | device | profile | SGLang | rows | unavailable | cases | findings | adapter errors | known | at risk |",
           "|---|---|---|---|---:|---:|---:|---:|---:|---:|---:|"]
    for name, data in reports:
        rows = data["rows"]
        versions = data.get("versions") or {}
        engine = (versions.get("sglang") or "-") + (f" @{versions['sglang-commit']}" if versions.get("sglang-commit")
                                                    else "")
        adapter = sum(finding_kind(r["status"]) == ADAPTER_ERROR for r in rows)
        out.append(f"| {name} | {data['device']} | {data['profile']} | {engine} | {len(rows)} | "
                   f"{len(data.get('unavailable') or [])} | {sum(r['cases'] for r in rows)} | "
                   f"{sum(not r['ok'] for r in rows) - adapter} | {adapter} | "
                   f"{sum(sum((r.get('known') or {}).values()) for r in rows)} | {sum(bool(row_at_risk(r)) for r in rows)} |")
    for device in dict.fromkeys(data["device"] for _, data in reports):
        rows = [r for _, data in reports if data["device"] == device for r in data["rows"]]
        props = list(dict.fromkeys(r["property"] for r in rows))
        comps = list(dict.fromkeys(r["composition"] for r in rows))
        by_comp, by_cell = defaultdict(list), defaultdict(list)
        for r in rows:
            by_comp[r["composition"]].append(r)
            by_cell[r["composition"], r["property"]].append(r)
        out += ["", f"### {device}: per composition (headroom: relative L2 / element, largest over passing cases)", "",
                "| composition | cases | findings | known | " + " | ".join(props) + " |",
                "|---|---:|---:|---:|" + "---|" * len(props)]
        for c in comps:
            rs = by_comp[c]
            out.append(f"| {c} | {sum(r['cases'] for r in rs)} | {sum(not r['ok'] for r in rs)} | "
                       f"{sum(sum((r.get('known') or {}).values()) for r in rs)} | "
                       + " | ".join(headroom_cell(by_cell[c, p]) if by_cell[c, p] else "-" for p in props) + " |")
        out += ["", "| property | " + " | ".join(CHECKS) + " |", "|---|" + "---:|" * len(CHECKS)]
        for p in props:
            heads = [r.get("headroom") or {} for r in rows if r["property"] == p]
            out.append(f"| {p} | " + " | ".join(f"{max([h.get(c, 0.0) for h in heads] or [0.0]):.3f}"
                                                for c in CHECKS) + " |")
    findings = [(name, f) for name, data in reports for f in data.get("findings") or
                [{"kind": r["status"], "row": r["row"], "reason": r["failure"]} for r in data["rows"] if not r["ok"]]]
    out += ["", "### Findings", ""] + ([f"- {name}: {f['kind']} `{f.get('row')}`: {f.get('reason')}"
                                        for name, f in findings] or ["none"])
    return "\n".join(out) + "\n"


def print_summary(results, skipped, seconds: float) -> None:
    print()
    comp_w = max([len(r.composition) for r in results] + [11])
    print(f"{'composition':<{comp_w}} {'mode':<13} {'property':<20} {'cases':>5} {'worst/bound':>11}  status")
    for r in results:
        ratio = "-" if r.worst_error is None else f"{r.worst_error / r.bound:.3f}"
        risk = "".join(f" (AT RISK: {c} {r.unexplained[c]:.2f})" for c in r.at_risk)
        print(f"{r.composition:<{comp_w}} {r.mode:<13} {r.property:<20} {r.cases:>5} {ratio:>11}  "
              f"{'ok' if r.status == 'passed' else r.status.upper()}{risk}")
    for comp, why in skipped:
        print(f"{comp:<{comp_w}} unavailable: {why}")
    failed = [r for r in results if not r.ok]
    not_run = sum(r.status == "not run" for r in results)
    cases = sum(r.cases for r in results)
    print(f"\n{len(results) - len(failed) - not_run} passed, {len(failed)} failed, "
          f"{f'{not_run} not run, ' if not_run else ''}{len(skipped)} unavailable: {cases} cases in {seconds:.1f}s")
    for r in failed:
        print(f"FAILED {r.row_id}: {r.headline()}")  # the full reason, tolerance included: report.md
        if r.case_file:
            print(f"  reproduce: python -m harness repro {r.case_file}")
