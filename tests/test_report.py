"""The report tells the truth: cells count only the rows that ran, the plots explain their colours, the
worst-error scale tells 1.01 from 9e5, and a failure's summary line says how badly and where first."""

from __future__ import annotations

from pathlib import Path

from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

from harness.plots import GREEN, RED, _verdict, pass_fail_figure, worst_error_figure, write_plots
from harness.report import markdown, print_summary, write_reports
from properties.tolerances import output_bound
from properties.verdict import Verdict
from search.outcome import RowOutcome


def rec(comp: str, mode: str, prop: str, status: str, err: float | None = None, bound: float | None = None) -> dict:
    ran = status != "not run"
    return {"row": f"{comp}-{mode}-{prop}", "composition": comp, "mode": mode, "property": prop,
            "ok": status in ("passed", "not run"), "status": status, "rounds": 1, "cases": 4 if ran else 0,
            "seconds": 1.0 if ran else 0.0, "worst_error": err, "bound": bound, "failure": None, "case_file": None}


MODES = ("extend", "decode", "mixed", "idle", "target_verify", "draft_extend")
ONE_RAN = [rec("torch_native", "extend", "metadata", "passed")] + \
          [rec("torch_native", m, "metadata", "not run") for m in MODES[1:]]


def test_a_cell_with_one_row_passed_and_five_not_run_is_not_ok_6():
    md = markdown({"device": "cpu", "profile": "ci", "rows": ONE_RAN, "unavailable": []}, [])
    line = next(x for x in md.splitlines() if x.startswith("| torch_native |"))
    assert "ok (6)" not in line and "ok (1), 5 not run" in line
    colour, label = _verdict(ONE_RAN)
    assert colour != GREEN and "5 not run" in label
    failed = [rec("torch_native", "extend", "outputs", "failed", 1.0, 0.5),
              rec("torch_native", "decode", "outputs", "passed"), rec("torch_native", "mixed", "outputs", "not run")]
    md = markdown({"device": "cpu", "profile": "ci", "rows": failed, "unavailable": []}, [])
    assert "**FAILED** (1/2), 1 not run" in md
    assert _verdict(failed) == (RED, "failed 1/2\n1 not run")
    assert _verdict([rec("torch_native", m, "metadata", "passed") for m in MODES]) == (GREEN, "ok 6")


def test_pass_fail_has_a_legend_for_every_colour():
    fig = pass_fail_figure(Figure, ONE_RAN + [rec("tbo(torch_native)", "extend", "outputs", "passed")],
                           ["torch_native", "tbo(torch_native)"])
    labels = [t.get_text() for legend in fig.legends for t in legend.get_texts()]
    assert any("not run" == x for x in labels) and any("not applicable" in x for x in labels)
    assert any(x.startswith("ok: every row") for x in labels) and any("finding" in x for x in labels)


def test_worst_error_uses_a_log_scale_and_its_colorbar_label_fits():
    rows = [rec("torch_native", "extend", "outputs", "failed", 9e5, 1.0),
            rec("torch_native", "decode", "outputs", "failed", 1.01, 1.0)]
    fig = worst_error_figure(Figure, rows, ["torch_native"])  # one row: the figure where the label was cut
    image = fig.axes[0].images[0]
    assert image.norm(1.0) == 0.5 or abs(image.norm(1.0) - 0.5) < 1e-9  # 1, where rows fail, in the middle
    assert image.cmap(image.norm(1.01)) != image.cmap(image.norm(9e5))
    assert image.norm(9e5) > 0.9 and image.norm(1.01) < 0.55
    canvas = FigureCanvasAgg(fig)
    canvas.draw()  # lays the figure out as savefig does
    renderer = canvas.get_renderer()
    colorbar_ax = fig.axes[1]
    label = colorbar_ax.xaxis.label if colorbar_ax.xaxis.label.get_text() else colorbar_ax.yaxis.label
    assert "worst error / bound" in label.get_text()
    box, page = label.get_window_extent(renderer), fig.bbox
    assert page.x0 <= box.x0 and box.x1 <= page.x1 and page.y0 <= box.y0 and box.y1 <= page.y1


def _failed_outcome() -> RowOutcome:
    bound = output_bound("float32", 2, inner_dim=32)
    verdict = Verdict("outputs", False, f"outputs and states vs float64 reference: out of bounds ({bound.reason})",
                      0.21, 6.6e-07, "layer 0: request 0, token 1, head 3", {"bound": bound})
    return RowOutcome("torch_native-extend-outputs", "torch_native", "extend", "outputs", cases=5, ok=False,
                      worst_error=0.21, bound=6.6e-07, failure=verdict, finding_kind="failure",
                      case_file="OUT/cases/x.json")


def test_the_failed_line_leads_with_how_badly_and_where(capsys, tmp_path):
    result = _failed_outcome()
    print_summary([result], [], 1.0)
    line = next(x for x in capsys.readouterr().out.splitlines() if x.startswith("FAILED "))
    assert line.startswith("FAILED torch_native-extend-outputs: 0.21 / bound 6.6e-07 (×3.18e+05) "
                           "at layer 0: request 0, token 1, head 3"), line
    assert "sqrt(L)" not in line  # the tolerance's formula is in report.md
    write_reports([result], [], tmp_path, "cpu", "ci")
    md = (tmp_path / "report.md").read_text()
    assert "sqrt(L)" in md and "0.21 / 6.6e-07 (×3.18e+05) at layer 0: request 0, token 1, head 3" in md


def test_plots_are_written(tmp_path):
    paths = write_plots(ONE_RAN, Path(tmp_path))
    assert [p.name for p in paths] == ["pass_fail.png", "worst_error.png", "cases_per_second.png"]


def test_known_failures_are_listed_apart(tmp_path):
    from harness.report import markdown
    row = {"row": "sglang.triton-decode-outputs", "composition": "sglang.triton", "mode": "decode",
           "property": "outputs", "ok": True, "status": "passed", "rounds": 1, "cases": 4, "seconds": 1.0,
           "worst_error": None, "bound": None, "failure": None, "case_file": None,
           "known": {"sglang-triton-swa-decode-one-key-short": 2}}
    text = markdown({"device": "cpu", "profile": "ci", "rows": [row], "unavailable": []}, [])
    assert "## Known failures" in text and "| sglang.triton-decode-outputs | `sglang-triton-swa-decode-one-key-short` | 2 |" in text


def test_rows_near_their_bound_are_marked_at_risk_in_the_report_and_the_campaign_table(tmp_path, capsys):
    import json

    from harness.cli import main
    safe = rec("torch_native", "extend", "outputs", "passed", 1e-7, 1e-6) | {"headroom": {"rel_l2": 0.1, "element": 0.2}}
    risky = rec("torch_native", "decode", "outputs", "passed", 6e-7, 1e-6) | {"headroom": {"rel_l2": 0.6, "element": 0.1}}
    data = {"device": "cpu", "profile": "ci", "rows": [safe, risky], "unavailable": []}
    md = markdown(data, [])
    assert "**At risk** (1 row(s))" in md and "- `torch_native-decode-outputs`: rel_l2 0.60" in md
    assert "| torch_native | **0.60** / 0.20 |" in md  # the composition x property cell: largest of each check
    assert "No row at risk." in markdown({**data, "rows": [safe]}, [])
    (tmp_path / "a").mkdir()
    (tmp_path / "a" / "report.json").write_text(json.dumps(data))
    assert main(["summarize", str(tmp_path / "a")]) == 0
    table = capsys.readouterr().out
    assert f"| {tmp_path / 'a'} | cpu | ci | - | 2 | 0 | 8 | 0 | 0 | 0 | 1 |" in table
    assert "| torch_native | 8 | 0 | 0 | **0.60** / 0.20 |" in table and "| outputs | 0.600 | 0.200 |" in table
    assert main(["summarize", str(tmp_path / "missing")]) == 2  # bad input: one line, exit 2
    assert "not a harness report" in capsys.readouterr().err


def test_junit_has_a_case_per_row_and_a_finding_says_how_to_replay_it(tmp_path, monkeypatch):
    import xml.etree.ElementTree as ET

    summary = tmp_path / "summary.md"
    monkeypatch.setenv("GITHUB_STEP_SUMMARY", str(summary))
    failed = RowOutcome("torch_native-decode-outputs", "torch_native", "decode", "outputs", cases=3, seconds=2.0,
                        ok=False, finding_kind="failure", case_file="harness-out/cases/x.json",
                        failure=Verdict("outputs", False, "out of bounds", worst_error=1.0, bound=0.5,
                                        where="layer 0: request 1", check="element"))
    adapter = RowOutcome("sglang.triton-extend-cache", "sglang.triton", "extend", "cache", cases=1, ok=False,
                         finding_kind="adapter_error", failure="adapter error: KeyError: 'x'")
    known = RowOutcome("sglang.triton-decode-outputs", "sglang.triton", "decode", "outputs", cases=4,
                       known={"sglang-triton-swa-decode-one-key-short": 2})
    not_run = RowOutcome("torch_native-idle-outputs", "torch_native", "idle", "outputs")
    paths = write_reports([failed, adapter, known, not_run], [("sglang.fa3", "needs sgl_kernel")], tmp_path,
                          "cpu", "ci")
    assert tmp_path / "junit.xml" in paths
    suite = ET.parse(tmp_path / "junit.xml").getroot()
    assert (suite.get("tests"), suite.get("failures"), suite.get("errors"), suite.get("skipped")) == ("5", "1", "1", "2")
    cases = {(c.get("classname"), c.get("name")): c for c in suite.iter("testcase")}
    fail = cases["harness.torch_native", "decode-outputs"].find("failure")
    assert fail.get("message").startswith("element error 1 / bound 0.5 (×2) at layer 0: request 1")
    assert fail.text.endswith("reproduce: python -m harness repro harness-out/cases/x.json")
    assert cases["harness.sglang.triton", "extend-cache"].find("error").get("type") == "adapter_error"
    assert "swa-decode-one-key-short" in cases["harness.sglang.triton", "decode-outputs"].find("system-out").text
    assert cases["harness.sglang.triton", "decode-outputs"].find("failure") is None
    assert cases["harness.torch_native", "idle-outputs"].find("skipped") is not None
    assert cases["harness.sglang.fa3", "unavailable"].find("skipped").get("message") == "needs sgl_kernel"
    assert summary.read_text().startswith("# Harness report")  # the job summary under GitHub Actions
