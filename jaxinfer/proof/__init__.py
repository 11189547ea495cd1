"""Evidence about the engine, kept out of it: the whole-program compile check for hardware this
machine does not have (`aot`, reading the compiled HLO with `hlo_scan`) and the accuracy
evaluation of quantized weights and KV against the full-precision model (`accuracy`). The engine
never imports this package; `scripts/aot_check.py`, `scripts/quant_eval.py` and the tests do."""
