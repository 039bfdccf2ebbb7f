"""The speed and memory levers over the plain path, one module each (compile, tiled and fused losses, low-bit
optimizers, fp8), and the catalogue that lists their flags."""
