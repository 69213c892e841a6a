"""Models in and out of other formats and engines: transformers folders (io: save and reload, patched or not), GGUF
files (gguf: llama.cpp's RoPE metadata in and out), and what serving engines read of a saved checkpoint (serving).
"""
