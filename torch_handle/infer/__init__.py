"""Using a trained run: generation with a KV cache, translation (greedy, beam), evaluation (loss, BLEU/chrF)."""
