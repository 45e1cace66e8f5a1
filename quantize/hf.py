"""transformers, imported lean: model definitions and tokenizers only."""

import sys

# Packages transformers imports only when installed, for code calibration never runs: scikit-learn (with pandas
# and pyarrow) for assisted decoding's ROC curve, scipy for the object-detection losses. Together ~140 MB
# resident and ~2 s, measured on the SmolLM2 benchmark; lm-eval installs both.
_UNUSED = ("sklearn", "scipy")


def transformers():
    """The transformers module, its model base classes imported while scikit-learn and scipy look absent.

    Both stay importable afterwards, for whoever else needs them (lm-eval)."""
    if "transformers.modeling_utils" not in sys.modules:
        hidden = [p for p in _UNUSED if p not in sys.modules]
        for p in hidden:
            sys.modules[p] = None  # find_spec answers None, so transformers takes it as not installed
        try:
            import transformers.generation.candidate_generator  # noqa: F401
            import transformers.modeling_utils  # noqa: F401  (imports the losses)
        finally:
            for p in hidden:
                del sys.modules[p]
    import transformers

    return transformers


def compressed_tensors():
    """compressed_tensors.quantization, imported after transformers(): the library imports transformers'
    model classes, and would otherwise pull scikit-learn in by that door."""
    transformers()
    import compressed_tensors.quantization

    return compressed_tensors.quantization
