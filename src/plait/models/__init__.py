"""The GPT-2/LLaMA model family: architecture, the model contract parallel code reads,
layout-free initialization, keyed dropout, generation, and Hugging Face folders in and out."""
