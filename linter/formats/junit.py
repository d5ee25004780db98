"""JUnit XML: one test case per finding (a failure), or one passing case when there are none."""

from __future__ import annotations

import xml.etree.ElementTree as ET

from linter.runner import LintReport


def render(report: LintReport, statistics_table: bool = False, color: bool = False) -> str:
    suites = ET.Element("testsuites", name="prefixgate lint")
    count = max(1, len(report.findings))
    suite = ET.SubElement(
        suites, "testsuite", name="prefixgate lint", tests=str(count), failures=str(len(report.findings)), errors="0", skipped="0"
    )
    if not report.findings:
        ET.SubElement(suite, "testcase", classname="prefixgate.lint", name="no findings")
    for f in report.findings:
        case = ET.SubElement(suite, "testcase", classname=f.path, name=f"{f.code} {f.location} (line {f.line or 1})")
        failure = ET.SubElement(case, "failure", message=f.message, type=f.code)
        failure.text = f"{f.path}:{f.line or 1}:{f.column or 1}: {f.severity} {f.code} {f.message}"
    ET.indent(suites)
    return '<?xml version="1.0" encoding="UTF-8"?>\n' + ET.tostring(suites, encoding="unicode") + "\n"
