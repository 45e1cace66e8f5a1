"""Calibration samples: token sequences for the layerwise engine.

DATA is a local .jsonl / .txt / .parquet file or a Hub dataset (`org/name[:split]`). A row's text is its
`text` field, `question` + `answer` (GSM8K layout), or a `messages` chat list rendered with the checkpoint's
chat template; each sampled row is one sequence of at most `seq_len` tokens. A .txt file is running text: it is
tokenized whole and cut into `seq_len`-token windows, from which samples are drawn (as GPTQ draws C4 windows).
Samples are drawn with `seed`, so the same data and seed give the same tokens; there is no padding.
Calibration data must never come from an evaluation set's test split.
"""

import json
import random
from pathlib import Path

import torch

from quantize.errors import QuantizeError, UsageError

TEXT_FIELDS = ("text", "content", "document")


def _row_text(row: dict, tokenizer) -> str | None:
    if isinstance(row.get("messages"), list):
        if getattr(tokenizer, "chat_template", None) is None:
            raise UsageError("calibration rows are chats but the checkpoint has no chat template")
        return tokenizer.apply_chat_template(row["messages"], tokenize=False)
    for f in TEXT_FIELDS:
        if isinstance(row.get(f), str):
            return row[f]
    if isinstance(row.get("question"), str) and isinstance(row.get("answer"), str):
        return f"Question: {row['question']}\nAnswer: {row['answer']}"
    return None


def _rows(spec: str) -> list[dict]:
    path = Path(spec)
    if path.is_file():
        if path.suffix == ".jsonl":
            with open(path) as f:
                return [json.loads(line) for line in f if line.strip()]
        if path.suffix == ".txt":
            return [{"running_text": path.read_text()}]
        if path.suffix == ".parquet":
            import pyarrow.parquet as pq

            return pq.read_table(path).to_pylist()
        raise UsageError(f"--calib {spec}: use a .jsonl, .txt or .parquet file, or a Hub dataset org/name[:split]")
    if "/" in spec and not path.exists() and not spec.startswith((".", "/")):
        name, _, split = spec.partition(":")
        try:
            import datasets
        except ImportError as e:
            raise QuantizeError("a Hub calibration dataset needs the `datasets` package: pip install datasets") from e
        try:
            return list(datasets.load_dataset(name, split=split or "train"))
        except Exception as e:  # datasets raises many types; the message is what the user needs
            raise QuantizeError(f"--calib {spec}: cannot load the dataset ({str(e).splitlines()[0]})") from e
    raise UsageError(f"--calib {spec}: file not found")


def load_tokenizer(folder: Path, trust_remote_code: bool = False):
    """The checkpoint's own tokenizer; its remote code runs only with --trust-remote-code."""
    from quantize import hf

    AutoTokenizer = hf.transformers().AutoTokenizer
    folder = Path(folder)
    if not any((folder / f).exists() for f in ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")) and not any(
        folder.glob("*.tiktoken")
    ):
        raise QuantizeError(f"{folder} has no tokenizer files; calibration needs the checkpoint's tokenizer")
    try:
        return AutoTokenizer.from_pretrained(folder, trust_remote_code=trust_remote_code)
    except ValueError as e:
        if "trust_remote_code" in str(e):
            raise QuantizeError(
                f"the tokenizer in {folder} is remote code; review it and pass --trust-remote-code to run it"
            ) from e
        raise QuantizeError(f"cannot load the tokenizer in {folder}: {str(e).splitlines()[0]}") from e
    except OSError as e:
        raise QuantizeError(f"{folder} has no tokenizer; calibration needs one ({str(e).splitlines()[0]})") from e


def load_samples(spec: str, tokenizer, num_samples: int, seq_len: int, seed: int = 0) -> list[torch.Tensor]:
    """`num_samples` token id tensors [1, <= seq_len] drawn with `seed`; texts shorter than 8 tokens are skipped."""
    rows = _rows(spec)
    if len(rows) == 1 and "running_text" in rows[0]:
        return _windows(rows[0]["running_text"], tokenizer, num_samples, seq_len, seed, spec)
    texts = [t for t in (_row_text(r, tokenizer) for r in rows) if t]
    if not texts:
        raise UsageError(f"--calib {spec}: no rows with text, question/answer or messages")
    order = list(range(len(texts)))
    random.Random(seed).shuffle(order)
    samples = []
    for i in order:
        ids = tokenizer(texts[i], add_special_tokens=True, truncation=True, max_length=seq_len)["input_ids"]
        if len(ids) >= 8:
            samples.append(torch.tensor([ids], dtype=torch.long))
        if len(samples) == num_samples:
            break
    if len(samples) < num_samples:
        raise UsageError(f"--calib {spec}: only {len(samples)} usable samples, {num_samples} asked for")
    return samples


def _running_ids(text: str, tokenizer, chunk_chars: int = 1 << 16) -> list[int]:
    """Token ids of a running text, tokenized a paragraph-aligned chunk at a time: a fast tokenizer holds
    offsets and more per token, so a whole file at once costs memory far beyond its size."""
    ids: list[int] = []
    start = 0
    while start < len(text):
        end = min(len(text), start + chunk_chars)
        if end < len(text):
            cut = text.rfind("\n\n", start, end)
            end = cut + 2 if cut > start else end
        ids += tokenizer(text[start:end], add_special_tokens=False)["input_ids"]
        start = end
    return ids


def _windows(text: str, tokenizer, num_samples: int, seq_len: int, seed: int, spec: str) -> list[torch.Tensor]:
    ids = _running_ids(text, tokenizer)
    n = len(ids) // seq_len
    if n < num_samples:
        raise UsageError(f"--calib {spec}: {len(ids)} tokens make {n} windows of {seq_len}, {num_samples} asked for")
    picks = sorted(random.Random(seed).sample(range(n), num_samples))
    return [torch.tensor([ids[i * seq_len : (i + 1) * seq_len]], dtype=torch.long) for i in picks]
