"""One training process: the strategy contract, the trainer's loop, its phase timer, and the torchrun worker."""
