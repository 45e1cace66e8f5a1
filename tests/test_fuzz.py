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


# ---- config.json ----------------------------------------------------------------------------------------------

DELETE = object()
config_value = st.one_of(
    st.none(), st.booleans(), st.sampled_from([-1, 0, 1, 2, 3, 7, 8, 64, 127, 128, 256, 512, 4096, 2**31, 2**63, -(2**40)]),
    st.floats(allow_nan=True, allow_infinity=True), st.text(max_size=6),
    st.sampled_from(["bfloat16", "float16", "float32", "float8_e4m3fn", "llama", "deepseek_v3", "kimi_k2", "glm4_moe"]),
    st.lists(st.integers(-2, 300), max_size=3), st.dictionaries(st.text(max_size=4), st.integers(-1, 9), max_size=2),
)
# a quantization_config that lies: formats the tensors are not in, malformed blocks and groups
lying_quantization = st.one_of(
    st.fixed_dictionaries({"quant_method": st.sampled_from(["fp8", "compressed-tensors", "gptq", "awq", None, 3]),
                           "weight_block_size": st.one_of(st.none(), st.lists(st.integers(-1, 300), max_size=3))}),
    st.fixed_dictionaries({"quant_method": st.just("compressed-tensors"),
                           "format": st.sampled_from(["float-quantized", "pack-quantized", "nvfp4-pack-quantized",
                                                      "mxfp4-pack-quantized", "dense", "x"]),
                           "config_groups": st.one_of(config_value, st.fixed_dictionaries({"group_0": st.fixed_dictionaries({
                               "weights": st.fixed_dictionaries({"num_bits": st.sampled_from([4, 8, 0, "4"]),
                                                                 "group_size": config_value,
                                                                 "symmetric": config_value,
                                                                 "block_structure": config_value})})})),
                           "ignore": st.one_of(st.lists(st.text(max_size=8), max_size=2), config_value)}),
    config_value,
)


@pytest.fixture(scope="module")
def sources(tmp_path_factory, fixtures_dir):
    """A private copy of a MoE FP8 (Kimi) and a dense BF16 (Llama) fixture whose config.json each example rewrites."""
    import shutil

    from conftest import RECIPES

    from quantize import recipe

    root = tmp_path_factory.mktemp("configs")
    out = {}
    for kind, recipe_name in (("kimi-k2-fp8", "kimi-k2-w4a16"), ("llama-bf16", "dense-w4a16")):
        shutil.copytree(fixtures_dir / kind, root / kind)
        out[kind] = (root / kind, json.loads((root / kind / "config.json").read_text()),
                     recipe.load(RECIPES / f"{recipe_name}.yaml"))
    return out


@fast(5000)
@given(kind=st.sampled_from(["kimi-k2-fp8", "llama-bf16"]), data=st.data())
def test_config_variants_fail_cleanly_or_convert_to_an_output_that_verifies(sources, tmp_path, kind, data):
    """5,000 config.json variants (wrong types, signs, huge and zero sizes, missing and extra keys, a lying
    quantization_config) over real checkpoints: a one-line QuantizeError, or an output that verifies and whose
    config agrees with its own tensors. An output is converted once per distinct plan (the tensors written and the
    quantization_config): variants that differ only in fields no tensor depends on would write the same shards,
    and what verify checks of config.json (the scheme) is in the plan."""
    import shutil

    from quantize.engine import stream
    from quantize.tensor_plan import build
    from quantize.verify import verify

    src, real, r = sources[kind]
    keys = sorted(real) + ["quantization_config", "text_config", "extra_key"]
    edits = data.draw(st.lists(st.tuples(st.sampled_from(keys), st.one_of(st.just(DELETE), config_value,
                                                                       lying_quantization)), min_size=1, max_size=3))
    cfg = dict(real)
    for k, v in edits:
        if v is DELETE:
            cfg.pop(k, None)
        else:
            cfg[k] = v
    doc = cfg if data.draw(st.integers(0, 49)) else data.draw(config_value)  # now and then not an object at all
    (src / "config.json").write_text(json.dumps(doc))
    out = tmp_path / "out"
    try:
        try:
            plan = build(Checkpoint(src), r, 2**30)
            key = json.dumps([[e.tensor.name, e.action, [[s.name, s.dtype, list(s.shape)] for s in e.outputs]]
                              for e in plan.entries] + [plan.quantization_config(), str(plan.ckpt.dtype)])
            seen = test_config_variants_fail_cleanly_or_convert_to_an_output_that_verifies.__dict__.setdefault("seen", set())
            if key in seen:
                return
            seen.add(key)
            stream.run(plan, out)
        except QuantizeError as e:
            assert "\n" not in str(e) and str(e)
            return
        assert verify(out).clean
        build(Checkpoint(out), r, 2**30)  # the output's config agrees with the output's tensors
    finally:
        shutil.rmtree(out, ignore_errors=True)
        (src / "config.json").write_text(json.dumps(real))
