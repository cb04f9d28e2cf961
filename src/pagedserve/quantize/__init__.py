"""`pagedserve quantize`: GPTQ, AWQ, round-to-nearest and SmoothQuant over our own model code, written as
compressed-tensors checkpoints (cli.py; docs/quantized_checkpoints.md)."""
