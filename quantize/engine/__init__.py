"""Engines drive the quant/ math over a checkpoint, one unit (shard, layer, expert) at a time."""
