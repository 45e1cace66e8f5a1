"""Pure tensor math: no I/O, runs on whatever device its tensors are on."""
