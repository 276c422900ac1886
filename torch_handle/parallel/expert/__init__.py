"""Expert parallelism: each MoE layer's experts split over the "ep" ranks, the tokens sent to their experts' ranks
and back by two all-to-alls, written by hand (``scratch``) and with torch's functional collectives and DTensor
(``native``); the permutation between them (``permute``) is shared."""
