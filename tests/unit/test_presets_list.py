"""``handle presets list`` shows each preset's whole description (its leading comment block, wrapped), never cut
mid-sentence, and ``--json`` has it whole (issue 29)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from click.testing import CliRunner

from handle_cli.main import cli
from torch_handle.config.loader import preset_description

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("text, expect", [
    ("# One line.\n[run]\n", "One line."),
    ("\n# First half of a sentence\n#   and  its end.\n\n# not the description\n[run]\n",
     "First half of a sentence and its end."),
    ("# Block\n#\n# after an empty comment line\nextends = 'x.toml'\n# later\n", "Block after an empty comment line"),
    ("[run]\n# a comment inside a table\n", ""),
])
def test_preset_description_is_the_leading_comment_block(tmp_path, text, expect):
    path = tmp_path / "p.toml"
    path.write_text(text, encoding="utf-8")
    assert preset_description(path) == expect


def test_missing_file_has_no_description(tmp_path):
    assert preset_description(tmp_path / "absent.toml") == ""


def _leading_comment(path: Path) -> str:
    words = []
    for line in path.read_text(encoding="utf-8").splitlines():
        if not line.startswith("#"):
            break
        words += line.lstrip("#").split()
    return " ".join(words)


def test_list_shows_every_whole_description_wrapped_to_the_terminal(monkeypatch):
    monkeypatch.chdir(REPO)
    result = CliRunner().invoke(cli, ["presets", "list"], env={"COLUMNS": "80"})
    assert result.exit_code == 0, result.output
    entries: dict[str, list[str]] = {}
    name = ""
    for line in result.output.splitlines():
        assert len(line) <= 80 or " " not in line.strip(), line  # only a word longer than a line overflows
        if line.startswith(" "):
            entries[name].append(line.strip())
        else:
            name, _, rest = line.partition(" ")
            entries[name] = [rest.strip()]
    shipped = sorted(REPO.glob("presets/*.toml"))
    assert [p.stem for p in shipped] == list(entries)[:len(shipped)]
    for path in shipped:
        assert " ".join(entries[path.stem]) == _leading_comment(path), path.stem
    three_d = " ".join(entries["3d"])  # 5 comment lines: the old list stopped after the first, mid-sentence
    assert three_d.endswith("ranks the other layouts of these 8 ranks.") and len(entries["3d"]) > 1


def test_list_json_has_the_whole_description(monkeypatch):
    monkeypatch.chdir(REPO)
    result = CliRunner().invoke(cli, ["presets", "list", "--json"])
    rows = {r["name"]: r for r in json.loads(result.output) if r["plugin"] is None}
    assert {name: r["description"] for name, r in rows.items()} == {
        p.stem: _leading_comment(p) for p in REPO.glob("presets/*.toml")}


def test_a_plugin_preset_names_its_plugin_on_the_first_line(monkeypatch, tmp_path):
    import handle_cli.presets_cmd as presets_cmd

    (tmp_path / "presets").mkdir()
    path = tmp_path / "plug" / "shakespeare-char.toml"
    desc = "Character-level language model on Shakespeare (bundled sonnets, or data.path) with DDP on 2 processes."
    monkeypatch.setattr(presets_cmd, "plugin_presets", lambda: [("shakespeare", path, desc)])
    monkeypatch.chdir(tmp_path)
    lines = CliRunner().invoke(cli, ["presets", "list"], env={"COLUMNS": "80"}).output.splitlines()
    assert lines[0].startswith("shakespeare-char (plugin shakespeare) Character-level") and len(lines) > 1
    assert " ".join(s.strip() for s in lines) == f"shakespeare-char (plugin shakespeare) {desc}"


def test_a_name_longer_than_its_column_puts_the_description_below():
    from handle_cli.presets_cmd import NAME_WIDTH, _described

    name = "n" * (NAME_WIDTH + 1)
    assert _described(name, "Short.", 80) == f"{name}\n{' ' * (NAME_WIDTH + 1)}Short."
    assert _described("x", "", 80) == "x"
