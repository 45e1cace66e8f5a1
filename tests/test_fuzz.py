"""Fuzz the safetensors header reader and the index reader: whatever the bytes, the only failure is our clean
error (QuantizeError, one line), never a crash, a hang or a read outside the file. 12,000 generated inputs."""

import json
import struct

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from quantize.checkpoint import Checkpoint
from quantize.errors import QuantizeError
from quantize.safetensors_file import read_header, read_tensor


def fast(n: int) -> settings:
    return settings(max_examples=n, deadline=None, database=None, derandomize=True,
                    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
DTYPES = ["F32", "F16", "BF16", "I32", "I64", "U8", "I8", "F8_E4M3", "BOOL", "F64", "XX", "", "f32"]
ints = st.one_of(st.integers(-3, 70), st.integers(-(2**70), 2**70))
json_leaf = st.one_of(st.none(), st.booleans(), ints, st.floats(allow_nan=True), st.text(max_size=8))
entry = st.one_of(
    st.fixed_dictionaries({"dtype": st.sampled_from(DTYPES), "shape": st.lists(ints, max_size=4),
                           "data_offsets": st.lists(ints, min_size=0, max_size=3)}),
    st.dictionaries(st.text(max_size=12), json_leaf, max_size=4),
    json_leaf,
)
header = st.dictionaries(st.text(max_size=20), entry, max_size=6)


def checked(fn):
    try:
        fn()
    except QuantizeError as e:
        assert "\n" not in str(e) and str(e)


def read_all(path):
    for info in read_header(path).values():
        read_tensor(info)


@fast(6000)
@given(h=header, data=st.binary(max_size=96), declared=st.one_of(st.none(), st.integers(0, 2**64 - 1)))
def test_structured_headers(tmp_path, h, data, declared):
    raw = json.dumps(h).encode()
    path = tmp_path / "x.safetensors"
    path.write_bytes(struct.pack("<Q", len(raw) if declared is None else declared) + raw + data)
    checked(lambda: read_all(path))


@fast(4000)
@given(blob=st.binary(max_size=200), flips=st.lists(st.integers(0, 10_000), max_size=4))
def test_raw_and_bitflipped_bytes(tmp_path, blob, flips):
    raw = json.dumps({"w": {"dtype": "F32", "shape": [2, 2], "data_offsets": [0, 16]}, "__metadata__": {}}).encode()
    good = bytearray(struct.pack("<Q", len(raw)) + raw + bytes(16))
    for f in flips:
        good[f % len(good)] ^= 1 << (f % 8)
    path = tmp_path / "x.safetensors"
    for content in (blob, bytes(good)):
        path.write_bytes(content)
        checked(lambda: read_all(path))


name = st.one_of(st.text(max_size=20), st.sampled_from(["../x.safetensors", "/etc/passwd", "a/../../b.safetensors",
                                                        "model.safetensors", "./model.safetensors", "sub/m.safetensors",
                                                        "", ".", "..", "link.safetensors"]))


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory, fixtures_dir):
    import shutil

    root = tmp_path_factory.mktemp("idx") / "m"
    shutil.copytree(fixtures_dir / "llama-bf16", root)
    (root / "link.safetensors").symlink_to("/etc/hostname")
    return root


@fast(2000)
@given(weight_map=st.one_of(st.dictionaries(st.text(max_size=30), st.one_of(name, json_leaf), max_size=5), json_leaf),
       keep_real=st.booleans())
def test_index_files(model_dir, weight_map, keep_real):
    index = model_dir / "model.safetensors.index.json"
    real = json.loads(index.read_text()) if not hasattr(test_index_files, "real") else test_index_files.real
    test_index_files.real = real
    doc = {"metadata": {}, "weight_map": (real["weight_map"] | weight_map) if keep_real and isinstance(weight_map, dict)
           else weight_map}
    index.write_text(json.dumps(doc))
    try:
        checked(lambda: Checkpoint(model_dir))
    finally:
        index.write_text(json.dumps(real))
