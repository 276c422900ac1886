"""A base's tokenizer decides: ``init_from`` with a tokenizer.json gives the dataset that tokenizer, and a dataset
that names another is refused in one line (torch_handle/launch/base_tokenizer.py)."""

from __future__ import annotations

from pathlib import Path

import pytest

from torch_handle.config.loader import load_preset
from torch_handle.errors import DataError
from torch_handle.launch.base_tokenizer import check_base_tokenizer, resolve_base_tokenizer

REPO = Path(__file__).resolve().parents[2]
SHAKESPEARE = REPO.parent / "shared" / "data" / "tinyshakespeare" / "input.txt"


def _tokenizer(path: Path, vocab_size: int) -> Path:
    from torch_handle.data.datasets import train_tokenizer

    text = SHAKESPEARE.read_text(encoding="utf-8")[:20_000]
    path.mkdir(parents=True, exist_ok=True)
    train_tokenizer([text], vocab_size).save(str(path / "tokenizer.json"))
    return path


@pytest.fixture(scope="module")
def dirs(tmp_path_factory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("tok")
    return _tokenizer(root / "base", 300), _tokenizer(root / "other", 320)


def _preset(base: Path, *sets: str):
    return load_preset(REPO / "presets" / "llama.toml",
                       ("data.name=text", f"data.path={SHAKESPEARE}", f"model.init_from={base}", *sets))


def test_a_preset_without_a_tokenizer_takes_the_bases(dirs) -> None:
    base, _ = dirs
    p, note = resolve_base_tokenizer(_preset(base))
    assert p.data.options.tokenizer == str(base / "tokenizer.json")
    assert note is not None and str(base / "tokenizer.json") in note and "init_from" in note
    check_base_tokenizer(p)  # the base's own: no conflict


def test_a_named_tokenizer_is_kept_when_it_is_the_bases(dirs) -> None:
    base, _ = dirs
    p, note = resolve_base_tokenizer(_preset(base, f"data.tokenizer={base}"))
    assert note is None and p.data.options.tokenizer == str(base)
    check_base_tokenizer(p)


def test_another_tokenizer_than_the_bases_is_refused_in_one_line(dirs) -> None:
    base, other = dirs
    with pytest.raises(DataError) as e:
        check_base_tokenizer(_preset(base, f"data.tokenizer={other}"))
    assert len(str(e.value).splitlines()) == 1
    assert str(other) in str(e.value) and str(base / "tokenizer.json") in str(e.value)
