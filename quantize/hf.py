"""transformers, imported lean: model definitions and tokenizers only."""

import sys


def transformers():
    """The transformers module, with its generation code imported while scikit-learn is hidden.

    Every modeling module and AutoTokenizer import transformers' generation code, which imports scikit-learn
    (and through it pandas and pyarrow: ~1.6 s and ~100 MB resident) only for assisted decoding's ROC curve.
    Calibration never generates. scikit-learn is importable again afterwards, for whoever else needs it."""
    if "transformers.generation.candidate_generator" not in sys.modules and "sklearn" not in sys.modules:
        sys.modules["sklearn"] = None  # find_spec answers None, so transformers takes it as not installed
        try:
            import transformers.generation.candidate_generator  # noqa: F401
        finally:
            del sys.modules["sklearn"]
    import transformers

    return transformers
