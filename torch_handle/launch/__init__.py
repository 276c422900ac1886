"""Starting and supervising runs: torchrun, two or more nodes, Slurm."""
