"""Block-wise FP8 post-training quantization, the format (`fp8`): which layers, the scales, the weights a
quantized folder holds and how they load. The `kilovla quantize` command is `kilovla.quantize`."""
