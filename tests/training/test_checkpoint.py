"""Checkpoints: every damaged, forged or unwritable case is one CheckpointError naming the file and what
is wrong (never an EOFError, BadZipFile or KeyError traceback), nothing is allocated before the sizes
are checked, no write loses the previous checkpoint or leaves a temporary, files follow the umask, and a
path that cannot be written fails before training starts."""
import errno
import io
import json
import os
import struct
import subprocess
import sys
import time
import tracemalloc
import zipfile
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from npformer.cli import main
from npformer.errors import CheckpointError, NpformerError
from npformer.training import checkpoint as ckpt
from npformer.training.config import Seq2SeqTrainConfig
from npformer.training.seq2seq_trainer import Seq2SeqTrainer

META = {"kind": "gpt", "step": 3, "train_config": {"task": "charlm"}, "model_config": {"d_model": 4}}
MODEL = {"w": np.arange(12, dtype=np.float32).reshape(3, 4), "b": np.ones(4, dtype=np.float32)}
OPTIM = {"state.0.step": 3, "group.0.lr": 1e-3, "state.0.exp_avg": np.full((3, 4), 0.5, np.float32)}
TINY = ["--task", "copy", "--n-train", "200", "--steps", "4", "--warmup", "1", "--d-model", "16",
        "--heads", "2", "--layers", "1", "--ff", "32", "--batch-size", "8", "--eval-every", "0"]
SMALL = dict(task="copy", n_train=200, n_valid=20, d_model=16, heads=2, layers=1, ff=32,
             batch_size=8, steps=4, warmup=1, eval_every=0, log_every=10)
AS_ROOT = hasattr(os, "geteuid") and os.geteuid() == 0


def _save(path, model=MODEL, meta=META, optim=OPTIM):
    return ckpt.save_checkpoint(path, model, meta, optim)


def _same(a, b) -> bool:
    return (a.meta == b.meta and a.optim.keys() == b.optim.keys() and a.model.keys() == b.model.keys()
            and all(np.array_equal(a.model[k], b.model[k]) for k in a.model)
            and all(np.array_equal(a.optim[k], b.optim[k]) for k in a.optim))


def _npy(array) -> bytes:
    buf = io.BytesIO()
    np.lib.format.write_array(buf, np.asarray(array), allow_pickle=False)
    return buf.getvalue()


def _zip(path, members: dict[str, bytes], method=zipfile.ZIP_STORED):
    with zipfile.ZipFile(path, "w", compression=method) as zf:
        for name, data in members.items():
            zf.writestr(name, data)
    return path


def _members(model=MODEL, meta=META) -> dict[str, bytes]:
    out = {f"model/{k}.npy": _npy(v) for k, v in model.items()}
    out["meta.npy"] = _npy(np.frombuffer(json.dumps(meta).encode(), dtype=np.uint8))
    return out


def _set_declared_size(path, name: str, size: int):
    """Rewrite the uncompressed (and, for a stored member, the compressed) size the zip declares for
    ``name``, in its local header and its central directory entry, as a forger would."""
    data = bytearray(path.read_bytes())
    stored = zipfile.ZipFile(path).getinfo(name).compress_type == zipfile.ZIP_STORED
    for sig, csize_at, usize_at in ((b"PK\x03\x04", 18, 22), (b"PK\x01\x02", 20, 24)):
        at = 0
        while (at := data.find(sig, at)) >= 0:
            name_at = at + (30 if sig == b"PK\x03\x04" else 46)
            if data[name_at:name_at + len(name)] == name.encode():
                struct.pack_into("<I", data, at + usize_at, size)
                if stored:
                    struct.pack_into("<I", data, at + csize_at, size)
            at += 4
    path.write_bytes(bytes(data))


def _refused(path, match, **kwargs):
    with pytest.raises(CheckpointError, match=match) as info:
        ckpt.load_checkpoint(path, **kwargs)
    assert str(path) in str(info.value) and "\n" not in str(info.value)
    return info.value


# -- round trip, permissions, temporaries ------------------------------------------------------------
def test_round_trip_keeps_arrays_numbers_and_meta(tmp_path):
    back = ckpt.load_checkpoint(_save(tmp_path / "c.npz"))
    assert back.meta == META and back.optim["state.0.step"] == 3 and back.optim["group.0.lr"] == 1e-3
    assert all(np.array_equal(back.model[k], v) and back.model[k].dtype == v.dtype for k, v in MODEL.items())
    assert back.model["w"].flags.writeable and back.optim["state.0.exp_avg"].flags.writeable
    assert ckpt.load_checkpoint(tmp_path / "c.npz", expected=MODEL).meta == META       # the model fits
    assert sorted(p.name for p in tmp_path.iterdir()) == ["c.npz"]


@pytest.mark.parametrize("umask, mode", [(0o022, 0o644), (0o077, 0o600), (0o002, 0o664)])
def test_the_file_follows_the_umask(tmp_path, umask, mode):
    old = os.umask(umask)
    try:
        path = _save(tmp_path / "c.npz")
        assert os.stat(path).st_mode & 0o777 == mode
        _save(path)                                                   # replacing one: the same
        assert os.stat(path).st_mode & 0o777 == mode
    finally:
        os.umask(old)


def _dead_pid() -> int:
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait()
    return p.pid


def test_stale_temporaries_of_dead_processes_are_removed_on_save(tmp_path):
    path = tmp_path / "c.npz"
    dead = tmp_path / f".c.npz.{_dead_pid()}.tmp"                   # killed mid-write
    alive = tmp_path / f".c.npz.{os.getppid()}.tmp"                 # a live process still writing
    other = tmp_path / f".d.npz.{_dead_pid()}.tmp"                  # another checkpoint's: not ours to touch
    legacy_old, legacy_new = tmp_path / "c.npz.ab_cd123.tmp", tmp_path / "c.npz.zz9_x0yq.tmp"   # mkstemp's
    for p in (dead, alive, other, legacy_old, legacy_new):
        p.write_bytes(b"half a checkpoint")
    an_hour_ago = time.time() - ckpt.LEGACY_TMP_AGE - 60
    os.utime(legacy_old, (an_hour_ago, an_hour_ago))
    _save(path)
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(
        ["c.npz", alive.name, other.name, legacy_new.name])
    assert ckpt.remove_stale_temporaries(tmp_path / "d.npz") == [other]


def test_a_temporary_left_under_our_own_pid_is_reused(tmp_path):
    ours = tmp_path / f".c.npz.{os.getpid()}.tmp"
    ours.write_bytes(b"from a dead process that had this pid")
    _save(tmp_path / "c.npz")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["c.npz"]


# -- writing fails cleanly ---------------------------------------------------------------------------
@pytest.mark.parametrize("where", ["savez", "replace"])
def test_a_full_disk_keeps_the_previous_checkpoint_and_no_temporary(tmp_path, monkeypatch, where):
    path = _save(tmp_path / "c.npz")
    before = path.read_bytes()

    def full(*args, **kwargs):
        if where == "savez":
            args[0].write(b"half a file")
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
    monkeypatch.setattr(ckpt.np if where == "savez" else ckpt.os, where, full)
    with pytest.raises(CheckpointError, match=r"the disk is full .*; the previous checkpoint .* is intact") as info:
        _save(path, model={"w": np.zeros(3)})
    assert isinstance(info.value.__cause__, OSError) and info.value.__cause__.errno == errno.ENOSPC
    monkeypatch.undo()
    assert path.read_bytes() == before and sorted(p.name for p in tmp_path.iterdir()) == ["c.npz"]


def test_a_failed_first_write_says_nothing_was_written(tmp_path, monkeypatch):
    monkeypatch.setattr(ckpt.np, "savez", lambda f, **a: (_ for _ in ()).throw(OSError(errno.EIO, "I/O error")))
    with pytest.raises(CheckpointError, match=r"I/O error \(EIO\); no checkpoint was written"):
        _save(tmp_path / "c.npz")
    assert list(tmp_path.iterdir()) == []


def test_an_interrupt_mid_write_removes_the_temporary_and_propagates(tmp_path, monkeypatch):
    path = _save(tmp_path / "c.npz")
    monkeypatch.setattr(ckpt.np, "savez", lambda f, **a: (_ for _ in ()).throw(KeyboardInterrupt()))
    with pytest.raises(KeyboardInterrupt):
        _save(path)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["c.npz"]


def test_object_arrays_are_never_written(tmp_path):
    with pytest.raises(TypeError, match="numbers and bools only"):
        _save(tmp_path / "c.npz", model={"w": np.array([{"a": 1}], dtype=object)})
    assert list(tmp_path.iterdir()) == []


# -- paths that cannot be written: found before training ---------------------------------------------
def _bad_paths(tmp_path) -> dict[str, tuple]:
    (tmp_path / "file").write_text("x")
    (tmp_path / "dir").mkdir()
    return {"under a file": (tmp_path / "file" / "c.npz", "lies under .*file'?, which is a file"),
            "deeper under a file": (tmp_path / "file" / "sub" / "c.npz", "which is a file, not a directory"),
            "a directory": (tmp_path / "dir", "is a directory; give a file in it")}


@pytest.mark.parametrize("case", ["under a file", "deeper under a file", "a directory"])
def test_unwritable_paths_are_refused_with_what_is_wrong(tmp_path, case):
    path, message = _bad_paths(tmp_path)[case]
    for call in (ckpt.check_checkpoint_path, _save, lambda p: ckpt.check_checkpoint_path(p, create=False)):
        with pytest.raises(CheckpointError, match=message):
            call(path)
    if case == "a directory":
        with pytest.raises(CheckpointError, match="is a directory, not a checkpoint file"):
            ckpt.load_checkpoint(path)                                # not "does not exist"


@pytest.mark.skipif(AS_ROOT, reason="root ignores directory permissions: a read-only directory is writable "
                                    "to it (the under-a-file and is-a-directory cases run always)")
def test_a_read_only_directory_is_refused(tmp_path):
    ro = tmp_path / "ro"
    ro.mkdir()
    ro.chmod(0o555)
    try:
        with pytest.raises(CheckpointError, match="creating a file in .* failed: Permission denied"):
            ckpt.check_checkpoint_path(ro / "c.npz")
        with pytest.raises(CheckpointError, match="Permission denied"):
            _save(ro / "c.npz")
        assert list(ro.iterdir()) == []
    finally:
        ro.chmod(0o755)


@pytest.mark.parametrize("code, message", [(errno.EROFS, r"Read-only file system \(EROFS\)"),
                                           (errno.EACCES, r"Permission denied \(EACCES\)")])
def test_a_directory_that_refuses_new_files_is_found_by_trying_one(tmp_path, monkeypatch, code, message):
    """What a read-only mount or directory does (as root too, which ignores permissions): the check
    creates the temporary's name and reports the error."""
    def refuse(path, *args, **kwargs):
        raise OSError(code, os.strerror(code), str(path))
    monkeypatch.setattr(ckpt.os, "open", refuse)
    with pytest.raises(CheckpointError, match=f"cannot write checkpoint .*c.npz'?: creating a file in .* failed: "
                                              f"{message}"):
        ckpt.check_checkpoint_path(tmp_path / "c.npz")
    with pytest.raises(CheckpointError, match=message + "; no checkpoint was written"):
        _save(tmp_path / "c.npz")


def test_the_check_creates_missing_directories_and_leaves_no_file(tmp_path):
    path = tmp_path / "runs" / "a" / "c.npz"
    assert ckpt.check_checkpoint_path(path, create=False) == path     # the command line's, before it removes files
    assert list(tmp_path.iterdir()) == []
    assert ckpt.check_checkpoint_path(path) == path
    assert path.parent.is_dir() and list(path.parent.iterdir()) == []


def test_the_check_without_creating_refuses_a_folder_that_cannot_be_made(tmp_path, monkeypatch):
    locked = tmp_path / "locked"
    locked.mkdir()
    real = os.access
    monkeypatch.setattr(os, "access", lambda p, mode, **kw: Path(p) != locked and real(p, mode, **kw))
    with pytest.raises(CheckpointError, match="its directory cannot be created in .*locked'"):
        ckpt.check_checkpoint_path(locked / "runs" / "c.npz", create=False)
    assert list(locked.iterdir()) == []


def test_the_trainer_checks_the_path_before_the_first_step(tmp_path):
    (tmp_path / "file").write_text("x")
    trainer = Seq2SeqTrainer(Seq2SeqTrainConfig(**SMALL, checkpoint=str(tmp_path / "file" / "c.npz")),
                             log=lambda _: None)
    trainer.train_step = lambda: pytest.fail("trained before checking the checkpoint path")
    with pytest.raises(CheckpointError, match="which is a file"):
        trainer.fit()
    assert trainer.step == 0


@pytest.mark.parametrize("case", ["under a file", "a directory", "/proc"])
def test_the_command_line_prints_one_line_and_exits_2(tmp_path, capsys, case):
    if case == "/proc":
        if not os.path.isdir("/proc/self"):
            pytest.skip("no /proc on this system")
        path = "/proc/npformer-test.npz"          # a directory no one can create a file in, root included
    else:
        path = str(_bad_paths(tmp_path)[case][0])
    start = time.perf_counter()
    assert main(["train", *TINY, "--checkpoint", path]) == 2
    err = capsys.readouterr().err
    assert err.startswith("npformer train: error: ") and err.count("\n") == 1 and path in err
    assert "Traceback" not in err and time.perf_counter() - start < 30


def test_the_command_line_reports_a_damaged_checkpoint_in_one_line(tmp_path, capsys):
    (tmp_path / "empty.npz").write_bytes(b"")
    (tmp_path / "dir.npz").mkdir()
    for path, message in ((tmp_path / "empty.npz", "is empty"), (tmp_path / "dir.npz", "is a directory")):
        for argv in (["translate", "--checkpoint", str(path), "x"], ["generate", "--checkpoint", str(path)],
                     ["train", "--resume", "--checkpoint", str(path)]):
            assert main(argv) == 2
            err = capsys.readouterr().err
            assert message in err and err.count("\n") == 1, err


# -- reading: damaged files --------------------------------------------------------------------------
def test_an_empty_file(tmp_path):
    (tmp_path / "c.npz").write_bytes(b"")
    _refused(tmp_path / "c.npz", "is empty")


@pytest.mark.parametrize("fraction", [0.001, 0.1, 0.25, 0.5, 0.75, 0.9, 0.999])
def test_a_truncated_file(tmp_path, fraction):
    data = _save(tmp_path / "c.npz").read_bytes()
    (tmp_path / "c.npz").write_bytes(data[:max(1, int(len(data) * fraction))])
    _refused(tmp_path / "c.npz", "not an npformer checkpoint|truncated|damaged")


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    path = _save(tmp_path_factory.mktemp("flip") / "c.npz")
    return path, path.read_bytes(), ckpt.load_checkpoint(path)


@given(offset=st.floats(0, 1, exclude_max=True), bit=st.integers(0, 7))
def test_a_flipped_bit_is_refused_or_changes_nothing(saved, offset, bit):
    """Anywhere in the file: a CheckpointError, or (a byte the reader does not use: a time stamp, the
    local header's copy of a field) exactly the same content; never another exception, never other data."""
    path, data, original = saved
    flipped = bytearray(data)
    flipped[int(offset * len(data))] ^= 1 << bit
    bad = path.with_name("flipped.npz")
    bad.write_bytes(bytes(flipped))
    try:
        back = ckpt.load_checkpoint(bad)
    except CheckpointError as exc:
        assert str(bad) in str(exc)
    else:
        assert _same(back, original)


def test_a_flipped_bit_at_every_offset(saved):
    """The same, exhaustively: one bit (offset mod 8) flipped at each byte of the file in turn."""
    path, data, original = saved
    bad, loaded = path.with_name("every.npz"), 0
    for offset in range(len(data)):
        flipped = bytearray(data)
        flipped[offset] ^= 1 << (offset % 8)
        bad.write_bytes(bytes(flipped))
        try:
            back = ckpt.load_checkpoint(bad)
        except CheckpointError:
            continue
        assert _same(back, original), f"a flip at byte {offset} changed what was loaded"
        loaded += 1
    assert loaded < len(data) // 3                  # most bytes matter (sizes, names, headers, data, CRCs)


def test_flips_in_the_data_fail_the_crc(tmp_path):
    path = _save(tmp_path / "c.npz", model={"w": np.arange(1000, dtype=np.float64)})
    data = bytearray(path.read_bytes())
    data[data.find(np.arange(1000, dtype=np.float64)[500:501].tobytes())] ^= 1
    path.write_bytes(bytes(data))
    _refused(path, "member 'model/w' could not be read: Bad CRC-32")


# -- reading: forged sizes, shapes and dtypes --------------------------------------------------------
def _peak_bytes(fn) -> int:
    tracemalloc.start()
    try:
        fn()
    finally:
        peak = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
    return peak


def test_a_header_claiming_a_huge_shape_is_refused_before_allocating(tmp_path):
    header = _npy(np.zeros(1, dtype=np.float32)).replace(b"(1,)", b"(268435456,)")   # 1 GiB of float32
    members = {**_members(), "model/w.npy": header}
    path = _zip(tmp_path / "c.npz", members)
    peak = _peak_bytes(lambda: _refused(path, r"member 'model/w' declares \d+ bytes, less than the "
                                              r"1,073,741,952 its header needs"))
    assert peak < 10 * 2**20
    _set_declared_size(path, "model/w.npy", 2**30 + 128)       # sizes forged to agree with the header
    peak = _peak_bytes(lambda: _refused(path, "add up to more than the whole file"))
    assert peak < 10 * 2**20


def test_a_declared_size_larger_than_the_header_allows_is_refused(tmp_path):
    """A zip bomb: 12 floats' header, 1 GiB declared."""
    path = _zip(tmp_path / "c.npz", _members())
    _set_declared_size(path, "model/w.npy", 2**30)
    peak = _peak_bytes(lambda: _refused(path, "declares|more than the whole file"))
    assert peak < 10 * 2**20


def test_a_compressed_member_is_refused_before_inflating(tmp_path):
    """64 MiB of zeros deflate to 64 KiB: refused from the directory, never inflated."""
    bomb = _npy(np.zeros(2**24, dtype=np.float32))
    path = _zip(tmp_path / "c.npz", {**_members(), "model/w.npy": bomb}, method=zipfile.ZIP_DEFLATED)
    assert path.stat().st_size < 2**20
    peak = _peak_bytes(lambda: _refused(path, "member 'meta' is compressed|member 'model/w' is compressed"))
    assert peak < 10 * 2**20


def test_the_model_s_shapes_and_dtypes_are_checked_before_reading(tmp_path):
    path = _save(tmp_path / "c.npz")
    _refused(path, r"tensor 'model/w' is float32 \(3, 4\); the model has float32 \(4, 3\)",
             expected={"w": np.zeros((4, 3), np.float32), "b": MODEL["b"]})
    _refused(path, r"tensor 'model/b' is float32 \(4,\); the model has float64 \(4,\)",
             expected={"w": MODEL["w"], "b": np.ones(4)})
    _refused(path, r"missing tensors \['v'\]; unexpected tensors \['b'\]", expected={"w": (3, 4), "v": (4,)})
    assert ckpt.load_checkpoint(path, expected={"w": (3, 4), "b": (4,)}).model.keys() == MODEL.keys()


def test_pickled_objects_are_refused_without_unpickling(tmp_path):
    buf = io.BytesIO()
    np.lib.format.write_array(buf, np.array([{"a": 1}], dtype=object), allow_pickle=True)
    path = _zip(tmp_path / "c.npz", {**_members(), "model/w.npy": buf.getvalue()})
    _refused(path, "member 'model/w' has dtype object; a checkpoint holds numbers and bools only")


@pytest.mark.parametrize("members, message", [
    ({"model/w.npy": _npy(np.ones(2))}, "has no 'meta' member"),
    ({**_members(), "evil.py": b"print(1)"}, "has a member 'evil.py' that is not"),
    ({**_members(), "model/w.npy": b"\x93NUMPY garbage"}, "member 'model/w' has no readable .npy header"),
    ({**_members(), "model/w.npy": _npy(np.array(["text"]))}, "dtype <U4; a checkpoint holds numbers"),
    ({**_members(), "model/w.npy": _npy(np.ones(2, dtype=np.complex64))}, "dtype complex64"),
])
def test_members_that_are_not_a_checkpoint_s(tmp_path, members, message):
    _refused(_zip(tmp_path / "c.npz", members), message)


# -- reading: meta and values ------------------------------------------------------------------------
def test_an_empty_meta_lists_the_missing_keys(tmp_path):
    path = _save(tmp_path / "c.npz", meta={})
    _refused(path, r"meta lacks the keys \['kind', 'model_config', 'step', 'train_config'\]")
    assert ckpt.load_checkpoint(path, require_meta={}).meta == {}


@pytest.mark.parametrize("meta, message", [
    ({**META, "step": "3"}, r"meta\['step'\] is '3'; expected a non-negative int"),
    ({**META, "step": -1}, r"meta\['step'\] is -1"),
    ({**META, "train_config": None}, r"meta\['train_config'\] is None; expected a dict"),
])
def test_meta_values_of_the_wrong_type(tmp_path, meta, message):
    _refused(_save(tmp_path / "c.npz", meta=meta), message)


SCALER = {"scale": 65536.0, "growth_tracker": 3, "skipped": 0}


@pytest.mark.parametrize("key, value", [
    ("best_valid_loss", "x"), ("best_valid_loss", float("nan")), ("best_valid_loss", True), ("ranks", "x"),
    ("ranks", 0), ("ranks", 2.0), ("mask_id", -1), ("mask_id", "7"), ("sample_prompt", 3), ("loss_scaler", []),
    ("loss_scaler", {**SCALER, "scale": 0}), ("loss_scaler", {**SCALER, "growth_tracker": "x"}),
    ("loss_scaler", {"scale": 1.0})])
def test_the_optional_meta_a_trainer_reads_back_is_checked_where_present(tmp_path, key, value):
    """A forged best_valid_loss "x" ended eval in "could not convert string to float: 'x'", naming no
    file; a ranks "x" resume alike. Every meta value a trainer reads back is checked as the file is
    read, the checkpoint and the key named."""
    path = _save(tmp_path / "c.npz", meta={**META, key: value})
    expected = ckpt.OPTIONAL_META_KEYS[key]
    with pytest.raises(CheckpointError) as exc:
        ckpt.load_checkpoint(path)
    shown = json.dumps(value, sort_keys=True)[:60]                    # (a checkpoint's meta has its keys sorted)
    assert str(exc.value) == f"checkpoint '{path}': meta[{key!r}] is {shown}; expected {expected}"
    for good in ({"best_valid_loss": None}, {"best_valid_loss": 1.5}, {"ranks": 2}, {"mask_id": 0},
                 {"sample_prompt": ""}, {"loss_scaler": SCALER}):
        assert ckpt.load_checkpoint(_save(tmp_path / "g.npz", meta={**META, **good})).meta == {**META, **good}


@pytest.mark.parametrize("raw, message", [(b"\xff\xfe", "not UTF-8 JSON"), (b"{no json", "not UTF-8 JSON"),
                                          (b"[1, 2]", "holds a JSON list, not an object")])
def test_meta_that_is_not_a_json_object(tmp_path, raw, message):
    members = {**_members(), "meta.npy": _npy(np.frombuffer(raw, dtype=np.uint8))}
    _refused(_zip(tmp_path / "c.npz", members), message)


@pytest.mark.parametrize("value, counts", [(np.nan, "1 NaN and 0 infinite"), (np.inf, "0 NaN and 1 infinite")])
def test_non_finite_weights_are_refused_by_name(tmp_path, value, counts):
    w = MODEL["w"].copy()
    w[1, 2] = value
    path = _save(tmp_path / "c.npz", model={**MODEL, "w": w})
    _refused(path, f"tensor 'model/w' holds {counts} values out of 12; refusing non-finite weights")
    back = ckpt.load_checkpoint(path, allow_nonfinite=True)                 # for debugging
    assert np.array_equal(back.model["w"], w, equal_nan=True)


def test_a_missing_file_and_an_unreadable_one(tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        ckpt.load_checkpoint(tmp_path / "none.npz")
    if not AS_ROOT:
        path = _save(tmp_path / "c.npz")
        path.chmod(0)
        try:
            _refused(path, "cannot be opened: Permission denied")
        finally:
            path.chmod(0o644)


def test_every_refusal_is_an_npformer_error_and_a_value_error():
    assert issubclass(CheckpointError, NpformerError) and issubclass(CheckpointError, ValueError)
