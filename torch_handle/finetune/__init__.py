"""Parameter-efficient fine-tuning: LoRA (Hu et al. 2021) low-rank adapters on a frozen base, and QLoRA (Dettmers
et al. 2023), whose frozen base is stored in 4-bit NormalFloat (``nf4.py``) and dequantised on the fly."""
