"""quantize: stream-convert giant MoE checkpoints to compressed-tensors INT4."""

__version__ = "0.1.0"
