"""Hugging Face interchange: LlamaForCausalLM (Llama 1-3), Qwen2ForCausalLM,
Qwen3ForCausalLM, Phi3ForCausalLM and GPT2LMHeadModel folders in and out.

`config.py` maps config.json to plait's ModelConfig and back, `mapping.py` maps parameter
names and layouts, `load.py` reads a rank's slices from safetensors, `export.py` writes a
checkpoint as a Hugging Face folder, `peft.py` reads and writes PEFT LoRA adapter folders.
"""
