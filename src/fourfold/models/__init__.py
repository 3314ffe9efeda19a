"""Llama and GPT assembled from the 3D-parallel layers, with Hugging Face import/export."""
