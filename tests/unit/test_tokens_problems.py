"""Bad input to the ``tokens`` dataset (plugins/tokens.py), ``handle eval --data`` and a resume on changed data
(torch_handle/checkpoint/data_identity.py): each is refused by ``handle validate`` and ``handle run`` with exit
code 2, one ``error:`` line per problem naming the file or key (every problem of a preset at once), no run
directory and nothing started. Real prepared directories (tests/prepared_data.py)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from click.testing import CliRunner

from handle_cli.main import cli
from tests.prepared_data import prepare, shakespeare_docs, tokenizer_file, wikitext_docs
from torch_handle.launch.data_identity import check_resume, record
from torch_handle.config.loader import load_preset
from torch_handle.errors import CheckpointError

HEAD = '[run]\noutput_dir = "{out}"\n[data]\nname = "tokens"\nseq_len = 16\n'


@pytest.fixture(scope="module")
def dirs(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("bad")
    docs = shakespeare_docs()[:400]
    tok = tokenizer_file(root / "tok.json", docs, 300)
    other = tokenizer_file(root / "other.json", wikitext_docs()[:5], 300)
    return {"good": prepare(root / "good", docs, tok), "good2": prepare(root / "good2", docs[::-1], tok),
            "other": prepare(root / "other", docs, other), "root": root}


def _run(tmp_path: Path, data: str, command: str = "validate") -> tuple[int, list[str]]:
    preset = tmp_path / "p.toml"
    preset.write_text(HEAD.format(out=tmp_path / "out") + data)
    args = [command, str(preset)] + (["--run-dir", str(tmp_path / "out" / "r")] if command == "run" else [])
    result = CliRunner().invoke(cli, args)
    assert "Traceback" not in result.output, result.output
    assert not (tmp_path / "out").exists()  # nothing written, nothing started
    return result.exit_code, [line for line in result.stderr.splitlines() if line]


def _copy(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


@pytest.mark.parametrize("command", ["validate", "run"])
def test_every_problem_of_a_mixture_is_reported_at_once(dirs, tmp_path, command) -> None:
    truncated = _copy(dirs["good"], tmp_path / "truncated")
    shard = truncated / "train-00000.bin"
    shard.write_bytes(shard.read_bytes()[:-10])  # a copy cut short
    bad_meta = _copy(dirs["good"], tmp_path / "bad-meta")
    (bad_meta / "meta.json").write_text("{not json")
    unprepared = tmp_path / "unprepared"
    unprepared.mkdir()
    sources = [tmp_path / "missing", truncated, bad_meta, unprepared, dirs["good"], dirs["other"]]
    data = "sources = [" + ", ".join(f'{{path = "{p}", weight = 1}}' for p in sources) + "]\n"
    code, lines = _run(tmp_path, data, command)
    assert code == 2
    expect = [f"{tmp_path / 'missing'}: no such directory", f"{shard}: ", f"{bad_meta / 'meta.json'}: unreadable",
              f"{unprepared}: not a prepared token directory", f"{dirs['other']} was prepared with another tokenizer"]
    assert len(lines) == len(expect), lines
    for line, want in zip(lines, expect):
        assert line.startswith("error: data.sources: ") and want in line, (line, want)
    assert "truncated" in lines[1]


@pytest.mark.parametrize("data, expect", [
    ('sources = [{{path = "{good}", weight = 0.7}}, {{path = "{good2}", weight = 0}}]\n',
     ["data.sources: sources[1].weight: 0 must be a number > 0"]),
    ('sources = [{{path = "{good}", weight = -1}}, {{path = "{good2}", weight = 1, size = 3}}]\n',
     ["data.sources: sources[0].weight: -1 must be a number > 0", "data.sources: sources[1]: unknown key 'size'"]),
    ('path = "{good}"\nsources = [{{path = "{good2}"}}]\n', ["data.path: give either path (a prepared directory) or sources", "not both"]),
    ("", ["data.path: give either path (a prepared directory) or sources", "not neither"]),
    ('sources = [{{path = "{good}"}}, {{path = "{good}"}}]\n', ["data.sources: two sources are named 'good'"]),
], ids=["weight-0", "negative-and-unknown-key", "path-and-sources", "neither", "same-name"])
def test_preset_problems_of_the_options(dirs, tmp_path, data, expect) -> None:
    """One line each (``expect``: one entry a line, each line's text, whatever follows in the same line)."""
    code, lines = _run(tmp_path, data.format(**dirs))
    assert code == 2 and len(lines) == len([e for e in expect if e.startswith("data.")]), lines
    assert all(any(e in line for line in lines) for e in expect), (lines, expect)


def test_a_split_shorter_than_one_sample_and_a_base_with_a_smaller_vocabulary(dirs, tmp_path) -> None:
    code, lines = _run(tmp_path, f'path = "{dirs["good"]}"\n'.replace("seq_len = 16", "") + "",)
    assert code == 0, lines
    preset = HEAD.replace("seq_len = 16", "seq_len = 100000")
    (tmp_path / "p.toml").write_text(preset.format(out=tmp_path / "out") + f'path = "{dirs["good"]}"\n')
    result = CliRunner().invoke(cli, ["validate", str(tmp_path / "p.toml")])
    assert result.exit_code == 2 and "too few for one sample of data.seq_len = 100000" in result.stderr
    base = tmp_path / "base"
    base.mkdir()
    (base / "config.json").write_text(json.dumps({"vocab_size": 200}))
    code, lines = _run(tmp_path, f'path = "{dirs["good"]}"\n[model]\ninit_from = "{base}"\n')
    assert code == 2 and any("a vocabulary of 300 tokens, more than model.init_from's 200" in x for x in lines), lines


def test_a_resume_on_changed_data_or_tokenizer_is_refused_in_one_line(dirs, tmp_path) -> None:
    """The checkpoint's record (what the trainer writes into layout.json) against the preset's data now."""
    run = tmp_path / "run"
    data = _copy(dirs["good"], tmp_path / "data")
    ckpt = run / "checkpoints" / "step-4"
    ckpt.mkdir(parents=True)
    (tmp_path / "p.toml").write_text(HEAD.format(out=tmp_path / "out") + f'path = "{data}"\n')
    options = load_preset(tmp_path / "p.toml").data.options
    from handle_plugins.tokens import identity  # the launcher's prepare hook of tokens

    (ckpt / "layout.json").write_text(json.dumps({"format": "torch", **record(identity(options))}))
    check_resume(run, identity(options))  # unchanged: accepted
    shutil.rmtree(data)
    _copy(dirs["good2"], data)  # prepared again from other documents, same tokenizer
    with pytest.raises(CheckpointError) as e:
        check_resume(run, identity(options))
    assert str(e.value).count("\n") == 0 and "the prepared data" in str(e.value) and str(ckpt) in str(e.value)
    shutil.rmtree(data)
    _copy(dirs["other"], data)  # same documents, another tokenizer: both differ
    with pytest.raises(CheckpointError) as e:
        check_resume(run, identity(options))
    assert len(str(e.value).splitlines()) == 2 and "the tokenizer changed" in str(e.value)


def test_eval_data_refuses_splits_a_prepared_directory_does_not_have(dirs, tmp_path) -> None:
    """Before the run is read (a real run's refusals: tests/test_tokens_run.py)."""
    run = tmp_path / "run"
    for args, want in ((["--data", str(dirs["good"]), "--split", "test"], "has the splits valid and train"),
                       (["--split", "train"], "give --data DIR")):
        result = CliRunner().invoke(cli, ["eval", str(run), *args])
        assert result.exit_code == 2 and len(result.stderr.splitlines()) == 1 and want in result.stderr, \
            result.output
