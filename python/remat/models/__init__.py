"""Model families, one module each (llama.py: Llama, Mistral, Qwen2; gpt2.py: GPT-2;
torch_norms.py: plain PyTorch norms), registered in one table (registry.py) that remat.patch
reads; hf.py holds the Hugging Face glue they share. Each family module declares the classes it
takes, its fused layer with ``from_module`` and its byte formulas (``saved_bytes_per_token``)."""
