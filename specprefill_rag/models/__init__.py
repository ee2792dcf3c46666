"""Models: loading a main model or draft (Hugging Face id or folder, GGUF file, named model), installing
named models on demand, and the folder where converted and installed models are kept.
"""
