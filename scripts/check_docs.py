"""Checks the harness docs: required files, AGENTS.md links, milestones, markers, histories,
and that the docs stay true: no "planned"/"pending"/"not built yet" wording about a milestone
that is done, a history entry for every commit since the marker in histories/checked-since
(or a line in histories/trivial-commits.txt), and provenance in every benchmark JSON under
docs/ (bench/provenance.py) but the older ones listed in docs/assets/bench/without-provenance.txt,
no checked milestone box whose own text says it "no longer" holds or is "not met", and no
feature page saying two features do not run together where the compatibility matrix
(scripts/compat_matrix.py) says they work, and the performance table of README.md and
docs/index.md as scripts/perf_glance.py generates it.

Run by `make check` (scripts/check) and by tests/test_harness.py, tests/test_docs_checks.py.
Standard library only (and `git`, when the repository's history is there: without it, or in
a shallow clone that lacks the marker commit, the history check says so and is skipped).
Prints one line per problem and exits 1 when there is any, 0 otherwise.
Usage: python scripts/check_docs.py [REPO_ROOT]   (default: the repository of this script)
"""

from __future__ import annotations

import importlib.util
import json
import re
import subprocess
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

# Wording that says a thing does not exist yet; an error next to a milestone that is done.
STALE_RE = re.compile(
    r"\bplanned\b|\b(?:is|are|still|stays?|remains?)\s+\**pending\b|\bpending\s+(?:until|on)\b"
    r"|\bnot (?:built|implemented|done) yet\b|\bnot yet (?:built|implemented)\b",
    re.IGNORECASE,
)
MILESTONE_ID_RE = re.compile(r"\bm(\d{2})(?:\s*(?:-|–|to)\s*m(\d{2}))?\b")
SENTENCE_END_RE = re.compile(r"(?<=[.!?])\s+(?=[A-Z(`*])")
# Title words too common to stand for their milestone in a sentence.
GENERIC_TITLE_PHRASES = {"foundation", "setup", "packaging", "benchmarks", "the generate command"}
HISTORY_MARKER = "histories/checked-since"
TRIVIAL_COMMITS = "histories/trivial-commits.txt"
BENCH_PROVENANCE_KEYS = ("git", "date", "cpu_model", "cores", "command")
BENCH_WITHOUT_PROVENANCE = "docs/assets/bench/without-provenance.txt"
GIT_REVISION_RE = re.compile(r"^[0-9a-f]{7,40}(-dirty)?$")


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


def _title_phrases(path: Path) -> list[str]:
    """`# m13 Router and cluster` -> ["router", "cluster"]: the phrases of a milestone's
    title a sentence can name it by."""
    text = path.read_text()
    title = re.sub(r"^#\s*m\d{2}\s*[—–-]?\s*", "", text.splitlines()[0] if text else "")
    phrases = re.split(r",|:|\band\b|\(|\)", title.lower())
    return [p.strip() for p in phrases if p.strip() and p.strip() not in GENERIC_TITLE_PHRASES]


def _prose_units(text: str) -> list[tuple[int, str]]:
    """(line number, sentence) of a markdown text outside code blocks: a table row or list
    item is one unit, a paragraph is split into sentences."""
    units: list[tuple[int, str]] = []
    paragraph: list[str] = []
    start, in_code = 0, False

    def flush() -> None:
        if paragraph:
            for sentence in SENTENCE_END_RE.split(" ".join(paragraph)):
                units.append((start, sentence))
            paragraph.clear()

    for number, line in enumerate(text.splitlines(), 1):
        stripped = line.strip()
        if stripped.startswith(("```", "~~~")):
            flush()
            in_code = not in_code
            continue
        if in_code:
            continue
        if not stripped or stripped.startswith(("|", "#")):
            flush()
            if stripped:
                units.append((number, stripped))
            continue
        if re.match(r"^([-*+]|\d+\.)\s", stripped) or not paragraph:
            flush()
            start = number
        paragraph.append(stripped)
    flush()
    return units


def stale_wording(text: str, milestones: dict[str, tuple[Path, str]]) -> list[tuple[int, str]]:
    """(line, message) for each sentence of `text` that calls a done milestone's work
    planned, pending or not built yet (by its id, a range of ids, or its title's words)."""
    done = {mid: path for mid, (path, status) in milestones.items() if status == "done"}
    phrases = {mid: _title_phrases(path) for mid, path in done.items()}
    found = []
    for number, sentence in _prose_units(text):
        stale = STALE_RE.search(sentence)
        if not stale:
            continue
        named = set()
        for first, last in MILESTONE_ID_RE.findall(sentence):
            named |= {f"m{n:02d}" for n in range(int(first), int(last or first) + 1)}
        lowered = sentence.lower()
        for mid, words in phrases.items():
            if any(re.search(rf"\b{re.escape(w)}", lowered) for w in words):
                named.add(mid)
        named &= set(done)
        if named:
            ids = ", ".join(sorted(named))
            found.append(
                (number, f"says {stale.group(0)!r} about {ids} (done): {sentence[:100]!r}")
            )
    return found


def check_stale_wording(errors: list[str], milestones: dict[str, tuple[Path, str]]) -> None:
    pages = [ROOT / "README.md", ROOT / "AGENTS.md", *sorted((ROOT / "docs").rglob("*.md"))]
    for path in pages:
        if path.is_file():
            for number, message in stale_wording(path.read_text(), milestones):
                errors.append(f"{rel(path)}:{number}: {message}")


def _git(*args: str) -> str | None:
    try:
        done = subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return done.stdout if done.returncode == 0 else None


def commits_without_history(marker: str, trivial: set[str]) -> list[str] | None:
    """'hash subject' of each commit after `marker` (merges aside) that adds no history
    file and is not listed as trivial; None when the history is not available."""
    if _git("cat-file", "-e", f"{marker}^{{commit}}") is None:
        return None
    log = _git("log", "--reverse", "--no-merges", "--format=%H %s", f"{marker}..HEAD")
    if log is None:
        return None
    missing = []
    for line in log.splitlines():
        commit, _, subject = line.partition(" ")
        if any(commit.startswith(t) for t in trivial):
            continue
        added = _git("diff-tree", "--no-commit-id", "-r", "--name-only", "--diff-filter=A",
                     commit, "--", "histories/")  # fmt: skip
        if not any(
            name.endswith(".md") and not name.endswith("template.md")
            for name in (added or "").splitlines()
        ):
            missing.append(f"{commit[:7]} {subject}")
    return missing


def check_commit_histories(errors: list[str]) -> None:
    marker_file = ROOT / HISTORY_MARKER
    if not marker_file.is_file():
        errors.append(f"{HISTORY_MARKER}: required file is missing (the first commit checked)")
        return
    marker = marker_file.read_text().split()[0]
    trivial_file = ROOT / TRIVIAL_COMMITS
    trivial = set()
    if trivial_file.is_file():
        for line in trivial_file.read_text().splitlines():
            if line.strip() and not line.startswith("#"):
                trivial.add(line.split()[0])
    missing = commits_without_history(marker, trivial)
    if missing is None:
        print(f"check_docs: note: no git history back to {marker[:7]} here (a shallow clone?); "
              "the history-per-commit check is skipped")  # fmt: skip
        return
    for commit in missing:
        errors.append(
            f"commit {commit!r} has no history entry: add one in that commit "
            f"(scripts/new-history) or list it in {TRIVIAL_COMMITS} (a docs typo, formatting)"
        )


def bench_provenance_problem(record: object) -> str | None:
    """Why a benchmark JSON record lacks its provenance, or None when it has it."""
    provenance = record.get("provenance") if isinstance(record, dict) else None
    if not isinstance(provenance, dict):
        return "has no provenance (git, date, cpu_model, cores, command: bench/provenance.py)"
    missing = [key for key in BENCH_PROVENANCE_KEYS if provenance.get(key) in (None, "")]
    if missing:
        return "provenance lacks " + ", ".join(missing)
    if not GIT_REVISION_RE.match(str(provenance["git"])):
        return (
            f"provenance git must be a revision, with -dirty if uncommitted: {provenance['git']!r}"
        )
    return None


def check_bench_provenance(errors: list[str]) -> None:
    exempt_file = ROOT / BENCH_WITHOUT_PROVENANCE
    exempt = set()
    if exempt_file.is_file():
        for line in exempt_file.read_text().splitlines():
            if line.strip() and not line.startswith("#"):
                exempt.add(line.strip())
    for path in sorted((ROOT / "docs").rglob("*.json")):
        if rel(path) in exempt:
            continue
        try:
            record = json.loads(path.read_text())
        except ValueError as exc:
            errors.append(f"{rel(path)}: not JSON: {exc}")
            continue
        problem = bench_provenance_problem(record)
        if problem:
            errors.append(f"{rel(path)}: {problem}")
    for name in sorted(exempt):
        if not (ROOT / name).is_file():
            errors.append(f"{BENCH_WITHOUT_PROVENANCE}: lists a missing file: {name}")


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


def check_compat_matrix(errors: list[str]) -> None:
    """The compatibility matrix (scripts/compat_matrix.py): evidence in every cell, the named
    test functions exist, docs/features/compatibility.md is current. Static and fast: running
    the named tests and checking that each shows both features is `compat_matrix.py
    --collect` (its own CI step), not part of `make check`."""
    module = _compat_module()
    if module is not None:
        errors.extend(f"compat_matrix: {problem}" for problem in module.check(ROOT))


def _compat_module():
    """scripts/compat_matrix.py of the checked repository, loaded (None where it is absent)."""
    script = ROOT / "scripts" / "compat_matrix.py"
    if not script.is_file():
        return None
    spec = importlib.util.spec_from_file_location("compat_matrix", script)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


REFUSAL_RE = re.compile(r"cannot be used with|not supported|\bnot (?:yet )?with\b", re.I)
"""Wording that says two features do not run together."""
FEATURE_WORDS = {
    "tp": r"tensor.parallel",
    "gguf": r"gguf|--quantization`?(?! ?(?:int8|fp16))",
    "int8": r"--quantization int8|--quantization`?(?! ?(?:gguf|fp16|int8))",
    "lora": r"\blora\b",
    "spec": r"speculative decoding|speculation|draft model",
    "structured": r"structured output|json schema",
    "grpc": r"\bgrpc\b",
    "router": r"\brouter\b",
    "reasoning": r"reasoning parser|--reasoning-parser",
    "embed": r"\bembeddings?\b|--runner pooling",
    "messages": r"messages api",
    "priority": r"priority scheduling|--scheduling-policy",
    "recorder": r"flight record|--step-record",
    "tracing": r"opentelemetry|--otlp",
    "kvdtype": r"kv.cache.dtype|quantized kv cache",
    "sleep": r"\bsleep",
    "offload": r"kv.offload",
    "pd": r"disaggregation|--kv-role",
    "cuda": r"\bcuda\b",
}
"""How a sentence names each feature of the compatibility matrix (a bare `--quantization`
names every weight format)."""
FEATURE_PAGES = {
    "docs/features/lora.md": ("lora",),
    "docs/features/quantization.md": ("gguf", "int8"),
    "docs/features/speculative-decoding.md": ("spec",),
    "docs/features/structured-outputs.md": ("structured",),
    "docs/features/distributed.md": ("tp", "router"),
    "docs/features/kv-cache-dtype.md": ("kvdtype",),
    "docs/features/kv-offload.md": ("offload",),
    "docs/features/pd-disaggregation.md": ("pd",),
    "docs/features/sleep-mode.md": ("sleep",),
    "docs/features/embeddings.md": ("embed",),
    "docs/features/reasoning.md": ("reasoning",),
    "docs/features/anthropic-messages.md": ("messages",),
    "docs/features/priority-scheduling.md": ("priority",),
    "docs/features/flight-recorder.md": ("recorder",),
    "docs/features/gpu.md": ("cuda",),
}
"""Feature pages and the matrix features each is about."""


def refusal_wording(text: str, page_features: tuple[str, ...], cells: dict) -> list:
    """(line, message) for each sentence of a feature page that says its feature does not run
    with another one ("not with", "not supported", "cannot be used with") where the
    compatibility matrix says the pair works. The page's features the sentence names are its
    subject (all of the page's when it names none); the other features are those named in the
    clause (between semicolons) that holds the refusal. A sentence that also says what works
    ("level 1 works") is left alone."""

    def named(text: str) -> set[str]:
        return {key for key, words in FEATURE_WORDS.items() if re.search(words, text.lower())}

    found = []
    for number, sentence in _prose_units(text):
        if not REFUSAL_RE.search(sentence) or re.search(r"\bworks?\b", sentence):
            continue
        subject = (named(sentence) & set(page_features)) or set(page_features)
        others = set()
        for clause in sentence.split(";"):
            if REFUSAL_RE.search(clause):
                others |= named(clause) - subject
        for a in sorted(subject):
            for b in sorted(others):
                cell = cells.get((a, b)) or cells.get((b, a))
                if cell is not None and cell.state == "works":
                    found.append(
                        (
                            number,
                            f"says {a} and {b} do not run together; the compatibility "
                            f"matrix says they work: {sentence[:100]!r}",
                        )
                    )
    return found


def check_refusal_wording(errors: list[str]) -> None:
    module = _compat_module()
    if module is None:
        return
    for page, features in FEATURE_PAGES.items():
        path = ROOT / page
        if path.is_file():
            for number, message in refusal_wording(path.read_text(), features, module.CELLS):
                errors.append(f"{page}:{number}: {message}")


def check_perf_glance(errors: list[str]) -> None:
    """The performance table of README.md and docs/index.md is the one scripts/perf_glance.py
    generates from the benchmark JSON's provenance."""
    script = ROOT / "scripts" / "perf_glance.py"
    if not script.is_file():
        return
    spec = importlib.util.spec_from_file_location("perf_glance", script)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    errors.extend(module.problems(ROOT))


HEADLINE_PAGES = ("README.md", "docs/index.md", "docs/features")
"""Where a bold ratio (`**1.28x**`) is a headline number: README, the docs home and the
feature pages (docs/benchmarks.md is the record they quote, with its own sections)."""
BOLD_RATIO_RE = re.compile(r"\*\*\d+(?:\.\d+)?x\*\*")
HEADLINE_NEEDS = {
    "a commit": re.compile(r"\b[0-9a-f]{7,40}\b"),
    "a CPU": re.compile(r"EPYC|Xeon|Intel|AMD|Arm|Apple"),
    "the kernels it ran": re.compile(
        r"\b(?:avx2|avx512|amx)\b|AVX2|AVX-512|AMX|native kernels|int4 kernels|dense", re.I
    ),
}
PEER_RE = re.compile(r"llama\.cpp|llama-server", re.I)
PEER_FLAGS_RE = re.compile(r"AMX off|GGML_|build flags|AVX2-only", re.I)


def headline_problems(text: str) -> list[tuple[int, str]]:
    """(line, message) for each paragraph (or list item) with a bold ratio that does not name
    the commit, the CPU and the kernels it was measured with, and, when it compares with
    llama.cpp, the peer's build flags."""
    found = []
    for number, unit in _paragraphs(text):
        if not BOLD_RATIO_RE.search(unit):
            continue
        missing = [what for what, pattern in HEADLINE_NEEDS.items() if not pattern.search(unit)]
        if PEER_RE.search(unit) and not PEER_FLAGS_RE.search(unit):
            missing.append("the llama.cpp peer's build flags")
        if missing:
            found.append((number, f"a headline number without {', '.join(missing)}: {unit[:90]!r}"))
    return found


def _paragraphs(text: str) -> list[tuple[int, str]]:
    """(first line, text) of each paragraph or list item outside code blocks and tables."""
    units: list[tuple[int, str]] = []
    current: list[str] = []
    start, in_code = 0, False
    for number, line in enumerate([*text.splitlines(), ""], 1):
        stripped = line.strip()
        if stripped.startswith(("```", "~~~")):
            in_code = not in_code
        starts_item = re.match(r"^([-*+]|\d+\.)\s", stripped)
        if in_code or not stripped or stripped.startswith(("|", "#", "```")) or starts_item:
            if current:
                units.append((start, " ".join(current)))
                current = []
            if in_code or not stripped or stripped.startswith(("|", "#", "```")):
                continue
        if not current:
            start = number
        current.append(stripped)
    return units


def check_headline_numbers(errors: list[str]) -> None:
    for name in HEADLINE_PAGES:
        path = ROOT / name
        pages = sorted(path.glob("*.md")) if path.is_dir() else [path]
        for page in pages:
            if page.is_file():
                for number, message in headline_problems(page.read_text()):
                    errors.append(f"{rel(page)}:{number}: {message}")


CHECKED_BOX_RE = re.compile(r"^- \[[xX]\] ")
RETRACTED_RE = re.compile(r"\b(no longer|not met)\b", re.I)


def retracted_boxes(text: str) -> list[tuple[int, str]]:
    """(line, message) for each checked box (`- [x]`, with its indented continuation lines)
    whose own text says it "no longer" holds or is "not met": such a box must be open."""
    found = []
    lines = text.splitlines()
    for number, line in enumerate(lines, 1):
        if not CHECKED_BOX_RE.match(line):
            continue
        box = [line]
        for more in lines[number:]:
            if not more.startswith("  ") or not more.strip():
                break
            box.append(more.strip())
        said = RETRACTED_RE.search(" ".join(box))
        if said:
            found.append((number, f"a checked box says {said.group(0)!r}: open it, or fix it"))
    return found


def check_retracted_boxes(errors: list[str], milestones: dict[str, tuple[Path, str]]) -> None:
    for path, _status in milestones.values():
        for number, message in retracted_boxes(path.read_text()):
            errors.append(f"{rel(path)}:{number}: {message}")


BLOCK_TYPE_PAGE = "docs/features/quantization.md"
BLOCK_TYPE_ROW_RE = re.compile(r"^\| ([A-Z0-9_*, ]+?) \| (native|falls back)\b", re.M)


def block_type_problems(text: str, native: set[str]) -> list[str]:
    """The "GGUF block types" table against the code: each type of a "native" row is one a
    kernel runs (`native` from model/gguf_kquants.py) and every such type has a native row;
    no "falls back" row names one."""
    problems, listed = [], set()
    for names, verdict in BLOCK_TYPE_ROW_RE.findall(text):
        types = {name.strip() for name in names.split(",")}
        if verdict == "native":
            listed |= types
            problems += [f"{t} is listed native, but no kernel runs it" for t in types - native]
        else:
            problems += [
                f"{t} is listed as falling back, but a kernel runs it" for t in types & native
            ]
    problems += [f"{t} runs natively, but the table does not list it" for t in native - listed]
    return [f"{BLOCK_TYPE_PAGE}: {p}" for p in sorted(problems)]


def check_block_types(errors: list[str]) -> None:
    page = ROOT / BLOCK_TYPE_PAGE
    if not page.is_file():
        return
    sys.path.insert(0, str(ROOT / "src"))
    try:
        from nanollmserve.model.gguf_kquants import KQUANT_TYPES, LEGACY_TYPES
    finally:
        sys.path.pop(0)
    errors.extend(block_type_problems(page.read_text(), {*KQUANT_TYPES, *LEGACY_TYPES}))


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
    check_stale_wording(errors, milestones)
    check_commit_histories(errors)
    check_bench_provenance(errors)
    check_compat_matrix(errors)
    check_refusal_wording(errors)
    check_retracted_boxes(errors, milestones)
    check_perf_glance(errors)
    check_headline_numbers(errors)
    check_block_types(errors)
    for error in errors:
        print(f"check_docs: {error}")
    if errors:
        print(f"check_docs: {len(errors)} problem(s) found")
        return 1
    print(f"check_docs: ok ({len(milestones)} milestones)")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
