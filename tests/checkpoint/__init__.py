"""The checkpoint tools (nybble.checkpoint and their commands): quantize, dequantize, merge,
inspect, their errors, traps, kills and fuzz suite."""
