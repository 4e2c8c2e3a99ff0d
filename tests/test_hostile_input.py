"""Hostile and careless input: a clear error (exit 2, a hint, no traceback), never a rewritten
config.ini, a file from outside the source, a stalled CPU or a crash."""

from __future__ import annotations

import configparser
import contextlib
import errno
import json
import os
import shutil
import stat
import subprocess
import sys
import threading
import types
from pathlib import Path

import pytest

from loader.errors import InTheWayError, PlacementError, SourceError, SourcePermissionError
from loader.parallel import Parallelism
from loader.plan import Topology, check_placement
from loader.repository import manifest
from loader.sources import FetchOptions, fetch
from loader.sources.hf import resolve_token
from tests.runs import cli, run_argv


def _run_args(source: Path, root: Path, *extra: str, tp: int = 1) -> list[str]:
    return run_argv(source, root, *extra, tp=tp)


def _user_error(code: int, err: str, *needles: str) -> None:
    assert code == 2, err
    assert "Traceback" not in err and "this is a bug" not in err
    assert "hint:" in err
    for needle in needles:
        assert needle in err, err


def _edit_config(path: Path, **changes) -> None:
    config = json.loads((path / "config.json").read_text())
    config.update(changes)
    (path / "config.json").write_text(json.dumps(config))


# --- 3: nothing from a checkpoint reaches config.ini unchecked -----------------------------


def test_a_name_with_line_breaks_cannot_rewrite_config_ini(source, tmp_path, capsys):
    _edit_config(source, _name_or_path="x\nvocab_size = 7\n[other]\nend_id = 9")
    code, out, err = cli(capsys, "convert", str(source), str(tmp_path / "out"), "--tp-size", "1")
    assert code == 0, err
    parser = configparser.ConfigParser()
    parser.read(Path(out[-1]) / "config.ini")
    assert parser.sections() == ["gptj"]
    assert parser["gptj"]["vocab_size"] == "320"
    assert parser["gptj"]["model_name"] == "x-vocab_size-7-other-end_id-9"


def test_config_ini_refuses_any_value_that_could_break_a_line():
    from loader.errors import CheckpointError
    from loader.formats.fastertransformer import FTConfig

    config = FTConfig(8, 8, 256, 2, 4, 320, 1, 2, model_name="a\n[b]")
    with pytest.raises(CheckpointError, match="ini file cannot carry"):
        config.to_ini()


# --- 4: bounded work whatever the numbers --------------------------------------------------


def test_a_huge_layer_count_gets_its_hint_at_once():
    result: list[BaseException] = []

    def check() -> None:
        try:
            check_placement(Parallelism(1, 2, 1), Topology(2), n_layer=2**61 - 1)
        except BaseException as exc:
            result.append(exc)

    worker = threading.Thread(target=check, daemon=True)
    worker.start()
    worker.join(timeout=20)  # a loop up to n_layer would run for years
    assert not worker.is_alive(), "the hint loops up to n_layer"
    assert isinstance(result[0], PlacementError)
    assert "e.g. 1" in result[0].remediation


def test_a_layer_count_beyond_the_checkpoint_is_refused_before_listing_tensors(
    source, tmp_path, capsys
):
    _edit_config(source, n_layer=200_000_000)
    code, _, err = cli(capsys, "convert", str(source), str(tmp_path / "out"), "--tp-size", "1")
    _user_error(code, err, "n_layer 200000000 exceeds")


# --- 10: user errors are exit 2 with a hint ------------------------------------------------


@pytest.mark.parametrize(
    ("changes", "needle"),
    [
        ({"n_layer": "two"}, "n_layer"),
        ({"n_head": "8"}, "n_head"),
        ({"n_layer": 2.5}, "n_layer"),
    ],
)
def test_non_numeric_hyper_parameters_are_user_errors(source, tmp_path, capsys, changes, needle):
    _edit_config(source, **changes)
    code, _, err = cli(capsys, "convert", str(source), str(tmp_path / "out"), "--tp-size", "1")
    _user_error(code, err, needle)
    code, _, err = cli(capsys, *_run_args(source, tmp_path / "root"))
    _user_error(code, err, needle)
    assert not (tmp_path / "root").exists()


def test_a_config_json_padded_past_a_real_ones_size_is_refused_before_it_is_parsed(
    source, tmp_path, capsys
):
    """A 2 MiB config.json (real ones are a few kB) was read and parsed, every time a run
    reads it: padded with empty lists up to the 64 MiB then allowed, about 1.6 GB each."""
    config = json.loads((source / "config.json").read_text())
    text = json.dumps(config)[:-1] + ', "notes": [' + ",".join(["[]"] * 2**20) + "]}"
    (source / "config.json").write_text(text)
    code, _, err = cli(capsys, "convert", str(source), str(tmp_path / "out"), "--tp-size", "1")
    _user_error(code, err, "config.json is larger than 1 MiB: not a config.json")
    code, _, err = cli(capsys, *_run_args(source, tmp_path / "root"))
    _user_error(code, err, "config.json is larger than 1 MiB: not a config.json")
    assert not (tmp_path / "root").exists()


def test_a_non_numeric_layer_norm_epsilon_is_a_user_error(source, tmp_path, capsys):
    """FasterTransformer's GPT-J uses a fixed epsilon, which stands in only for a number up to
    1e-4: config.json's is checked, not ignored."""
    _edit_config(source, layer_norm_epsilon="tiny")
    code, _, err = cli(capsys, "convert", str(source), str(tmp_path / "out"), "--tp-size", "1")
    _user_error(code, err, "layer_norm_epsilon must be a number of at least 0, got 'tiny'")
    assert not (tmp_path / "out").exists()


def test_convert_of_an_end_id_outside_the_vocabulary_is_a_user_error(source, tmp_path, capsys):
    _edit_config(source, eos_token_id=320)  # the tiny vocabulary is 320 ids
    code, _, err = cli(capsys, "convert", str(source), str(tmp_path / "out"), "--tp-size", "1")
    _user_error(code, err, "eos_token_id gives end_id = 320, not a token")
    assert not (tmp_path / "out").exists()


def test_convert_into_a_file_or_under_a_file_is_a_user_error(source, tmp_path, capsys):
    blocker = tmp_path / "a-file"
    blocker.write_text("x")
    for out in (blocker, blocker / "sub"):
        code, _, err = cli(capsys, "convert", str(source), str(out), "--tp-size", "1")
        _user_error(code, err, f"{blocker} is a file")
    assert blocker.read_text() == "x"


def _plant(path: Path, kind: str, elsewhere: Path) -> str:
    """Put ``kind`` at ``path``; what the loader must call it."""
    if kind == "file":
        path.write_text("the user's\n")
        return "a file"
    if kind == "FIFO":
        os.mkfifo(path)
        return "a FIFO"
    if kind == "dangling link":
        path.symlink_to(elsewhere / "nowhere")
        return "a dangling symbolic link"
    path.symlink_to(elsewhere / "file")
    return "a symbolic link to a file"


@pytest.mark.parametrize("kind", ["file", "FIFO", "dangling link", "link to a file"])
@pytest.mark.parametrize("option", ["run --repository", "fetch DEST", "convert OUTPUT_DIR"])
def test_a_directory_the_user_names_that_is_none_is_named_for_what_it_is(
    source, tmp_path, capsys, kind, option
):
    """ROOT, DEST or OUTPUT_DIR (or a level above it) holding no directory: exit 2 naming
    what stands there (a dangling link was a traceback, a FIFO was called a file), and
    nothing created where a link leads."""
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (elsewhere / "file").write_text("the user's\n")
    planted = tmp_path / "planted"
    what = _plant(planted, kind, elsewhere)
    for target in (planted, planted / "below"):
        if option == "run --repository":
            argv = _run_args(source, target)
        elif option == "fetch DEST":
            argv = ["fetch", "--copy", str(source), str(target)]
        else:
            argv = ["convert", str(source), str(target), "--tp-size", "1"]
        code, _, err = cli(capsys, *argv)
        _user_error(code, err, f"{planted} ", what)
    assert sorted(os.listdir(elsewhere)) == ["file"]
    assert (elsewhere / "file").read_text() == "the user's\n"


@pytest.fixture
def read_only_dir(tmp_path):
    """A directory nobody may write to: a read-only tmpfs for root, mode 0555 otherwise."""
    path = tmp_path / "read-only"
    path.mkdir()
    if os.geteuid() != 0:
        path.chmod(0o555)
        yield path
        path.chmod(0o755)
        return
    subprocess.run(["mount", "-t", "tmpfs", "-o", "ro,size=256m", "tmpfs", str(path)], check=True)
    try:
        yield path
    finally:
        subprocess.run(["umount", str(path)], check=True)


def test_convert_into_a_read_only_directory_is_a_user_error(source, read_only_dir, capsys):
    code, _, err = cli(capsys, "convert", str(source), str(read_only_dir / "out"), "--tp-size", "1")
    _user_error(code, err, "read-only file system", str(read_only_dir / "out"))


def test_a_disk_filling_after_the_weights_is_a_user_error_and_leaves_nothing(
    source, tmp_path, capsys, monkeypatch
):
    """Fault injection: the disk fills while the tokenizer files are copied."""
    from loader import fs

    def full(op: str, path: str) -> None:
        if op == "write" and "/tokenizer/" in path:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), path)

    root = tmp_path / "root"
    with fs.inject(full):
        code, out, err = cli(capsys, *_run_args(source, root))
    _user_error(code, err, "ran out of space", "Free space on the volume")
    assert out == []
    assert list((root / ".staging").iterdir()) == []
    assert list(root.glob("tiny@*")) == []


def test_the_free_space_check_counts_everything_the_repository_holds(
    source, tmp_path, capsys, monkeypatch
):
    """Free space for the weights alone, not for the tokenizer copies and the rest."""
    import loader.convert.sequential as convert

    weights = 0
    real_check = convert._check_free_space

    def report(directory, needed):
        nonlocal weights
        weights = weights or needed
        real_check(directory, needed)

    monkeypatch.setattr(convert, "_check_free_space", report)
    assert cli(capsys, *_run_args(source, tmp_path / "probe"))[0] == 0
    from loader.repository.layout import tokenizer_files
    from loader.run.verify import REPOSITORY_EXTRA_BYTES

    extra = 2 * sum(p.stat().st_size for p in tokenizer_files(source)) + REPOSITORY_EXTRA_BYTES
    weights -= extra
    free = weights + extra // 2  # the weights fit, the rest of the repository does not
    monkeypatch.setattr(
        convert.os, "fstatvfs", lambda fd: types.SimpleNamespace(f_bavail=free, f_frsize=1)
    )
    code, _, err = cli(capsys, *_run_args(source, tmp_path / "root"))
    _user_error(code, err, "Converting needs")


def test_gpus_per_replica_zero_is_refused_not_taken_as_the_default(source, tmp_path, capsys):
    code, _, err = cli(capsys, *_run_args(source, tmp_path / "root", "--gpus-per-replica", "0"))
    _user_error(code, err, "--gpus-per-replica must be at least 1")


@pytest.mark.parametrize("declared", ["auto", "float64", "int8", ["float16"]])
def test_a_dtype_the_converter_does_not_know_is_sized_as_the_weights_may_be_written(
    source, tmp_path, capsys, declared
):
    """config.json declaring a dtype the converter does not know is taken as declaring none
    (the weights' bytes decide); the memory check sized the weights in that unknown dtype
    instead: exit 2, "Cannot size weights of dtype 'auto'", with a hint ("use one of fp32,
    fp16, bf16") no flag of run follows. Now they are sized as fp32, the widest they are
    written in, and the run publishes them as it converts them."""
    _edit_config(source, torch_dtype=declared)
    code, lines, err = cli(capsys, *_run_args(source, tmp_path / "root"))
    assert code == 0, err
    assert manifest.read_manifest(Path(lines[-1]))["data_type"] == "fp32"


@pytest.mark.parametrize("content", [b"\xff\xfe\x00binary\x00", b"hf_one\nhf_two", b"hf_a b"])
def test_a_token_file_that_is_not_one_word_of_text_is_a_clear_error(tmp_path, content):
    token_file = tmp_path / "token"
    token_file.write_bytes(content)
    with pytest.raises(SourcePermissionError, match=str(token_file)) as info:
        resolve_token(FetchOptions(hf_token_file=str(token_file)))
    assert "hf_" in info.value.remediation
    assert "hf_one" not in info.value.message  # the token never shows


@pytest.mark.parametrize("name", ["../x", "a/../b", "a//b", "/etc/passwd", "a/./b", "x\0y", ""])
def test_a_hub_listing_name_that_is_not_a_plain_relative_path_is_refused(name):
    """What the Hub's listing names reaches the file system only as single names below DEST."""
    from loader.errors import SourceError
    from loader.sources import parse_uri
    from loader.sources.hf import _names

    with pytest.raises(SourceError, match="not a relative path of plain names"):
        _names(parse_uri("hf://org/name"), name)
    assert _names(parse_uri("hf://org/name"), "sub/model.safetensors") == [
        "sub",
        "model.safetensors",
    ]


@pytest.mark.parametrize(
    "name", ["model-\n.safetensors", "model-\x1b[2J.safetensors", "\x7f", "a/b\rc"]
)
def test_a_hub_listing_name_with_a_control_character_is_refused_and_shown_escaped(name):
    """A name that does not print would show in the log as it is (a line break starts a line
    of its own: a forged ``error:`` line)."""
    from loader.sources import parse_uri
    from loader.sources.hf import _names

    with pytest.raises(SourceError, match="not a relative path of plain names") as info:
        _names(parse_uri("hf://org/name"), name)
    assert repr(name) in info.value.message and name not in info.value.message


@pytest.mark.parametrize(
    "uri",
    ["hf://org/na\nme", "hf://org/name@main\nerror: forged", "hf://org/name@ma\tin",
     "hf://org/name@ma\x85in", "hf://org/na\u2028me"],
)  # fmt: skip
def test_fetch_refuses_an_hf_uri_with_a_control_character_in_one_line(
    uri, tmp_path, capsys, monkeypatch
):
    """``fetch`` passed it to the Hub library and printed the library's refusal with the line
    break in it (``run``'s key refuses ASCII control characters, not a line separator or
    NEL, which the chart's key takes alike: the fetch refuses them)."""
    monkeypatch.setenv("HF_ENDPOINT", "http://127.0.0.1:9")  # never asked: refused before
    code, _, err = cli(capsys, "fetch", uri, str(tmp_path / "dest"))
    assert code == 2, err
    assert "does not print" in err
    lines = err.splitlines()
    assert [line.split(":")[0] for line in lines if line] == ["error", "hint"], err
    assert not (tmp_path / "dest").exists()


def test_fetch_refuses_an_empty_hf_token_file_never_falling_back_to_another_token(
    tmp_path, capsys, monkeypatch
):
    """``--hf-token-file "$TOKEN_FILE"`` with the variable unset: before, the empty name was
    taken as no file, and the fetch went on with ``$HF_TOKEN`` or the stored login instead
    (here: asking a Hub that is not there until the retry deadline, exit 75)."""
    monkeypatch.setenv("HF_ENDPOINT", "http://127.0.0.1:9")  # never asked: refused before
    monkeypatch.setenv("HF_TOKEN", "hf_anotherTokenThanTheFileOne")
    try:
        code, _, err = cli(capsys, "fetch", "hf://org/name", str(tmp_path / "dest"),
                           "--hf-token-file", "", "--retry-deadline", "1")  # fmt: skip
    except SystemExit as exc:  # refused by argparse
        code, err = exc.code, capsys.readouterr().err
    assert code == 2, err
    assert "--hf-token-file" in err and "unset" in err
    assert "hf_anotherTokenThanTheFileOne" not in err
    assert not (tmp_path / "dest").exists()


@pytest.mark.parametrize("name", ["tiny\n", "x" * 300, os.fsdecode(b"ti\xffny")])
def test_run_refuses_a_model_name_with_a_newline_or_over_the_limit(source, tmp_path, capsys, name):
    """A name that is not UTF-8 text (bytes of another encoding) was refused by the configs'
    encoding, with a hint naming the numeric flags; now as a name."""
    argv = _run_args(source, tmp_path / "root")
    argv[argv.index("--model-name") + 1] = name
    code, out, err = cli(capsys, *argv)
    _user_error(code, err, "--model-name")
    assert out == []


@pytest.mark.parametrize("revision", ["v1\n", "r" * 300])
def test_run_refuses_a_revision_with_a_newline_or_over_the_limit(
    source, tmp_path, capsys, revision
):
    code, _, err = cli(capsys, *_run_args(source, tmp_path / "root", "--revision", revision))
    _user_error(code, err, "--revision")


# --- 9: links never lead out of the source or DEST; published modes -----------------------


def test_a_link_out_of_a_local_source_is_refused(source, tmp_path, capsys):
    secret = tmp_path / "secret.txt"
    secret.write_text("private")
    secret.chmod(0o600)
    (source / "merges.txt").unlink()
    (source / "merges.txt").symlink_to(secret)
    root = tmp_path / "root"
    code, _, err = cli(capsys, *_run_args(source, root))
    _user_error(code, err, "symbolic link", str(secret))
    assert not root.exists()
    with pytest.raises(SourceError, match="outside the source"):
        fetch(str(source), tmp_path / "copy", copy=True)


def test_a_link_inside_a_local_source_is_followed(source, tmp_path, capsys):
    (source / "blobs").mkdir()
    shutil.move(source / "vocab.json", source / "blobs" / "vocab.json")
    (source / "vocab.json").symlink_to(Path("blobs") / "vocab.json")
    code, out, err = cli(capsys, *_run_args(source, tmp_path / "root"))
    assert code == 0, err
    assert manifest.verify(Path(out[-1])) == []


def test_fetch_copy_never_writes_through_a_link_in_dest(source, tmp_path):
    (source / "extras").mkdir()
    (source / "extras" / "notes.txt").write_text("nested")
    dest, elsewhere = tmp_path / "dest", tmp_path / "elsewhere"
    dest.mkdir()
    elsewhere.mkdir()
    (dest / "extras").symlink_to(elsewhere)
    with pytest.raises(InTheWayError, match=r"extras \(a symbolic link\)"):
        fetch(str(source), dest, copy=True)  # found before anything is written
    assert list(elsewhere.iterdir()) == []
    (dest / "extras").unlink()
    shutil.rmtree(dest / ".partial", ignore_errors=True)
    (dest / ".partial").symlink_to(elsewhere)  # a link where downloads go: neither used nor removed
    with pytest.raises(SourceError, match=r"\.partial is a symbolic link") as refused:
        fetch(str(source), dest, copy=True)
    assert refused.value.remediation.startswith(f"Remove {dest / '.partial'}")
    assert list(elsewhere.iterdir()) == [] and (dest / ".partial").is_symlink()
    (dest / ".partial").unlink()
    fetch(str(source), dest, copy=True)
    assert (dest / "extras" / "notes.txt").read_text() == "nested"


@pytest.mark.parametrize("kind", ["file", "FIFO"])
def test_fetch_copy_names_what_stands_where_a_directory_of_the_source_goes(source, tmp_path, kind):
    """A file or a FIFO at the name of one of the source's directories in DEST is refused
    by what it is (a FIFO is not called a file), and left as it is."""
    (source / "extras").mkdir()
    (source / "extras" / "notes.txt").write_text("nested")
    dest = tmp_path / "dest"
    dest.mkdir()
    if kind == "file":
        (dest / "extras").write_text("a user's file\n")
    else:
        os.mkfifo(dest / "extras")
    with pytest.raises(InTheWayError, match=rf"extras \(a {kind}\)"):
        fetch(str(source), dest, copy=True)
    assert (dest / "extras").is_fifo() == (kind != "file")


def _under_a_strict_umask(*argv: str) -> str:
    """``model-loader`` with ``argv`` and umask 077; its output."""
    proc = subprocess.run(
        [sys.executable, "-c", "import os, sys; os.umask(0o077); from loader.cli import main; "
         "sys.exit(main(sys.argv[1:]))", *argv],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout


def _published_under_a_strict_umask(source: Path, root: Path) -> Path:
    """``model-loader run`` of ``source`` into ``root`` with umask 077; the published path."""
    return Path(_under_a_strict_umask(*_run_args(source, root)).splitlines()[-1])


def test_converted_files_are_0644_under_a_strict_umask(source, tmp_path):
    """FasterTransformer may run as another uid: a weight file it cannot open it only warns
    about, and serves the buffer unfilled. The directories were 0755, the files 0600."""
    _under_a_strict_umask("convert", str(source), str(tmp_path / "out"), "--tp-size", "2")
    converted = tmp_path / "out" / "2-gpu"
    assert stat.S_IMODE(converted.stat().st_mode) == 0o755
    files = list(converted.iterdir())
    assert len(files) > 2 and "config.ini" in {p.name for p in files}
    for path in files:
        assert stat.S_IMODE(path.stat().st_mode) == 0o644, (path, oct(path.stat().st_mode))


def test_published_files_are_0644_and_directories_0755_under_a_strict_umask(source, tmp_path):
    (source / "merges.txt").chmod(0o600)
    root = tmp_path / "root"
    published = _published_under_a_strict_umask(source, root)
    for path in [published, *published.rglob("*")]:
        mode = stat.S_IMODE(path.stat().st_mode)
        assert mode == (0o755 if path.is_dir() else 0o644), (path, oct(mode))
    with contextlib.suppress(FileNotFoundError):
        assert (
            stat.S_IMODE((published / "preprocessing/1/tokenizer/merges.txt").stat().st_mode)
            == 0o644
        )


def test_every_level_the_loader_creates_is_entered_by_another_uid_under_a_strict_umask(
    source, tmp_path
):
    """ROOT (when the loader creates it), ``<name>@<revision>`` and the key: Triton runs as
    another uid and must enter each one; a ROOT the user made keeps the user's mode."""
    made, given = tmp_path / "made" / "root", tmp_path / "given"
    made.parent.mkdir()
    given.mkdir(mode=0o750)
    given.chmod(0o750)
    for root in (made, given):
        published = _published_under_a_strict_umask(source, root)
        for level in (published.parent, published):
            assert stat.S_IMODE(level.stat().st_mode) == 0o755, (level, oct(level.stat().st_mode))
    assert stat.S_IMODE(made.stat().st_mode) == 0o755
    assert stat.S_IMODE(given.stat().st_mode) == 0o750


#: Root keeps its access to a file of mode 0 (CAP_DAC_OVERRIDE): run without it, as any user.
_AS_AN_OWNER = (
    ["setpriv", "--bounding-set", "-dac_override,-dac_read_search"] if os.geteuid() == 0 else []
)


@pytest.mark.skipif(
    bool(_AS_AN_OWNER) and shutil.which("setpriv") is None, reason="needs setpriv as root"
)
def test_a_root_made_under_a_umask_that_leaves_its_owner_no_access_is_not_left_behind(
    source, tmp_path
):
    """Under umask 0777 the loader cannot open the ROOT it has just made (mode 0): refused (2),
    and the ROOT removed; it was left there with mode 0, and refused every later run, whatever
    its umask, until someone changed its mode."""
    root = tmp_path / "root"
    proc = subprocess.run(
        [*_AS_AN_OWNER, sys.executable, "-c", "import os, sys; os.umask(0o777); "
         "from loader.cli import main; sys.exit(main(sys.argv[1:]))", *_run_args(source, root)],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    _user_error(proc.returncode, proc.stderr, str(root), "Permission denied")
    assert not os.path.lexists(root)


@pytest.fixture
def small_disk(tmp_path):
    """A tmpfs of a chosen size (root only: mount needs it); yields a function making one."""
    mounted: list[Path] = []

    def make(size: int) -> Path:
        path = tmp_path / f"disk-{len(mounted)}"
        path.mkdir()
        subprocess.run(
            ["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)], check=True
        )
        mounted.append(path)
        return path

    yield make
    for path in mounted:
        subprocess.run(["umount", str(path)], check=True)


@pytest.mark.skipif(os.geteuid() != 0, reason="mounting a tmpfs needs root")
def test_a_repository_root_with_room_for_the_weights_only_is_refused_before_writing(
    source, tmp_path, capsys, small_disk
):
    """A real small disk: the weights fit, the rest of the repository would not."""
    probe = tmp_path / "probe"
    assert cli(capsys, *_run_args(source, probe))[0] == 0
    weights = sum(p.stat().st_size for p in probe.rglob("*.bin"))
    root = small_disk(weights + 256 * 1024)
    code, out, err = cli(capsys, *_run_args(source, root))
    _user_error(code, err, "Converting needs")
    assert out == []
    assert list(root.glob("tiny@*")) == []
    assert list((root / ".staging").iterdir()) == []


def _plant_fifo(entry: Path) -> None:
    os.mkfifo(entry)


def _plant_dangling_link(entry: Path) -> None:
    entry.symlink_to("nowhere")


def _plant_link_out(entry: Path) -> None:
    entry.symlink_to("/etc/hostname")


@pytest.mark.parametrize("plant", [_plant_fifo, _plant_dangling_link, _plant_link_out])
def test_a_name_in_a_source_cannot_forge_a_line_of_the_error(source, tmp_path, capsys, plant):
    """A file name with a line break is quoted with escapes: every line of stderr is still the
    loader's own (no forged ``error:`` or ``hint:`` line)."""
    plant(source / "x\nerror: forged\rhint: forged")
    code, _, err = cli(capsys, *_run_args(source, tmp_path / "root"))
    _user_error(code, err, "'", "\\nerror: forged\\rhint: forged")
    assert not [line for line in err.splitlines() if "forged" in line.split(":")[0]], err
    assert "\r" not in err, err


def test_an_os_error_quotes_a_name_with_a_line_break():
    from loader.errors import NotOursError, typed_os_error

    typed = typed_os_error(
        OSError(errno.EACCES, "Permission denied", "/r/a\nerror: x", None, "b\n")
    )
    assert typed is not None and "\n" not in str(typed), typed
    assert "\n" not in str(NotOursError("/r/.staging/a\nerror: x", "a link", "a directory"))


def test_a_source_that_is_a_link_loop_says_so(tmp_path, capsys):
    loop = tmp_path / "ckpt"
    loop.symlink_to(loop)
    code, _, err = cli(capsys, *_run_args(loop, tmp_path / "root"))
    _user_error(code, err, "symbolic link that leads nowhere")


@pytest.mark.parametrize("where", ["root", "work-dir", "root-is-source"])
def test_a_repository_or_work_dir_inside_the_local_source_is_refused(
    source, tmp_path, capsys, where
):
    """What the loader writes there would become part of the source: the next run found the
    source changed (exit 2) for a key it had just published."""
    root = source if where == "root-is-source" else source / "models"
    extra = ("--work-dir", str(source / "work")) if where == "work-dir" else ()
    if where == "work-dir":
        root = tmp_path / "root"
    before = sorted(p.name for p in source.iterdir())
    code, _, err = cli(capsys, *_run_args(source, root, *extra))
    _user_error(code, err, "lies in the local source", "outside the checkpoint directory")
    assert sorted(p.name for p in source.iterdir()) == before


@pytest.mark.parametrize("command", ["fetch-copy", "fetch-in-place", "convert", "convert-link"])
def test_a_result_path_with_a_line_break_is_never_printed_as_two_lines(
    source, tmp_path, capsys, command
):
    """fetch and convert print their result's path as the last line, like run: a path with a
    line break is refused (before any work where the argument holds it), never printed."""
    odd = tmp_path / "a\nb"
    if command == "fetch-copy":
        argv = ["fetch", str(source), str(odd), "--copy"]
    elif command == "fetch-in-place":
        shutil.copytree(source, odd)
        argv = ["fetch", str(odd)]
    elif command == "convert":
        argv = ["convert", "--tp-size", "1", str(source), str(odd)]
    else:  # the argument is one line; the directory it resolves to is not
        odd.mkdir()
        (tmp_path / "link").symlink_to(odd)
        argv = ["convert", "--tp-size", "1", str(source), str(tmp_path / "link")]
    code, out, err = cli(capsys, *argv)
    _user_error(code, err, "holds a line break", "'" + str(tmp_path) + "/a\\nb")
    assert out == [], out
    if command in ("fetch-copy", "convert"):
        assert not odd.exists()  # refused before anything was written


def test_numbers_written_in_other_digits_are_no_numbers(tiny_checkpoint_with_tokenizer, tmp_path):
    """A pid in a staging directory's name, a ``Retry-After`` or ``Content-Length`` a server
    sends, written with a character ``isdigit`` accepts and ``int`` refuses ("²"): no number,
    never a ValueError (run, prune: exit 1 with a traceback)."""
    from loader.cli import main
    from loader.repository.key import key_filename
    from loader.repository.prune import prune
    from loader.sources.failures import retry_after_s
    from loader.sources.gcs import _refuse_more_than_the_range
    from tests.runs import published

    root = tmp_path / "models"
    assert main(run_argv(tiny_checkpoint_with_tokenizer, root)) == 0
    key = str(published(root).relative_to(root))
    planted = root / ".staging" / f"{key_filename(key)}.²-00000000.abc"
    planted.mkdir(parents=True)
    (planted / "mine.txt").write_text("mine")
    assert main(run_argv(tiny_checkpoint_with_tokenizer, root)) == 0  # finds it published
    assert main(run_argv(tiny_checkpoint_with_tokenizer, root, "--force")) == 0
    prune(root, keep=1)
    assert os.listdir(planted) == ["mine.txt"]

    failure = types.SimpleNamespace(response=types.SimpleNamespace(headers={"Retry-After": "²"}))
    assert retry_after_s(failure) is None  # type: ignore[arg-type]
    response = types.SimpleNamespace(
        request=types.SimpleNamespace(headers={"Range": "bytes=0-9"}, url="http://gcs/o"),
        status_code=206,
        headers={"Content-Length": "²"},
        close=lambda: None,
    )
    with pytest.raises(SourceError):
        _refuse_more_than_the_range(response)


def test_a_tokenizer_that_makes_the_tokenizers_library_panic_is_refused(
    tiny_checkpoint_with_tokenizer, tmp_path, capsys
):
    """vocab.json + merges.txt (no tokenizer.json) whose ids make the tokenizers library's
    Rust code panic (pyo3's PanicException, no Exception): exit 2 naming the tokenizer,
    never a traceback."""
    from loader.cli import main

    src = tmp_path / "src"
    shutil.copytree(tiny_checkpoint_with_tokenizer, src)
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        (src / name).unlink(missing_ok=True)
    (src / "vocab.json").write_text(json.dumps({"a": 0, "b": 2**32 - 1}))
    (src / "merges.txt").write_text("#version: 0.2\na b\n")
    root = tmp_path / "models"
    capsys.readouterr()
    assert main(run_argv(src, root)) == 2
    err = capsys.readouterr().err
    assert "does not load" in err and "vocab.json" in err
    assert not list(root.glob("tiny@*/*"))


#: What a tokenizer.json may add to every encoding besides its vocabulary's ids: a
#: post-processor's special token, the padding's id.
_INSERTED = {
    "post-processor": {
        "post_processor": {
            "type": "TemplateProcessing",
            "single": [{"Sequence": {"id": "A", "type_id": 0}},
                       {"SpecialToken": {"id": "<x>", "type_id": 0}}],
            "pair": [{"Sequence": {"id": "A", "type_id": 0}},
                     {"Sequence": {"id": "B", "type_id": 1}}],
            "special_tokens": {"<x>": {"id": "<x>", "ids": [100000], "tokens": ["<x>"]}},
        }
    },
    "padding": {
        "padding": {"strategy": "BatchLongest", "direction": "Right", "pad_to_multiple_of": None,
                    "pad_id": 100000, "pad_type_id": 0, "pad_token": "<pad>"}
    },
}  # fmt: skip


@pytest.mark.parametrize("inserted", [100000, 320], ids=["far", "first-past-the-end"])
@pytest.mark.parametrize("where", sorted(_INSERTED))
def test_a_tokenizer_that_inserts_an_id_beyond_the_vocabulary_is_refused(
    source, tmp_path, capsys, where, inserted
):
    """Before: only the vocabulary's ids were compared with vocab_size; a tokenizer.json whose
    post-processor (or padding) inserts id 100000 into every encoding was published, and the
    preprocessing model sent that id to FasterTransformer's embedding lookup, past the end of
    its table of 320 rows (id 320 is the first row past it)."""
    path = source / "tokenizer.json"
    added = json.loads(json.dumps(_INSERTED[where]).replace("100000", str(inserted)))
    path.write_text(json.dumps({**json.loads(path.read_text()), **added}))
    code, _, err = cli(capsys, *_run_args(source, tmp_path / "root"))
    _user_error(code, err, f"produces ids up to {inserted}", "vocab_size 320")
    assert not list((tmp_path / "root").glob("tiny@*/*"))


@pytest.mark.parametrize(
    "spelled",
    ["pytorch_model-\ud800.bin", "pytorch_model-\x85error: forged.bin",
     "pytorch_model-\u2028error: forged.bin", "pytorch_model-" + "x" * 250 + ".bin"],
    ids=["lone surrogate", "next line", "line separator", "longer than a file name"],
)  # fmt: skip
def test_an_index_naming_a_shard_no_file_can_be_named_is_refused_in_one_line(
    tiny_sharded_bin_checkpoint, tmp_path, capsys, spelled
):
    """Before: a lone surrogate (JSON spells one) reached the file system's encoder, a
    traceback and exit 1; a next-line or line-separator character was printed as it is in
    the error, starting a line of its own (``error: forged``) for whoever splits the log in
    lines; a name longer than a file name can be failed at its lookup with ENAMETOOLONG and
    a hint to shorten --repository."""
    src = tmp_path / "ckpt"
    shutil.copytree(tiny_sharded_bin_checkpoint, src)
    index = src / "pytorch_model.bin.index.json"
    document = json.loads(index.read_text())
    tensor = sorted(document["weight_map"])[0]
    document["weight_map"][tensor] = spelled
    index.write_text(json.dumps(document))  # ASCII: the surrogate spelled as \ud800
    code, _, err = cli(capsys, "convert", str(src), str(tmp_path / "out"), "--tp-size", "1")
    _user_error(code, err, "which is not a pytorch_model-*.bin file beside it")
    assert not [line for line in err.splitlines() if line.startswith("error: forged")], err
    assert "--repository" not in err, err
