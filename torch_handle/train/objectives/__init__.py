"""Training objectives: what a micro-batch's loss is (language modelling, conversations, preference pairs)."""
