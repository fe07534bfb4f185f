"""docs/results.md, the current figures: each workload names a command that exists with the options it gives, a
machine, and a date that its dated note under docs/notes/ carries; every figure in its tables is one that note records;
and the README's headline figures for the demo are the demo table's."""

from __future__ import annotations

import datetime
import re
from pathlib import Path

import click
import pytest

from trtspec.cli import cli

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "docs" / "results.md"
NOTES = ROOT / "docs" / "notes"


def sections() -> dict[str, str]:
    parts = re.split(r"^## (.+)$", RESULTS.read_text(), flags=re.M)
    return dict(zip(parts[1::2], parts[2::2]))


def field(text: str, name: str) -> str:
    """A `Name: ...` paragraph's text up to the next field or blank line, its lines joined."""
    m = re.search(rf"^{name}: (.*?)(?=^\w+: |\n\n)", text, flags=re.M | re.S)
    assert m, f"no '{name}:' line"
    return " ".join(m.group(1).split())


def table_rows(text: str) -> list[str]:
    return [line for line in text.splitlines() if line.startswith("|") and not set(line) <= set("|-: ")][1::]


def numbers(text: str) -> set[str]:
    return set(re.findall(r"(?<![\w.])\d+\.\d+(?![\d])", text))


def recorded(number: str, notes: str) -> bool:
    return re.search(rf"(?<![\d.]){re.escape(number)}(?!\d)", notes) is not None


def trtspec_command(words: list[str]) -> click.Command:
    command = cli
    for word in words:
        if not isinstance(command, click.Group) or word not in command.commands:
            break
        command = command.commands[word]
    assert command is not cli, f"trtspec has no command {' '.join(words[:2])}"
    return command


def check_command(span: str, last: tuple[str, object] | None) -> tuple[str, object] | None:
    """Check one backticked span; returns what later `--option` spans refer to (None: not a command of ours)."""
    words = span.split()
    if words[0] == "trtspec":
        command = trtspec_command(words[1:])
        target: tuple[str, object] = ("cli", {opt for p in command.params for opt in p.opts})
    elif words[:2] and words[0] == "python" and words[1].startswith("benchmarks/"):
        script = ROOT / words[1]
        assert script.is_file(), f"{words[1]} does not exist"
        target = ("script", script.read_text())
    elif words[0].startswith("--"):
        assert last is not None, f"`{span}` follows no command"
        target = last
    else:
        return last  # another project's tool (llama-bench): named, not checked here
    for option in (w.split("=")[0] for w in words if w.startswith("--")):
        kind, known = target
        ok = option in known if kind == "cli" else f'"{option}"' in known
        assert ok, f"`{span}`: {option} is not an option of {words[0]} {words[1]}"
    return target


def test_every_workload_has_a_table_command_machine_and_date():
    found = sections()
    assert len(found) >= 4
    for title, text in found.items():
        assert table_rows(text), f"{title}: no table"
        assert field(text, "Machine"), title
        date = re.search(r"^.*?Date: (\d{4}-\d{2}-\d{2})", text, flags=re.M)
        assert date, f"{title}: no 'Date: YYYY-MM-DD'"
        assert datetime.date.fromisoformat(date.group(1)) <= datetime.date.today(), title


@pytest.mark.parametrize("title", list(sections()))
def test_its_commands_exist_with_the_options_they_name(title):
    spans = re.findall(r"`([^`]+)`", field(sections()[title], "Command"))
    last = None
    for span in spans:
        last = check_command(" ".join(span.split()), last)
    ours = [s for s in spans if s.startswith(("trtspec ", "python benchmarks/"))]
    assert ours, f"{title}: names no trtspec command or benchmark script"


@pytest.mark.parametrize("title", list(sections()))
def test_its_figures_are_recorded_in_its_dated_note(title):
    text = sections()[title]
    links = re.findall(r"\(notes/([^)]+\.md)\)", text)
    assert links, f"{title}: links no note"
    date = re.search(r"Date: (\d{4}-\d{2}-\d{2})", text).group(1)
    for link in links:
        assert (NOTES / link).is_file(), f"{title}: notes/{link} does not exist"
        assert link.startswith(date), f"{title}: dated {date}, its note notes/{link} is not"
    notes = "\n".join((NOTES / link).read_text() for link in links)
    missing = sorted(n for row in table_rows(text) for n in numbers(row) if not recorded(n, notes))
    assert not missing, f"{title}: figures its note ({', '.join(links)}) does not record: {missing}"


def test_the_readme_headline_figures_are_the_demo_table():
    readme = (ROOT / "README.md").read_text()
    paragraph = re.search(r"^On the embedded demo.*?(?=\n\n)", readme, flags=re.M | re.S)
    assert paragraph, "the README's paragraph of demo figures moved: point this test at it"
    demo = " ".join(table_rows(sections()["The demo"]))
    headline = re.findall(r"(\d+\.\d+)x", paragraph.group(0))
    assert headline, "the README names no speed-up"
    missing = [f for f in headline if f"{f}x" not in demo]
    assert not missing, f"README speed-ups not in docs/results.md's demo table: {missing}"
    assert "docs/results.md" in paragraph.group(0)


def test_no_link_points_at_a_page_that_is_gone():
    for page in [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]:
        for target in re.findall(r"\]\(([^)#:]+\.md)", page.read_text()):
            assert (page.parent / target).resolve().is_file(), f"{page.relative_to(ROOT)} links {target}, which is gone"
