"""Checks the harness docs: required files, AGENTS.md links, milestones, markers, histories.

Run by `make check` (scripts/check) and by tests/test_harness.py. Standard library only.
Prints one line per problem and exits 1 when there is any, 0 otherwise.
Usage: python scripts/check_docs.py [REPO_ROOT]   (default: the repository of this script)
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent  # replaced by the REPO_ROOT argument

REQUIRED_FILES = [
    "AGENTS.md",
    "CLAUDE.md",
    "README.md",
    "docs/ARCHITECTURE.md",
    "docs/REPO_COLLAB_GUIDE.md",
    "docs/HISTORY_GUIDE.md",
    "docs/MILESTONES_GUIDE.md",
    "docs/RELIABILITY.md",
    "docs/SECURITY.md",
    "docs/index.md",
    "milestones/README.md",
    "histories/template.md",
]
# Files whose relative markdown links must resolve.
LINKED_FILES = ["AGENTS.md", "CLAUDE.md", "README.md", "milestones/README.md"]

MILESTONE_SECTIONS = [
    "Status",
    "Goal",
    "Why",
    "Scope",
    "Out of scope",
    "Acceptance criteria",
    "TODO",
    "Validation log",
]
MILESTONE_STATUSES = ("planned", "in progress", "done")
HISTORY_SECTIONS = ["Task", "Context", "Changes", "Design intent", "Files", "Validation"]

MILESTONE_FILE_RE = re.compile(r"^m(\d{2})-[a-z0-9]+(?:-[a-z0-9]+)*\.md$")
HISTORY_FILE_RE = re.compile(r"^(\d{4})(\d{2})\d{2}-\d{4}-[a-z0-9]+(?:-[a-z0-9]+)*\.md$")
LINK_RE = re.compile(r"\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")
MARKER_RE = re.compile(r"mark\.milestone\(\s*[\"']([^\"']*)[\"']")
INDEX_ROW_RE = re.compile(r"^\|\s*(m\d{2})\s*\|(.*)\|\s*$")


def rel(path: Path) -> str:
    return path.relative_to(ROOT).as_posix()


def sections(text: str) -> dict[str, str]:
    """Maps each `## Heading` to the text under it (up to the next `## `)."""
    found: dict[str, str] = {}
    current = None
    for line in text.splitlines():
        if line.startswith("## "):
            current = line[3:].strip()
            found[current] = ""
        elif current is not None:
            found[current] += line + "\n"
    return found


def check_required_files(errors: list[str]) -> None:
    for name in REQUIRED_FILES:
        if not (ROOT / name).is_file():
            errors.append(f"{name}: required file is missing")


def check_links(errors: list[str]) -> None:
    for name in LINKED_FILES:
        path = ROOT / name
        if not path.is_file():
            continue
        for target in LINK_RE.findall(path.read_text()):
            if re.match(r"^[a-z]+:", target) or target.startswith("#"):
                continue
            target_path = (path.parent / target.split("#", 1)[0]).resolve()
            must_be_file = name == "AGENTS.md"
            ok = target_path.is_file() if must_be_file else target_path.exists()
            if not ok:
                errors.append(f"{name}: link target does not exist: {target}")


def read_milestones(errors: list[str]) -> dict[str, tuple[Path, str]]:
    """Checks every milestone file; returns {id: (path, status)}."""
    milestones: dict[str, tuple[Path, str]] = {}
    for path in sorted((ROOT / "milestones").glob("*.md")):
        if path.name == "README.md":
            continue
        match = MILESTONE_FILE_RE.match(path.name)
        if not match:
            errors.append(f"{rel(path)}: name must be mNN-<slug>.md (lowercase, zero-padded)")
            continue
        milestone_id = f"m{match.group(1)}"
        if milestone_id in milestones:
            errors.append(f"{rel(path)}: id {milestone_id} is used by another milestone file")
            continue
        text = path.read_text()
        first_line = text.splitlines()[0] if text else ""
        if not first_line.startswith(f"# {milestone_id} "):
            errors.append(f"{rel(path)}: first line must be '# {milestone_id} <title>'")
        found = sections(text)
        headings = [h for h in found if h in MILESTONE_SECTIONS]
        missing = [s for s in MILESTONE_SECTIONS if s not in found]
        if missing:
            errors.append(
                f"{rel(path)}: missing sections: " + ", ".join(f"## {s}" for s in missing)
            )
        elif headings != MILESTONE_SECTIONS:
            errors.append(
                f"{rel(path)}: sections must be in order: " + ", ".join(MILESTONE_SECTIONS)
            )
        status_lines = [
            line.strip() for line in found.get("Status", "").splitlines() if line.strip()
        ]
        status = status_lines[0] if status_lines else ""
        if status not in MILESTONE_STATUSES:
            errors.append(
                f"{rel(path)}: ## Status must be one of {', '.join(MILESTONE_STATUSES)}, "
                f"got {status!r}"
            )
        todo = found.get("TODO", "")
        if "TODO" in found and not re.search(r"^- \[[ x]\] ", todo, re.MULTILINE):
            errors.append(f"{rel(path)}: ## TODO must list markdown checkboxes (- [ ] ...)")
        if status == "done":
            if re.search(r"^- \[ \] ", todo, re.MULTILINE):
                errors.append(
                    f"{rel(path)}: status is done but ## TODO has unchecked boxes "
                    "(check them or move them to a later milestone)"
                )
            if not re.search(r"^- ", found.get("Validation log", ""), re.MULTILINE):
                errors.append(f"{rel(path)}: status is done but ## Validation log has no entry")
        milestones[milestone_id] = (path, status)
    if not milestones:
        errors.append("milestones/: no milestone files found")
    return milestones


def check_milestone_index(errors: list[str], milestones: dict[str, tuple[Path, str]]) -> None:
    index = ROOT / "milestones" / "README.md"
    if not index.is_file():
        return
    rows: dict[str, str] = {}
    for line in index.read_text().splitlines():
        match = INDEX_ROW_RE.match(line.strip())
        if match:
            rows[match.group(1)] = match.group(2)
    for milestone_id, (path, status) in milestones.items():
        row = rows.get(milestone_id)
        if row is None:
            errors.append(f"milestones/README.md: no index row for {milestone_id} ({path.name})")
            continue
        cells = [cell.strip() for cell in row.split("|")]
        if len(cells) < 3 or cells[1] != status:
            errors.append(
                f"milestones/README.md: {milestone_id} row must show status {status!r} "
                f"(as in {path.name}), got {cells[1] if len(cells) > 1 else ''!r}"
            )
        if f"({path.name})" not in row:
            errors.append(f"milestones/README.md: {milestone_id} row must link to {path.name}")
    for milestone_id in rows:
        if milestone_id not in milestones:
            errors.append(f"milestones/README.md: row {milestone_id} has no milestone file")


def check_markers(errors: list[str], milestones: dict[str, tuple[Path, str]]) -> None:
    used: dict[str, list[str]] = {}
    tests_dir = ROOT / "tests"
    for path in sorted(tests_dir.rglob("test_*.py")) if tests_dir.is_dir() else []:
        for name in MARKER_RE.findall(path.read_text()):
            used.setdefault(name, []).append(rel(path))
    for name, paths in sorted(used.items()):
        if name not in milestones:
            errors.append(
                f"{paths[0]}: milestone marker {name!r} names no file milestones/{name}-*.md"
            )
    for milestone_id, (path, status) in sorted(milestones.items()):
        if status == "done" and milestone_id not in used:
            errors.append(
                f"{rel(path)}: status is done but no test carries "
                f'@pytest.mark.milestone("{milestone_id}")'
            )


def check_histories(errors: list[str]) -> None:
    histories = ROOT / "histories"
    for path in sorted(histories.rglob("*.md")):
        if path == histories / "template.md":
            continue
        match = HISTORY_FILE_RE.match(path.name)
        parent = path.parent.relative_to(histories).as_posix()
        if not match:
            errors.append(f"{rel(path)}: name must be YYYYMMDD-HHmm-<slug>.md")
            continue
        if parent != f"{match.group(1)}-{match.group(2)}":
            errors.append(f"{rel(path)}: must live in histories/{match.group(1)}-{match.group(2)}/")
        missing = [s for s in HISTORY_SECTIONS if s not in sections(path.read_text())]
        if missing:
            errors.append(
                f"{rel(path)}: missing sections: " + ", ".join(f"## {s}" for s in missing)
            )


def check_docs_nav(errors: list[str]) -> None:
    mkdocs_yml = ROOT / "mkdocs.yml"
    if not mkdocs_yml.is_file():
        errors.append("mkdocs.yml: required file is missing")
        return
    nav_text = mkdocs_yml.read_text()
    for path in sorted((ROOT / "docs").rglob("*.md")):
        page = path.relative_to(ROOT / "docs").as_posix()
        if not re.search(rf"[\s:]{re.escape(page)}\s*$", nav_text, re.MULTILINE):
            errors.append(f"mkdocs.yml: docs page {page} is not listed in nav")


def main(argv: list[str]) -> int:
    global ROOT
    if argv:
        ROOT = Path(argv[0]).resolve()
    errors: list[str] = []
    check_required_files(errors)
    check_links(errors)
    milestones = read_milestones(errors)
    check_milestone_index(errors, milestones)
    check_markers(errors, milestones)
    check_histories(errors)
    check_docs_nav(errors)
    for error in errors:
        print(f"check_docs: {error}")
    if errors:
        print(f"check_docs: {len(errors)} problem(s) found")
        return 1
    print(f"check_docs: ok ({len(milestones)} milestones)")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
