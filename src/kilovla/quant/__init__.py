"""Post-training quantization: block-wise FP8 (`fp8`) and its accuracy / size / latency report (`report`)."""
