"""tools/train_tokenizer.py's corpus rebuild on a hand-made SWORD zText module (the real one is
Debian's sword-text-web, not shipped): the OSIS markup becomes the documents, read from a folder
or from a .deb alike; the tokenizer's checks of --output-dir and --check's verdict."""

import gzip
import io
import json
import lzma
import struct
import tarfile
import zlib

import pytest

from tests.unit.test_data import _load_tool, _write_jsonl

PREFACE = "Preface. " + "The World English Bible is a Public Domain translation. " * 4
GLOSSARY = "Aaron: the brother of Moses. " * 8
OT = [
    PREFACE + '<lb type="x-p"/>Visit our web site for more.',
    '<div type="book" osisID="Gen" sID="b1"/><milestone type="x-usfm-toc2" n="Genesis"/>'
    "<title>The First Book of Moses,</title><title>Commonly Called Genesis</title>",
    '<chapter osisID="Gen.1" sID="c1" n="1"/>In the beginning,<note type="x">Or, at first</note>'
    'God <w lemma="strong:H0430">created</w> the heavens (<note type="x">n</note>skies)'
    " &amp; the\u00a0earth.",
    "",  # an index entry of size 0 (a verse the module leaves out): skipped
    'The earth was formless.<lb type="x-p"/><lb type="x-p"/>God said,<q who="God">“Let there be'
    " light,”</q>and there was light.",
    '<chapter osisID="Gen.2" sID="c2"/><lg><l sID="l1"/>Poetry line one<l eID="l1"/>'
    '<l sID="l2"/>line two<l eID="l2"/></lg>',
]
NT = [
    '<div type="glossary" osisID="Glossary" sID="g1"/><list><item>Abba: father.</item>'
    f"<item>{GLOSSARY}</item></list>",
]
DOCS = [
    {"id": "front", "text": " ".join(PREFACE.split())},  # the web-site paragraph dropped
    {
        "id": "Gen.1",
        "text": "The First Book of Moses, Commonly Called Genesis\n\nGenesis 1\n\n"
        "In the beginning, God created the heavens (skies) & the earth. The earth was "
        "formless.\n\n"
        "God said, “Let there be light,” and there was light.",
    },
    {"id": "Gen.2", "text": "Genesis 2\n\nPoetry line one\nline two"},
    {"id": "Glossary", "text": "Abba: father.\n" + GLOSSARY.strip()},
]
"""What OT + NT become: one document per chapter (headed "Book N", the book's title page on
top of its first chapter), footnotes and Strong's tags gone, a space where a removed tag
stood between two words (not after an opening bracket or quote), paragraphs as one blank line,
poetry lines and list items as lines."""


def _ztext(entries: list[str], per_block: int = 2) -> dict[str, bytes]:
    """One testament's .bzs / .bzv / .bzz: the entries, ``per_block`` to a zlib block."""
    bzs, bzv, bzz = b"", b"", b""
    for b in range(0, len(entries), per_block):
        raw = b""
        for text in entries[b : b + per_block]:
            data = text.encode()
            bzv += struct.pack("<IIH", b // per_block, len(raw), len(data))
            raw += data
        block = zlib.compress(raw)
        bzs += struct.pack("<III", len(bzz), len(block), len(raw))
        bzz += block
    return {"bzs": bzs, "bzv": bzv, "bzz": bzz}


def _module_files() -> dict[str, bytes]:
    return {
        f"{testament}.{ext}": data
        for testament, entries in (("ot", OT), ("nt", NT))
        for ext, data in _ztext(entries).items()
    }


def _ar_member(name: str, data: bytes) -> bytes:
    header = f"{name + '/':<16}{0:<12}{0:<6}{0:<6}{100644:<8}{len(data):<10}`\n".encode()
    return header + data + (b"\n" if len(data) % 2 else b"")


def _deb(path, files: dict[str, bytes], prefix: str) -> None:
    """A Debian package (ar: debian-binary, control.tar.gz of odd size, data.tar.xz); the
    module's folder holds a folder too (not a file of the module)."""
    tar_bytes = io.BytesIO()
    with tarfile.open(fileobj=tar_bytes, mode="w") as tar:
        for name in (prefix.rstrip("/"), prefix + "locked"):
            folder = tarfile.TarInfo("./" + name)
            folder.type = tarfile.DIRTYPE
            tar.addfile(folder)
        for name, data in files.items():
            info = tarfile.TarInfo(f"./{prefix}{name}")
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    path.write_bytes(
        b"!<arch>\n"
        + _ar_member("debian-binary", b"2.0\n")
        + _ar_member("control.tar.gz", b"odd")
        + _ar_member("data.tar.xz", lzma.compress(tar_bytes.getvalue()))
    )


def _corpus(path) -> list[dict]:
    return [json.loads(line) for line in gzip.decompress(path.read_bytes()).splitlines()]


def test_rebuild_corpus_from_a_folder_and_from_a_deb(tmp_path, capsys):
    tool = _load_tool("train_tokenizer")
    folder = tmp_path / "mods" / "texts" / "ztext" / "engweb"
    folder.mkdir(parents=True)
    for name, data in _module_files().items():
        (folder / name).write_bytes(data)
    deb = tmp_path / "sword-text-web.deb"
    _deb(deb, _module_files(), tool.SWORD_DIR_IN_DEB)
    chars = sum(len(d["text"]) for d in DOCS)
    for source, out in ((tmp_path / "mods", "a.jsonl.gz"), (deb, "b.jsonl.gz")):
        assert tool.build_corpus(source, tmp_path / out) == (4, chars)
        assert _corpus(tmp_path / out) == DOCS
    raw = (tmp_path / "a.jsonl.gz").read_bytes()
    assert raw == (tmp_path / "b.jsonl.gz").read_bytes()
    assert raw[4:8] == b"\0\0\0\0"  # gzip mtime 0: a rebuild is byte-identical
    # the main() path: "corpus: ..." then the tokenizer, too small here: exit 2 naming --corpus
    corpus = tmp_path / "c.jsonl.gz"
    argv = ["--rebuild-corpus", str(deb), "--corpus", str(corpus)]
    assert tool.main([*argv, "--output-dir", str(tmp_path / "tok")]) == 2
    out, err = capsys.readouterr()
    size = corpus.stat().st_size
    assert out == f"corpus: {corpus} (4 documents, {chars:,} characters, {size:,} bytes)\n"
    assert err.startswith(f"error: --corpus={str(corpus)!r} is too small: it yields ")
    assert not (tmp_path / "tok").exists()


def test_a_title_page_no_chapter_follows_is_a_document_of_its_own():
    """A short heading-less text waits to go on top of the next chapter; when none comes (a
    short last section, or a second title page first) it is kept as it is, not dropped."""
    tool = _load_tool("train_tokenizer")
    book = '<div type="book" osisID="{0}" sID="{0}"/><title>The Book of</title><title>{0}</title>'
    markup = (
        book.format("Ruth")
        + book.format("Job")
        + '<chapter osisID="Job.1" sID="j1" n="1"/>There was a man.'
        + '<div type="glossary" osisID="Glossary" sID="g"/><item>Abba: father.</item>'
    )
    assert tool.osis_to_documents(markup) == [
        {"id": "Ruth", "text": "The Book of\n\nRuth"},
        {"id": "Job.1", "text": "The Book of Job\n\nJob 1\n\nThere was a man."},
        {"id": "Glossary", "text": "Abba: father."},
    ]


def test_a_book_without_its_short_name_heads_its_chapters_by_its_osis_id():
    """Chapters are headed with their book's short name (its x-usfm-toc2 milestone); a book
    without one falls back on its OSIS id, not on the name of the book before it."""
    tool = _load_tool("train_tokenizer")
    markup = (
        '<div type="book" osisID="Gen" sID="b1"/><milestone type="x-usfm-toc2" n="Genesis"/>'
        '<chapter osisID="Gen.1" sID="c1" n="1"/>In the beginning.'
        '<div type="book" osisID="Exod" sID="b2"/>'
        '<chapter osisID="Exod.1" sID="c2" n="1"/>These are the names.'
    )
    assert tool.osis_to_documents(markup) == [
        {"id": "Gen.1", "text": "Genesis 1\n\nIn the beginning."},
        {"id": "Exod.1", "text": "Exod 1\n\nThese are the names."},
    ]


@pytest.mark.parametrize(
    "members, message",
    [
        ([("debian-binary", b"2.0\n")], "{deb}: no data.tar member"),
        ([("data.tar.zst", b"zstd")], "{deb}: zstd-compressed package; unpack it with dpkg -x"),
        ([("data.tar.gz", "tar.gz")], "{deb}: no usr/share/sword/modules/texts/ztext/"),
    ],
)
def test_rebuild_corpus_from_a_deb_without_the_module_is_one_line_exit_2(
    tmp_path, capsys, members, message
):
    """A .deb that is not sword-text-web: exit 2 naming --rebuild-corpus and the file; the
    --corpus it would rewrite is left alone."""
    tarred = io.BytesIO()
    with tarfile.open(fileobj=tarred, mode="w:gz") as tar:
        info = tarfile.TarInfo("./usr/share/doc/README")
        info.size = 2
        tar.addfile(info, io.BytesIO(b"hi"))
    deb = tmp_path / "other.deb"
    deb.write_bytes(
        b"!<arch>\n"
        + b"".join(
            _ar_member(name, tarred.getvalue() if data == "tar.gz" else data)
            for name, data in members
        )
    )
    corpus = _write_jsonl(tmp_path / "corpus.jsonl", [{"text": "kept"}])
    argv = ["--rebuild-corpus", str(deb), "--corpus", str(corpus), "--output-dir", str(tmp_path)]
    assert _load_tool("train_tokenizer").main(argv) == 2
    out, err = capsys.readouterr()
    assert out == "" and err.startswith("error: --rebuild-corpus: " + message.format(deb=deb))
    assert err.count("\n") == 1 and corpus.read_text() == '{"text": "kept"}\n'


@pytest.mark.parametrize(
    "damage, why",
    [
        ("cut", "EOFError: Compressed file ended before the end-of-stream marker was reached"),
        ("garbled header", "UnicodeDecodeError: 'utf-8' codec can't decode byte 0xff"),
        ("garbled module", "error: Error -3 while decompressing data: incorrect header check"),
        ("module file missing", "KeyError: 'nt.bzv'"),
    ],
)
def test_a_damaged_deb_or_module_is_one_line_exit_2(tmp_path, capsys, damage, why):
    """A .deb cut short (a download that stopped), a garbled one, a module with a garbled or
    missing file: exit 2 naming --rebuild-corpus and the file, --corpus left alone (each was a
    traceback)."""
    tool = _load_tool("train_tokenizer")
    files = _module_files()
    if damage == "garbled module":
        files["ot.bzz"] = b"x" * len(files["ot.bzz"])
    elif damage == "module file missing":
        del files["nt.bzv"]
    deb = tmp_path / "sword-text-web.deb"
    _deb(deb, files, tool.SWORD_DIR_IN_DEB)
    data = deb.read_bytes()
    if damage == "cut":
        deb.write_bytes(data[: len(data) // 2])
    elif damage == "garbled header":
        deb.write_bytes(data[:8] + b"\xff" * 16 + data[24:])
    corpus = _write_jsonl(tmp_path / "corpus.jsonl", [{"text": "kept"}])
    argv = ["--rebuild-corpus", str(deb), "--corpus", str(corpus), "--output-dir", str(tmp_path)]
    assert tool.main(argv) == 2
    out, err = capsys.readouterr()
    assert out == "" and err.count("\n") == 1
    assert err.startswith(f"error: --rebuild-corpus: {deb}: damaged or cut short, not readable (")
    assert why in err and err.endswith(
        "); a sword-text-web .deb or its unpacked folder is expected\n"
    )
    assert corpus.read_text() == '{"text": "kept"}\n'


def test_output_dir_that_is_a_file_is_refused_before_the_corpus_is_rebuilt(tmp_path, capsys):
    """(The corpus was rewritten first, then the run failed on --output-dir.)"""
    blocker = tmp_path / "tok"
    blocker.write_text("a file")
    deb = tmp_path / "sword-text-web.deb"
    tool = _load_tool("train_tokenizer")
    _deb(deb, _module_files(), tool.SWORD_DIR_IN_DEB)
    corpus = _write_jsonl(tmp_path / "corpus.jsonl", [{"text": "kept"}])
    argv = ["--rebuild-corpus", str(deb), "--corpus", str(corpus), "--output-dir", str(blocker)]
    assert tool.main(argv) == 2
    assert capsys.readouterr() == (
        "",
        f"error: --output-dir={str(blocker)!r} is not a directory (a folder for the tokenizer "
        "files is expected)\n",
    )
    assert blocker.read_text() == "a file" and corpus.read_text() == '{"text": "kept"}\n'


def test_rebuilt_corpus_goes_into_a_new_folder_or_is_one_line_exit_2(tmp_path, capsys, monkeypatch):
    """--corpus in a folder not made yet: made (it was a FileNotFoundError traceback); under a
    file, or failing at the rename (a full disk): exit 2 naming --corpus, no temporary left."""
    tool = _load_tool("train_tokenizer")
    deb = tmp_path / "sword-text-web.deb"
    _deb(deb, _module_files(), tool.SWORD_DIR_IN_DEB)
    corpus = tmp_path / "new" / "corpus.jsonl.gz"
    assert tool.build_corpus(deb, corpus) == (4, sum(len(d["text"]) for d in DOCS))
    assert _corpus(corpus) == DOCS and [p.name for p in corpus.parent.iterdir()] == [corpus.name]

    (tmp_path / "file").write_text("a file")
    bad = tmp_path / "file" / "corpus.jsonl.gz"
    argv = ["--rebuild-corpus", str(deb), "--corpus", str(bad), "--output-dir", str(tmp_path)]
    assert tool.main(argv) == 2
    assert capsys.readouterr() == (
        "",
        f"error: --corpus={str(bad)!r}: cannot write it (File exists: {tmp_path / 'file'})\n",
    )

    def full(src, dst):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(tool.os, "replace", full)
    with pytest.raises(tool.InputError) as e:
        tool.build_corpus(deb, corpus)
    assert str(e.value) == f"--corpus={str(corpus)!r}: cannot write it (No space left on device)"
    assert [p.name for p in corpus.parent.iterdir()] == [corpus.name]  # no corpus.jsonl.gz.tmp
    assert _corpus(corpus) == DOCS  # the previous corpus stays


def test_check_names_the_files_that_differ_exit_1(tmp_path, capsys):
    """--check retrains (from the shipped corpus) and compares file by file: an edited
    tokenizer_config.json is named, the untouched special_tokens_map.json is not."""
    import shutil

    from megatron_latentmoe.data import DEFAULT_TOKENIZER_DIR

    folder = tmp_path / "tok"
    shutil.copytree(DEFAULT_TOKENIZER_DIR, folder)
    config = folder / "tokenizer_config.json"
    config.write_text(config.read_text().replace('"add_bos_token": false', '"add_bos_token": true'))
    assert _load_tool("train_tokenizer").main(["--check", "--output-dir", str(folder)]) == 1
    out = capsys.readouterr().out
    assert out.startswith("DIFFERS: [") and "'tokenizer_config.json'" in out, out
    assert "special_tokens_map.json" not in out


def test_output_dir_whose_folder_is_not_writable_is_one_line_exit_2(tmp_path, capsys, monkeypatch):
    """The tokenizer is trained in a temporary folder beside --output-dir: where none can be
    made (faked: the tests run as root), exit 2 naming --output-dir and the folder."""
    tool = _load_tool("train_tokenizer")

    def refused(prefix, dir):
        raise PermissionError(13, "Permission denied")

    monkeypatch.setattr(tool.tempfile, "mkdtemp", refused)
    corpus = _write_jsonl(tmp_path / "corpus.jsonl", [{"text": "a few words"}])
    out = tmp_path / "a" / "tok"
    assert tool.main(["--corpus", str(corpus), "--output-dir", str(out)]) == 2
    assert capsys.readouterr() == (
        "",
        f"error: --output-dir={str(out)!r}: cannot write in {str(tmp_path)!r} (Permission "
        "denied)\n",
    )
    assert sorted(p.name for p in tmp_path.iterdir()) == ["corpus.jsonl"]


_STOPPED_MIDWAY = """
import importlib.util, signal, sys
spec = importlib.util.spec_from_file_location("tool", sys.argv[1])
tool = importlib.util.module_from_spec(spec)
spec.loader.exec_module(tool)

def train(texts, out_dir, corpus=None):  # a first file written, then the signal
    (out_dir / "tokenizer.json").write_text("{}")
    signal.raise_signal(getattr(signal, sys.argv[2]))
    raise AssertionError("the signal did not stop the run")

tool.train_tokenizer = train
sys.exit(tool.main(["--corpus", sys.argv[3], "--output-dir", sys.argv[4]]))
"""


@pytest.mark.parametrize("signame, status", [("SIGTERM", 143), ("SIGINT", 130)])
def test_a_signal_while_training_leaves_nothing_behind(tmp_path, signame, status):
    """SIGTERM (a scheduler) or Ctrl-C while the tokenizer trains: one line, exit 143 / 130, no
    --output-dir and no temporary folder beside it (SIGTERM's default exit left its
    .tokenizer-* folder, in the package's assets/ by default). A child process: without the
    handler SIGTERM would end the test run."""
    import subprocess
    import sys

    from tests.unit.test_data import REPO

    corpus = _write_jsonl(tmp_path / "corpus.jsonl", [{"text": "a text"}])
    out = tmp_path / "tok"
    tool = str(REPO / "tools" / "train_tokenizer.py")
    argv = [sys.executable, "-c", _STOPPED_MIDWAY, tool, signame, str(corpus), str(out)]
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=120)
    assert (proc.returncode, proc.stdout) == (status, ""), proc.stderr
    assert proc.stderr == "interrupted: no tokenizer written (temporary files removed)\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["corpus.jsonl"]
