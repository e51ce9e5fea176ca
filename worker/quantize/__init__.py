"""Int4 (and FP8 head) checkpoints from 16-bit ones: round-to-nearest or GPTQ, the
`tokenmill quantize` command, and the perplexity used to judge them."""
