"""The second family's builder (scripts/build_gemma3.py): Gemma's tokenizer rebuilt from a GGUF's vocabulary as
SentencePiece BPE ranked by the file's scores. transformers' GGUF converter reads those scores as Unigram log
probabilities, which they are not (they are -rank), and splits words into short pieces: perplexities measured
through it would be of another tokenization than the model was trained on. A GGUF of a few tokens stands for the
real 262,144 (the real file is 240 MB from the registry: the bench builds it, not the tests)."""

import build_gemma3
import gguf


def _gguf(path, tokens: list[tuple[str, float, int]]) -> None:
    w = gguf.GGUFWriter(str(path), "gemma3")
    w.add_tokenizer_model("llama")
    w.add_token_list([t for t, _, _ in tokens])
    w.add_token_scores([float(s) for _, s, _ in tokens])
    w.add_token_types([k for _, _, k in tokens])
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def test_gemmas_tokenizer_merges_by_the_ggufs_ranks_and_keeps_its_whitespace_tokens_whole(tmp_path):
    normal, control, user = 1, build_gemma3.CONTROL, build_gemma3.USER_DEFINED
    special = [("<pad>", -1000, control), ("<eos>", -1000, control), ("<bos>", -1000, control), ("<unk>", -1000, 2)]
    chars = [(c, -100 - k, normal) for k, c in enumerate("▁Hwordle")]
    # as in the real file, short pieces rank high and whole words low ("▁w" -21, "▁world" -1408 there): a Unigram
    # over these scores sums them as log probabilities and splits "Hello" into He/ll/o and "world" into w/or/ld
    ranked = {"or": -10, "ld": -11, "▁w": -20, "He": -30, "ll": -31, "Hell": -500, "Hello": -600, "▁wo": -700,
              "▁wor": -800, "▁worl": -900, "▁world": -1000}
    pieces = [(t, float(s), normal) for t, s in ranked.items()] + [("  ", 0.0, user), ("\n\n", 0.0, user)]
    path = tmp_path / "tiny.gguf"
    _gguf(path, special + chars + pieces)
    tok = build_gemma3.tokenizer(path)
    assert tok.convert_ids_to_tokens(tok("Hello world").input_ids) == ["<bos>", "Hello", "▁world"]
    # Gemma's runs of whitespace are tokens of their own, matched before the spaces become "▁" (the word after
    # them has no "▁" then, and this vocabulary no merge to "world")
    assert tok.convert_ids_to_tokens(tok("Hello  world\n\n").input_ids) == ["<bos>", "Hello", "  ", "w", "or", "ld",
                                                                               "\n\n"]
    assert tok.decode(tok("Hello world").input_ids, skip_special_tokens=True) == "Hello world"
