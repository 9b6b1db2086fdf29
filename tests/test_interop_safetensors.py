"""The safetensors files npformer.interop writes and reads with NumPy alone: byte layout, every dtype
npformer writes, bfloat16 widened exactly on reading, agreement with the safetensors package both ways
(where it is installed), and damaged files named."""
import json

import numpy as np
import pytest

from npformer.errors import CheckpointError, RangeError
from npformer.interop import INDEX, load_safetensors_file, load_weights, save_safetensors

DTYPES = ["float64", "float32", "float16", "int64", "int32", "int8", "uint8", "bool"]


def _tensors():
    rng = np.random.default_rng(0)
    out = {f"t.{d}": (rng.standard_normal((2, 3)) * 10).astype(d) for d in DTYPES}
    out["scalar"] = np.array(2.5, np.float32)
    out["empty"] = np.zeros((0, 4), np.float32)
    out["view"] = rng.standard_normal((4, 3)).T                  # not C-contiguous
    return out


def test_round_trip_and_layout(tmp_path):
    tensors = _tensors()
    path = save_safetensors(tmp_path / "m.safetensors", tensors, {"format": "pt"})
    back = load_safetensors_file(path)
    assert set(back) == set(tensors)
    for name, a in tensors.items():
        assert back[name].dtype == a.dtype and back[name].shape == a.shape, name
        np.testing.assert_array_equal(back[name], a, err_msg=name)
        assert back[name].flags.writeable
    raw = path.read_bytes()
    n = int.from_bytes(raw[:8], "little")
    header = json.loads(raw[8:8 + n])
    assert n % 8 == 0 and header["__metadata__"] == {"format": "pt"}
    assert header["t.float32"]["dtype"] == "F32" and header["t.bool"]["dtype"] == "BOOL"
    ends = sorted(v["data_offsets"] for k, v in header.items() if k != "__metadata__")
    assert ends[0][0] == 0 and all(a[1] == b[0] for a, b in zip(ends, ends[1:]))   # back to back
    assert 8 + n + ends[-1][1] == len(raw)


def test_the_safetensors_package_reads_ours_and_we_read_its(tmp_path):
    st = pytest.importorskip("safetensors.numpy", reason="safetensors not installed: the cross-check needs it")
    tensors = _tensors()
    save_safetensors(tmp_path / "ours.safetensors", tensors)
    theirs = st.load_file(str(tmp_path / "ours.safetensors"))
    for name, a in tensors.items():
        np.testing.assert_array_equal(theirs[name], a, err_msg=name)
    st.save_file({k: np.ascontiguousarray(v) for k, v in tensors.items()}, str(tmp_path / "theirs.safetensors"))
    ours = load_safetensors_file(tmp_path / "theirs.safetensors")
    for name, a in tensors.items():
        np.testing.assert_array_equal(ours[name], a, err_msg=name)


def test_bfloat16_is_widened_exactly(tmp_path):
    """A bfloat16 is the upper 16 bits of a float32: 1.0 is 0x3F80, -2.5 is 0xC020, 2^-129 (a float32
    subnormal) 0x0010."""
    bits = np.array([0x3F80, 0xC020, 0x0010, 0x7F80], "<u2")
    header = json.dumps({"x": {"dtype": "BF16", "shape": [4], "data_offsets": [0, 8]}}).encode()
    (tmp_path / "bf16.safetensors").write_bytes(len(header).to_bytes(8, "little") + header + bits.tobytes())
    x = load_safetensors_file(tmp_path / "bf16.safetensors")["x"]
    assert x.dtype == np.float32
    np.testing.assert_array_equal(x, np.array([1.0, -2.5, 2.0 ** -129, np.inf], np.float32))


def test_damaged_files_are_named(tmp_path):
    path = tmp_path / "bad.safetensors"
    path.write_bytes(b"abc")
    with pytest.raises(CheckpointError, match="bad.safetensors' is not a safetensors file: 3 bytes"):
        load_safetensors_file(path)
    path.write_bytes((1000).to_bytes(8, "little") + b"{}")
    with pytest.raises(CheckpointError, match="header of 1000 bytes is longer than the file"):
        load_safetensors_file(path)
    path.write_bytes((4).to_bytes(8, "little") + b"{not")
    with pytest.raises(CheckpointError, match="its header is not JSON"):
        load_safetensors_file(path)
    save_safetensors(path, {"w": np.zeros((2, 2), np.float32)})
    path.write_bytes(path.read_bytes()[:-4])                      # the data cut short
    with pytest.raises(CheckpointError, match=r"tensor 'w' of shape \(2, 2\) and dtype F32 does not fit"):
        load_safetensors_file(path)
    with pytest.raises(CheckpointError, match="safetensors has no dtype for complex128"):
        save_safetensors(tmp_path / "c.safetensors", {"z": np.zeros(2, complex)})


@pytest.mark.parametrize("header, message", [
    ([1], r"x.safetensors' is not a safetensors file: its header is an array, not a JSON object"),
    ({"a": 3}, r"x.safetensors': tensor 'a': its header entry is a number, not a JSON object"),
    ({"a": {"shape": [1], "data_offsets": [0, 4]}}, r"tensor 'a': its header entry has no dtype"),
    ({"a": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4, 5]}},
     r"tensor 'a' has data_offsets \[0, 4, 5\]; expected two ints"),
    ({"a": {"dtype": "F32", "shape": [1], "data_offsets": [0.0, 4.0]}},
     r"tensor 'a' has data_offsets \[0.0, 4.0\]; expected two ints"),
    ({"a": {"dtype": "F32", "shape": [-1, -1], "data_offsets": [0, 4]}},
     r"tensor 'a' has shape \[-1, -1\]; expected a list of non-negative ints"),
    ({"a": {"dtype": "F32", "shape": ["1"], "data_offsets": [0, 4]}}, r"tensor 'a' has shape \['1'\]"),
    ({"a": {"dtype": "F32", "shape": [True], "data_offsets": [0, 4]}}, r"tensor 'a' has shape \[True\]"),
    ({"a": {"dtype": 3, "shape": [1], "data_offsets": [0, 4]}}, r"tensor 'a' has dtype 3, which NumPy cannot"),
    ({"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 4]}},
     r"tensor 'a' of shape \(2,\) and dtype F32 does not fit its offsets \[0, 4\) in 4 bytes"),
    ({"__metadata__": {"format": 1}}, r"x.safetensors': its __metadata__ is not a JSON object of strings"),
])
def test_malformed_headers_are_named(tmp_path, header, message):
    # Found by fuzzing: these raised AttributeError, KeyError, TypeError, ValueError and numpy's errors
    path = tmp_path / "x.safetensors"
    text = json.dumps(header).encode()
    path.write_bytes(len(text).to_bytes(8, "little") + text + b"\0" * 4)
    with pytest.raises(CheckpointError, match=message):
        load_safetensors_file(path)


def test_a_malformed_index_is_named(tmp_path):
    save_safetensors(tmp_path / "s1.safetensors", {"w": np.zeros(2, np.float32)})
    for text, message in [("{not", "not valid JSON"), ("[1]", "expected a JSON object, got an array"),
                          ('{"weight_map": [1]}', "weight_map must be a JSON object"),
                          ('{"weight_map": {"w": 3}}', "weight_map must be a JSON object")]:
        (tmp_path / INDEX).write_text(text)
        with pytest.raises(RangeError, match=f"{INDEX}: {message}"):
            load_weights(tmp_path)
    (tmp_path / INDEX).write_text('{"weight_map": {"w": "s1.safetensors"}}')
    np.testing.assert_array_equal(load_weights(tmp_path)["w"], np.zeros(2, np.float32))
