"""QLoRA's 4-bit NormalFloat base (Dettmers et al., 2023), in bitsandbytes' format.

`format.py` is the format itself (quantize, dequantize, slices, the 4.127 bits per weight);
`linear.py` is how a Linear computes over it (dequantized per use, only the packed bytes kept
for backward); `hf.py` reads and writes the tensors of a 4-bit Hugging Face checkpoint.
"""
