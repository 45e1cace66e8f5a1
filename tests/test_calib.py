"""Calibration samples: formats, seeds, windows of running text, chat rows, clear errors."""

import json

import pytest
from conftest import ROOT

from quantize import calib
from quantize.errors import QuantizeError, UsageError

GSM8K_TRAIN = ROOT.parent / "shared" / "data" / "gsm8k" / "train.jsonl"


@pytest.fixture(scope="module")
def tokenizer(fixtures_dir):
    return calib.load_tokenizer(fixtures_dir / "llama-bf16")


def test_jsonl_rows_are_drawn_with_the_seed(tokenizer):
    a = calib.load_samples(str(GSM8K_TRAIN), tokenizer, 8, 64, seed=0)
    b = calib.load_samples(str(GSM8K_TRAIN), tokenizer, 8, 64, seed=0)
    c = calib.load_samples(str(GSM8K_TRAIN), tokenizer, 8, 64, seed=1)
    assert [x.tolist() for x in a] == [x.tolist() for x in b]
    assert [x.tolist() for x in a] != [x.tolist() for x in c]
    assert all(x.shape[0] == 1 and 8 <= x.shape[1] <= 64 for x in a)


def test_running_text_is_cut_into_windows(tokenizer, tmp_path):
    import pydoc_data.topics

    path = tmp_path / "text.txt"
    path.write_text("\n\n".join(pydoc_data.topics.topics.values()))
    windows = calib.load_samples(str(path), tokenizer, 16, 128, seed=3)
    assert all(w.shape == (1, 128) for w in windows)
    assert len({tuple(w[0].tolist()) for w in windows}) == 16
    with pytest.raises(UsageError, match="windows"):
        calib.load_samples(str(path), tokenizer, 10**6, 128)


def test_chat_rows_go_through_the_chat_template(tokenizer, tmp_path):
    path = tmp_path / "chat.jsonl"
    rows = [{"messages": [{"role": "user", "content": f"question number {i} about cats"},
                          {"role": "assistant", "content": "an answer about dogs and cats"}]} for i in range(4)]
    path.write_text("\n".join(json.dumps(r) for r in rows))
    samples = calib.load_samples(str(path), tokenizer, 4, 64)
    text = tokenizer.decode(samples[0][0])
    assert "<|user|>" in text and "<|assistant|>" in text


def test_errors_name_the_problem(tokenizer, tmp_path):
    with pytest.raises(UsageError, match="not found"):
        calib.load_samples(str(tmp_path / "missing.jsonl"), tokenizer, 4, 64)
    bad = tmp_path / "rows.csv"
    bad.write_text("a,b\n")
    with pytest.raises(UsageError, match=".jsonl, .txt or .parquet"):
        calib.load_samples(str(bad), tokenizer, 4, 64)
    empty = tmp_path / "empty.jsonl"
    empty.write_text(json.dumps({"label": 1}) + "\n")
    with pytest.raises(UsageError, match="no rows with text"):
        calib.load_samples(str(empty), tokenizer, 4, 64)
    with pytest.raises(QuantizeError, match="no tokenizer"):
        calib.load_tokenizer(tmp_path)


def test_calibration_imports_leave_scikit_learn_out(fixtures_dir):
    """What a calibrated convert imports (compressed-tensors first, then a decoder class and a tokenizer) must
    not drag in scikit-learn, pandas and scipy (~140 MB resident) through transformers' generation code and
    losses, and both must still import afterwards for lm-eval."""
    import subprocess
    import sys

    code = f"""
import sys
from quantize import recipe, calib, tensor_plan
from quantize.checkpoint import Checkpoint
r = recipe.preset("w4a16", 64, "gptq")
r.quantization_config()
tensor_plan.build(Checkpoint({str(fixtures_dir / "llama-bf16")!r}), r, 1 << 30).model.causal_lm_class()
calib.load_tokenizer({str(fixtures_dir / "llama-bf16")!r})
print(sorted(m for m in ("sklearn", "pandas", "scipy") if m in sys.modules))
import sklearn.metrics, scipy.optimize
print("ok")
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split()
    assert out == ["[]", "ok"]
