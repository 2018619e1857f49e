"""`kilovla quantize`: a policy folder -> its FP8 folder (`folder`) with an accuracy / size / latency report
(`report`). The FP8 format itself is `kilovla.quant.fp8`, below the policy folder that loads FP8 folders."""
