"""Starting and supervising runs: torchrun, hang detection, two or more nodes, Slurm."""
