"""gpt/corpus.py: where pieces are cut (never inside a character, only where GPT-2's tokens cannot
change), and which files a list of inputs names. Formats end to end, through `prepare`:
tests/test_data.py."""
from __future__ import annotations

from pathlib import Path

from hypothesis import given, settings, strategies as st

from helpers import MULTIBYTE
from gpt.corpus import _PRINTABLE, _char_boundary, find_cut, iter_file_pieces, resolve_inputs
from gpt.tokenizer import build_tokenizer

GPT2 = build_tokenizer("gpt2", None, "unused")


def write(path: Path, text: str | bytes) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    (path.write_bytes if isinstance(text, bytes) else lambda t: path.write_text(t, encoding="utf-8"))(text)
    return path


@settings(max_examples=300, deadline=None)
@given(st.text(alphabet="aZ1's ll!.,\n\r\t \u00a0\u3000é你🎉-", max_size=40))
def test_cut_points_do_not_change_tokens(text):
    """Every place find_cut prefers (whitespace after printable ASCII) is a pre-token boundary."""
    buf = text.encode()
    for i in range(1, len(buf)):
        if buf[i - 1] in _PRINTABLE and buf[i] in b" \t\r\n":
            a, b = buf[:i].decode(), buf[i:].decode()
            assert GPT2.encode(a) + GPT2.encode(b) == GPT2.encode(text), (a, b)
    cut = find_cut(buf)
    assert 0 <= cut <= len(buf)
    buf[:cut].decode()  # never splits a character




def test_pieces_never_split_a_character(tmp_path):
    """Every chunk size and every train/val cut position over unspaced CJK, emoji (ZWJ, flags) and
    combining marks: the pieces decode strictly and join to the text, with a boundary at the cut
    moved back to the start of the character it falls in (a real bug: CJK corpora failed)."""
    raw = MULTIBYTE.encode()
    f = write(tmp_path / "m.txt", MULTIBYTE)
    starts = {i for i in range(len(raw) + 1) if i == len(raw) or (raw[i] & 0xC0) != 0x80}
    for chunk in (1, 2, 3, 5, 16):
        for cut in range(len(raw) + 1):
            pieces = list(iter_file_pieces(f, "strict", cut, chunk_bytes=chunk))
            assert "".join(t for _, _, t in pieces) == MULTIBYTE
            ends = {e for _, e, _ in pieces}
            assert max(i for i in starts if i <= cut) in ends | {0}
            assert all(e in starts for e in ends)
    assert _char_boundary("€".encode()[:2], 2) == 0 and _char_boundary("a€".encode(), 2) == 1


def test_resolve_inputs_order_include_and_glob(tmp_path):
    for name in ["b/2.txt", "b/1.txt", "a.txt", "b/skip.md", "b/.hidden/x.txt"]:
        write(tmp_path / name, "x")
    got = resolve_inputs([tmp_path / "b", tmp_path / "a.txt", tmp_path / "b" / "1.txt"])
    assert [p.relative_to(tmp_path).as_posix() for p in got] == ["b/1.txt", "b/2.txt", "a.txt"]
    got = resolve_inputs([str(tmp_path / "b" / "*.md")])
    assert [p.name for p in got] == ["skip.md"]
    assert [p.name for p in resolve_inputs([tmp_path / "b"], include="*.md")] == ["skip.md"]
    got = resolve_inputs([str(tmp_path / "**" / "*.txt"), str(tmp_path / "b" / "**")])
    assert [p.relative_to(tmp_path).as_posix() for p in got] == ["a.txt", "b/1.txt", "b/2.txt", "b/skip.md"]


def test_linked_folders_are_read_once_and_unreadable_ones_are_named(tmp_path, capsys):
    """Folders follow symlinked subfolders (they were dropped) and a link cycle ends, under a
    folder input and a ** glob alike (the glob walked a cycle without end), in sorted order
    whatever the directory's own (a link and its target: the first name in order is kept); a
    subfolder that cannot be listed is named (its files were left out silently)."""
    import os
    write(tmp_path / "real" / "r.txt", "x")
    write(tmp_path / "in" / "sub" / "a.txt", "x")
    os.symlink(tmp_path / "real", tmp_path / "in" / "linked")
    os.symlink(tmp_path / "in" / "sub", tmp_path / "in" / "alias")  # the same folder, named first
    os.symlink(tmp_path / "in", tmp_path / "in" / "sub" / "up")  # a cycle
    for inputs in ([tmp_path / "in"], [str(tmp_path / "in" / "**" / "*.txt")]):
        got = resolve_inputs(inputs)
        assert [p.relative_to(tmp_path / "in").as_posix() for p in got] == ["alias/a.txt", "linked/r.txt"]
    # a pattern naming the real folder finds it, though a link to it sorts first
    assert [p.name for p in resolve_inputs([str(tmp_path / "in" / "**" / "sub" / "*.txt")])] == ["a.txt"]
    assert [p.name for p in resolve_inputs([tmp_path / "in"], include="sub/*.txt")] == ["a.txt"]
    if os.geteuid() != 0:  # root reads any folder
        (tmp_path / "in" / "sub").chmod(0)
        try:
            resolve_inputs([tmp_path / "in"])
            assert "cannot read the folder" in capsys.readouterr().err
        finally:
            (tmp_path / "in" / "sub").chmod(0o755)


def test_globs_and_include_patterns_match_as_glob_and_rglob_do(tmp_path):
    """`**` globs (walked by us) and --include patterns (rglob's matching) against Python's own:
    character ranges, negated and ]-first classes, a trailing "/" (folders only, then filtered by
    --include), and a `**` inside --include (its top-level files too)."""
    import glob as glob_lib
    for name in ["d/shard_1.txt", "d/shard_a.txt", "d/shard_-.txt", "d/]x.txt", "d/ax.txt", "d/sub/b.md",
                 "d/sub/deep/c.txt", "d/x/sub/e.txt", "d/a.txt"]:
        write(tmp_path / name, "x")
    d = str(tmp_path / "d")
    for pattern in ("**/shard_[0-9].txt", "**/shard_[!0-9].txt", "**/[]]x.txt", "**/[!]]x.txt", "**/*.txt",
                    "**/sub/**/*.txt", "**/sub/*.md", "*/**", "**/sub/**"):  # a last ** takes a folder's files
        want = sorted(p for p in glob_lib.glob(f"{d}/{pattern}", recursive=True) if Path(p).is_file())
        assert sorted(str(p) for p in resolve_inputs([f"{d}/{pattern}"])) == want, pattern
    got = resolve_inputs([f"{d}/**/"])  # folders, read with the default --include
    assert "b.md" not in {p.name for p in got} and {p.name for p in got} >= {"a.txt", "c.txt", "e.txt"}
    for include in ("**/*.txt", "sub/**/*.txt", "sub/*.md", "shard_?.txt", "./*.md", "sub//*.md"):
        want = sorted(p for p in Path(d).rglob(include) if p.is_file())
        assert resolve_inputs([Path(d)], include=include) == want, include


# ----- prepare: bad input, atomicity
